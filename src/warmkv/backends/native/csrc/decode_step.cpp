// The layer loop of a decode step, in C++: every token attends alone over its own keys
// (a decode row, or a verified draft's queries one by one).
//
// Each call below is the ATen op that model.py's Python forward makes at the same
// point, in the same order and on the same dtypes, so the results are bitwise those
// of the Python loop. What this saves is Python's cost per op: a decode step of a
// small model is ~1,400 small calls, and their interpreter overhead was a fifth of it.

#include <torch/extension.h>

#include <vector>

namespace {

using at::Tensor;
using c10::optional;

// model.Linear: float weights (F.linear), int8 rows or int4 groups (torch's CPU kernels).
struct Linear {
  Tensor w;
  optional<Tensor> bias, scale;
  int64_t group = 0;

  Tensor operator()(const Tensor& x) const {
    if (!scale) return at::linear(x, w, bias);
    Tensor y = group ? at::_weight_int4pack_mm_for_cpu(x, w, group, *scale) : at::_weight_int8pack_mm(x, w, *scale);
    return bias ? y + *bias : y;
  }

  Tensor add_to(const Tensor& x, const Tensor& h) const {
    if (w.scalar_type() == at::kFloat && !bias) return at::addmm(x, h, w.t());
    return at::add(x, (*this)(h));
  }
};

struct Layer {
  Linear qkv, o, gate_up, down;
  optional<Tensor> qk_norm, attn_norm, ffn_norm;
};

class DecodeLoop {
 public:
  DecodeLoop(int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, double eps, double scale, at::ScalarType dtype)
      : n_heads_(n_heads), n_kv_(n_kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale), dtype_(dtype) {}

  // linears: (w, bias, scale, group) for qkv, o, gate_up, down; norms: qk_norm, attn_norm, ffn_norm.
  void add_layer(const std::vector<std::tuple<Tensor, optional<Tensor>, optional<Tensor>, int64_t>>& linears,
                 const std::vector<optional<Tensor>>& norms) {
    TORCH_CHECK(linears.size() == 4 && norms.size() == 3, "add_layer: 4 linears and 3 norms expected");
    Layer l;
    Linear* dst[4] = {&l.qkv, &l.o, &l.gate_up, &l.down};
    for (size_t i = 0; i < 4; i++) {
      const auto& [w, bias, scale, group] = linears[i];
      *dst[i] = Linear{w, bias, scale, group};
    }
    l.qk_norm = norms[0];
    l.attn_norm = norms[1];
    l.ffn_norm = norms[2];
    layers_.push_back(std::move(l));
  }

  // x: [T, dim] float32; slots[i]: the slot ids token i attends to (its own last), first[i] >= 0 when
  // they are one range starting there. k_scale/v_scale: set for int8 KV. Returns the residual stream after the last layer.
  Tensor run(Tensor x, const Tensor& k_pool, const Tensor& v_pool, const optional<Tensor>& k_scale,
             const optional<Tensor>& v_scale, const Tensor& write_slots, const std::vector<Tensor>& slots,
             const std::vector<int64_t>& first, const Tensor& cos, const Tensor& sin) const {
    const int64_t t = x.size(0), n_qk = n_heads_ + n_kv_, qk_dim = n_qk * head_dim_;
    TORCH_CHECK(static_cast<int64_t>(slots.size()) == t && static_cast<int64_t>(first.size()) == t,
                "one key range per token expected");
    // attention.py's choice for a single query: float32 matmuls on CPU unless q and K/V are both bf16.
    const bool f32_matmuls = x.device().is_cpu() && !(dtype_ == at::kBFloat16 && k_pool.scalar_type() == at::kBFloat16);
    for (size_t li = 0; li < layers_.size(); li++) {
      const Layer& L = layers_[li];
      const int64_t layer = static_cast<int64_t>(li);
      Tensor qkv = L.qkv(norm(x, L.attn_norm).to(dtype_));
      Tensor qk = qkv.slice(1, 0, qk_dim).reshape({t, n_qk, head_dim_});
      Tensor v = qkv.slice(1, qk_dim).reshape({t, n_kv_, head_dim_});
      if (L.qk_norm) qk = (rms_scale(qk.to(at::kFloat)) * *L.qk_norm).to(dtype_);
      qk = at::addcmul(qk * cos, at::roll(qk, {head_dim_ / 2}, {-1}), sin);  // rope.apply
      Tensor q = qk.slice(1, 0, n_heads_), k = qk.slice(1, n_heads_);
      write(k_pool, k_scale, layer, write_slots, k);
      write(v_pool, v_scale, layer, write_slots, v);
      Tensor o;
      if (t == 1) {
        o = attend(q, k_pool, v_pool, k_scale, v_scale, layer, slots[0], first[0], f32_matmuls);
      } else {
        o = at::empty_like(q);
        for (int64_t i = 0; i < t; i++) {
          o.narrow(0, i, 1).copy_(
              attend(q.narrow(0, i, 1), k_pool, v_pool, k_scale, v_scale, layer, slots[i], first[i], f32_matmuls));
        }
      }
      x = L.o.add_to(x, o.reshape({t, -1}));
      auto gate_up = L.gate_up(norm(x, L.ffn_norm).to(dtype_)).chunk(2, -1);
      x = L.down.add_to(x, at::silu(gate_up[0]) * gate_up[1]);
    }
    return x;
  }

 private:
  Tensor rms_scale(const Tensor& x) const { return x * (at::mean(x * x, {-1}, true) + eps_).rsqrt_(); }

  Tensor norm(const Tensor& x, const optional<Tensor>& weight) const {
    return weight ? rms_scale(x) * *weight : rms_scale(x);
  }

  // PagedKVCache.write
  static void write(const Tensor& pool, const optional<Tensor>& scale, int64_t layer, const Tensor& slots,
                    const Tensor& x) {
    if (!scale) {
      pool.select(0, layer).index_copy_(0, slots, x.to(pool.scalar_type()));
      return;
    }
    Tensor s = x.abs().amax({-1}).clamp_min(1e-8) / 127.0;
    pool.select(0, layer).index_copy_(0, slots, at::round(x / s.unsqueeze(-1)).to(at::kChar));
    scale->select(0, layer).index_copy_(0, slots, s.to(at::kFloat));
  }

  // PagedKVCache.gather
  static Tensor take(const Tensor& t, int64_t layer, const Tensor& slots, int64_t first) {
    return first >= 0 ? t.select(0, layer).narrow(0, first, slots.size(0)) : t.select(0, layer).index_select(0, slots);
  }

  static Tensor gather(const Tensor& pool, const optional<Tensor>& scale, int64_t layer, const Tensor& slots,
                       int64_t first, at::ScalarType dtype) {
    Tensor x = take(pool, layer, slots, first);
    if (!scale) return x.to(dtype);
    return x.to(dtype) * take(*scale, layer, slots, first).unsqueeze(-1).to(dtype);
  }

  // attention._attend for a one-token row: q [1, n_heads, head_dim].
  Tensor attend(const Tensor& q, const Tensor& k_pool, const Tensor& v_pool, const optional<Tensor>& k_scale,
                const optional<Tensor>& v_scale, int64_t layer, const Tensor& slots, int64_t first,
                bool f32_matmuls) const {
    if (f32_matmuls) {
      Tensor k = gather(k_pool, k_scale, layer, slots, first, at::kFloat);
      Tensor v = gather(v_pool, v_scale, layer, slots, first, at::kFloat);
      Tensor qg = q.to(at::kFloat).reshape({n_kv_, -1, head_dim_}) * scale_;
      Tensor p = at::softmax(at::matmul(qg, k.permute({1, 2, 0})), -1);
      return at::matmul(p, v.transpose(0, 1)).view({1, -1, head_dim_}).to(q.scalar_type());
    }
    Tensor k = gather(k_pool, k_scale, layer, slots, first, q.scalar_type());
    Tensor v = gather(v_pool, v_scale, layer, slots, first, q.scalar_type());
    Tensor o = at::scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                                v.transpose(0, 1).unsqueeze(0), {}, 0.0, false, scale_, true);
    return o.select(0, 0).transpose(0, 1);
  }

  int64_t n_heads_, n_kv_, head_dim_;
  double eps_, scale_;
  at::ScalarType dtype_;
  std::vector<Layer> layers_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<DecodeLoop>(m, "DecodeLoop")
      .def(py::init<int64_t, int64_t, int64_t, double, double, at::ScalarType>())
      .def("add_layer", &DecodeLoop::add_layer)
      // The step runs without the GIL: a server's other threads go on while a model steps.
      .def("run", &DecodeLoop::run, py::call_guard<py::gil_scoped_release>());
}
