// The layer loop of a decode step, in C++, on the CPU: every token attends alone over its
// own keys (a decode row, or a verified draft's queries one by one).
//
// The matmuls are qmatmul.h's for 4/8-bit blocks, else torch's own kernels (float, int8 rows,
// int4 groups); everything between them is attention.h and kernels.h, one pass per operation. A
// decode step of a small model is otherwise ~1,500 tiny ATen calls, whose fixed costs outweighed
// their work.

// ATen and torch's pybind11 casters, not <torch/extension.h>: its torch/all.h (autograd, nn, optim)
// took ~12 s of each build's ~55 (2 cores), and a build runs on a machine's first model load.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef __linux__
#include <sys/mman.h>
#endif

#include "attention.h"
#include "kernels.h"
#include "qmatmul.h"

namespace {

using at::Tensor;
using c10::optional;

// y[t, n] float32 = x W^T for W packed by qmatmul.h (x: float32 or bfloat16).
Tensor qmatmul(const Tensor& x, const Tensor& packed, int64_t kind, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "qmatmul: x must be a 2-D CPU tensor");
  TORCH_CHECK(kind >= 0 && kind <= 2, "qmatmul: unknown kind ", kind);
  const int64_t t = x.size(0), k = x.size(1), nb = k / warmkv::qmm::kBlock;
  const int64_t tiles = (n + warmkv::qmm::kTile - 1) / warmkv::qmm::kTile;
  TORCH_CHECK(k % warmkv::qmm::kBlock == 0, "qmatmul: inputs ", k, " are not a multiple of 32");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() == tiles * nb * warmkv::qmm::block_bytes(kind),
              "qmatmul: packed weights do not match ", n, " x ", k);
  Tensor xf = x.to(at::kFloat).contiguous();
  Tensor y = at::empty({t, n}, xf.options());
  warmkv::qmm::matmul(xf.data_ptr<float>(), t, k, packed.data_ptr<uint8_t>(), kind, n, y.data_ptr<float>());
  return y;
}

// An uninitialized CPU tensor in 2 MiB-aligned memory marked for transparent huge pages (where
// the kernel grants them on request), or a plain one. Decode streams every weight once per step,
// and with 4 KiB pages a page walk interrupts the stream every 4 KiB. Measured at 1.7B's layer
// shapes: 20 -> 23 GB/s. Small tensors stay plain (the alignment would waste more than it saves).
Tensor huge_page_empty(at::IntArrayRef sizes, at::ScalarType dtype) {
  constexpr size_t kHuge = size_t{2} << 20;
  const auto opts = at::TensorOptions().dtype(dtype);
  size_t bytes = c10::elementSize(dtype);
  for (int64_t s : sizes) bytes *= static_cast<size_t>(s);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  void* p = nullptr;
  if (bytes >= 2 * kHuge && posix_memalign(&p, kHuge, bytes) == 0) {
    madvise(p, bytes & ~(kHuge - 1), MADV_HUGEPAGE);  // a hint: refused, the memory is plain pages
    return at::from_blob(p, sizes, [](void* q) { std::free(q); }, opts);
  }
#endif
  return at::empty(sizes, opts);
}

// How many threads at::parallel_for really runs on here: 1 in a build without OpenMP, whatever
// at::get_num_threads() says (its pragma then compiles to nothing).
int64_t parallel_threads() {
  std::vector<char> ran(at::get_num_threads(), 0);
  at::parallel_for(0, static_cast<int64_t>(ran.size()), 1, [&](int64_t, int64_t) { ran[at::get_thread_num()] = 1; });
  return std::count(ran.begin(), ran.end(), 1);
}

// model.Linear: 4/8-bit blocks (qmatmul, float32 out), float weights (F.linear), int8 rows or int4
// groups (torch's CPU kernels).
struct Linear {
  Tensor w;
  optional<Tensor> bias, scale;
  int64_t group = 0;
  int64_t qkind = -1, n = 0;  // qkind >= 0: w is qmatmul's packed blocks for n outputs

  Tensor operator()(const Tensor& x) const {
    if (qkind >= 0) {
      Tensor y = qmatmul(x, w, qkind, n);
      return bias ? y.add_(*bias) : y;
    }
    if (!scale) return at::linear(x, w, bias);
    Tensor y = group ? at::_weight_int4pack_mm_for_cpu(x, w, group, *scale) : at::_weight_int8pack_mm(x, w, *scale);
    return bias ? y + *bias : y;
  }

  // x + self(h), in float32.
  Tensor add_to(const Tensor& x, const Tensor& h) const {
    if (qkind < 0 && w.scalar_type() == at::kFloat && !bias) return at::addmm(x, h, w.t());
    return at::add(x, (*this)(h));
  }
};

struct Layer {
  Linear qkv, o, gate_up, down;
  optional<Tensor> qk_norm, attn_norm, ffn_norm;
};

template <typename T>
T* ptr(const Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

const float* ptr_or_null(const optional<Tensor>& t) { return t ? t->data_ptr<float>() : nullptr; }

// A pool's (or a pool layer's) rows of d elements, from its strides: (rows between slots, rows
// between the kv heads of a slot). K and V alike, each row dense, their scales a float per row.
// dim: the slot dimension (1 for a whole pool [layers, slots, n_kv, d], 0 for one layer).
std::pair<int64_t, int64_t> pool_rows(const Tensor& k, const Tensor& v, const optional<Tensor>& k_scale,
                                      const optional<Tensor>& v_scale, int64_t dim) {
  TORCH_CHECK(k.dim() == dim + 3 && k.sizes() == v.sizes() && k.strides() == v.strides(),
              "K and V: one pool's shape");
  const int64_t d = k.size(-1), slots = k.size(dim), n_kv = k.size(dim + 1);
  const bool slot_major = k.stride(dim) == n_kv * d && k.stride(dim + 1) == d;
  const bool head_major = k.stride(dim) == d && k.stride(dim + 1) == slots * d;
  TORCH_CHECK(k.stride(-1) == 1 && (slot_major || head_major) && (dim == 0 || k.stride(0) == slots * n_kv * d),
              "a pool layer must be [slots, n_kv, d] or [n_kv, slots, d] in memory, dense");
  const int64_t slot_rows = k.stride(dim) / d, head_rows = k.stride(dim + 1) / d;
  const bool int8 = k.scalar_type() == at::kChar;
  TORCH_CHECK(k_scale.has_value() == int8 && v_scale.has_value() == int8,
              int8 ? "int8 K/V need a K scale and a V scale" : "K/V scales are for int8 K/V only");
  for (const optional<Tensor>* s : {&k_scale, &v_scale}) {
    if (!*s) continue;
    const Tensor& t = **s;
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == dim + 2 && t.size(dim) == slots &&
                    t.size(dim + 1) == n_kv,
                "int8 scales: float32, a scale per slot and kv head");
    TORCH_CHECK(t.stride(dim) == slot_rows && t.stride(dim + 1) == head_rows &&
                    (dim == 0 || t.stride(0) == slots * n_kv),
                "int8 scales must be laid out as their pool rows");
  }
  return {slot_rows, head_rows};
}

// Every key slot a step reads lies in the pool's n_slots: the kernels index the pool with them.
// Its callers have checked that slots and first hold one entry per query.
void check_slots(const std::vector<Tensor>& slots, const std::vector<int64_t>& first, int64_t n_slots) {
  for (size_t i = 0; i < slots.size(); i++) {
    const Tensor& s = slots[i];
    TORCH_CHECK(s.scalar_type() == at::kLong && s.dim() == 1 && s.is_contiguous() && s.numel() >= 1,
                "query ", i, ": its keys must be a non-empty 1-D int64 tensor");
    const int64_t n = s.numel();
    if (first[i] >= 0) {
      TORCH_CHECK(first[i] + n <= n_slots, "query ", i, ": keys ", first[i], "..", first[i] + n - 1,
                  " beyond the pool's ", n_slots, " slots");
      continue;
    }
    const int64_t* p = s.data_ptr<int64_t>();
    const auto [lo, hi] = std::minmax_element(p, p + n);
    TORCH_CHECK(*lo >= 0 && *hi < n_slots, "query ", i, ": key slot ", *lo < 0 ? *lo : *hi, " outside the pool's ",
                n_slots, " slots");
  }
}

// One layer's attention as a decode step runs it, for tests: q [T, n_heads * d] float32 over the
// pool layer k/v [slots, n_kv, d] (int8 with scales [slots, n_kv]); query i's keys are slots[i], or
// the range from first[i] >= 0. kernel: "bf16" or "f32".
Tensor attend(const Tensor& q, const Tensor& k, const Tensor& v, const optional<Tensor>& k_scale,
              const optional<Tensor>& v_scale, const std::vector<Tensor>& slots, const std::vector<int64_t>& first,
              int64_t n_heads, double scale, const std::string& kernel) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 2 && k.dim() == 3, "q: [T, n_heads * d] float32");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "k, v: one pool layer");
  const int64_t t = q.size(0), n_kv = k.size(1), d = k.size(2);
  // plain locals, not a structured binding: lambdas capture them (a binding only from C++20)
  const std::pair<int64_t, int64_t> rows = pool_rows(k, v, k_scale, v_scale, 0);
  const int64_t slot_rows = rows.first, head_rows = rows.second;
  TORCH_CHECK(static_cast<int64_t>(slots.size()) == t && static_cast<int64_t>(first.size()) == t, "keys per query");
  TORCH_CHECK(q.size(1) == n_heads * d && n_heads % n_kv == 0, "q: [T, n_heads * d] with n_heads a multiple of n_kv");
  check_slots(slots, first, k.size(0));
  Tensor qc = q.contiguous(), out = at::empty_like(qc);
  std::vector<warmkv::QueryKeys> keys(t);
  for (int64_t i = 0; i < t; i++) keys[i] = {slots[i].data_ptr<int64_t>(), first[i], slots[i].size(0)};
  const bool bf16 = kernel == "bf16";
  auto run = [&](auto* kp, auto* vp) {
    using K = std::remove_const_t<std::remove_pointer_t<decltype(kp)>>;
    const warmkv::PoolLayer<K> pool{kp, vp, k_scale ? k_scale->data_ptr<float>() : nullptr,
                                    v_scale ? v_scale->data_ptr<float>() : nullptr, slot_rows, head_rows};
    warmkv::attend(qc.data_ptr<float>(), pool, keys, n_heads, n_kv, d, static_cast<float>(scale),
                   out.data_ptr<float>(), bf16);
  };
  switch (k.scalar_type()) {
    case at::kFloat: run(k.data_ptr<float>(), v.data_ptr<float>()); break;
    case at::kHalf: run(ptr<c10::Half>(k), ptr<c10::Half>(v)); break;
    case at::kBFloat16: run(ptr<c10::BFloat16>(k), ptr<c10::BFloat16>(v)); break;
    case at::kChar: run(ptr<int8_t>(k), ptr<int8_t>(v)); break;
    default: TORCH_CHECK(false, "unsupported K/V dtype ", k.scalar_type());
  }
  return out;
}

class DecodeLoop {
 public:
  DecodeLoop(int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, double eps, double scale, at::ScalarType dtype)
      : n_heads_(n_heads), n_kv_(n_kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale), dtype_(dtype) {
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "compute dtype must be float32 or bfloat16");
    TORCH_CHECK(n_kv_heads > 0 && n_heads % n_kv_heads == 0, "n_heads must be a multiple of n_kv_heads");
  }

  // linears: (w, bias, scale, group, qkind, n) for qkv, o, gate_up, down; norms: qk_norm, attn_norm, ffn_norm.
  void add_layer(const std::vector<std::tuple<Tensor, optional<Tensor>, optional<Tensor>, int64_t, int64_t, int64_t>>& linears,
                 const std::vector<optional<Tensor>>& norms) {
    TORCH_CHECK(linears.size() == 4 && norms.size() == 3, "add_layer: 4 linears and 3 norms expected");
    Layer l;
    Linear* dst[4] = {&l.qkv, &l.o, &l.gate_up, &l.down};
    for (size_t i = 0; i < 4; i++) {
      const auto& [w, bias, scale, group, qkind, n] = linears[i];
      *dst[i] = Linear{w, bias, scale, group, qkind, n};
    }
    for (const auto& n : norms) TORCH_CHECK(!n || (n->scalar_type() == at::kFloat && n->is_contiguous()));
    l.qk_norm = norms[0];
    l.attn_norm = norms[1];
    l.ffn_norm = norms[2];
    layers_.push_back(std::move(l));
  }

  // x: [T, dim] float32; slots[i]: the slot ids token i attends to (its own last), first[i] >= 0 when
  // they are one range starting there; cos/sin: [T, head_dim] float32. k_scale/v_scale: set for
  // int8 KV. Returns the residual stream after the last layer.
  Tensor run(const Tensor& x, const Tensor& k_pool, const Tensor& v_pool, const optional<Tensor>& k_scale,
             const optional<Tensor>& v_scale, const Tensor& write_slots, const std::vector<Tensor>& slots,
             const std::vector<int64_t>& first, const Tensor& cos, const Tensor& sin) const {
    const int64_t t = x.size(0);
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2, "x must be [T, dim] float32 on the CPU");
    TORCH_CHECK(static_cast<int64_t>(slots.size()) == t && static_cast<int64_t>(first.size()) == t,
                "one key range per token expected");
    TORCH_CHECK(write_slots.scalar_type() == at::kLong && write_slots.numel() == t, "one write slot per token");
    TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.numel() == t * head_dim_, "cos: [T, head_dim] float32");
    TORCH_CHECK(k_pool.dim() == 4 && k_pool.size(2) == n_kv_ && k_pool.size(3) == head_dim_, "K/V pool shape");
    TORCH_CHECK(k_pool.size(0) == static_cast<int64_t>(layers_.size()), "the K/V pool has ", k_pool.size(0),
                " layers, the model ", layers_.size());
    const std::pair<int64_t, int64_t> rows = pool_rows(k_pool, v_pool, k_scale, v_scale, 1);
    TORCH_CHECK(t >= 1, "a step needs at least one token");
    // attend() splits each query's keys in chunks: a token always sees at least itself.
    check_slots(slots, first, k_pool.size(1));
    Tensor writes = write_slots.contiguous();
    const int64_t* w = writes.data_ptr<int64_t>();
    for (int64_t i = 0; i < t; i++)
      TORCH_CHECK(w[i] >= 0 && w[i] < k_pool.size(1), "token ", i, " writes slot ", w[i], " outside the pool's ",
                  k_pool.size(1), " slots");
    Args a{x.contiguous(), k_pool, v_pool, k_scale, v_scale, rows.first, rows.second, writes,
           slots, first, cos.contiguous(), sin.contiguous()};
    const bool bf16 = dtype_ == at::kBFloat16;
    switch (k_pool.scalar_type()) {
      case at::kFloat:
        return bf16 ? loop<float, c10::BFloat16>(a) : loop<float, float>(a);
      case at::kHalf:
        return bf16 ? loop<c10::Half, c10::BFloat16>(a) : loop<c10::Half, float>(a);
      case at::kBFloat16:
        return bf16 ? loop<c10::BFloat16, c10::BFloat16>(a) : loop<c10::BFloat16, float>(a);
      case at::kChar:
        return bf16 ? loop<int8_t, c10::BFloat16>(a) : loop<int8_t, float>(a);
      default:
        TORCH_CHECK(false, "unsupported K/V dtype ", k_pool.scalar_type());
    }
  }

 private:
  struct Args {
    Tensor x;
    const Tensor &k_pool, &v_pool;
    const optional<Tensor>&k_scale, &v_scale;
    int64_t slot_rows, head_rows;  // the pools' row strides (pool_rows), checked once per step
    Tensor write_slots;
    const std::vector<Tensor>& slots;
    const std::vector<int64_t>& first;
    Tensor cos, sin;
  };

  // K: the pool's storage type; T: the compute (matmul input) type.
  template <typename K, typename T>
  Tensor loop(const Args& a) const {
    const int64_t t = a.x.size(0), dim = a.x.size(1), d = head_dim_, n_slots = a.k_pool.size(1);
    const int64_t slot_rows = a.slot_rows, head_rows = a.head_rows;
    const int64_t layer_elems = n_slots * n_kv_ * d;
    const float eps = static_cast<float>(eps_), scale = static_cast<float>(scale_);
    const auto opts = a.x.options();
    Tensor x = a.x;
    Tensor h = at::empty({t, dim}, opts.dtype(dtype_));
    Tensor q = at::empty({t, n_heads_ * d}, opts);
    Tensor o = at::empty({t, n_heads_ * d}, opts.dtype(dtype_));
    std::vector<float> att(t * n_heads_ * d);
    std::vector<warmkv::QueryKeys> keys(t);
    for (int64_t i = 0; i < t; i++) keys[i] = {a.slots[i].data_ptr<int64_t>(), a.first[i], a.slots[i].size(0)};
    const int64_t* write = a.write_slots.data_ptr<int64_t>();
    const float *cos = a.cos.data_ptr<float>(), *sin = a.sin.data_ptr<float>();
    for (size_t li = 0; li < layers_.size(); li++) {
      const Layer& L = layers_[li];
      K* kp = ptr<K>(a.k_pool) + li * layer_elems;
      K* vp = ptr<K>(a.v_pool) + li * layer_elems;
      float* ks = a.k_scale ? a.k_scale->data_ptr<float>() + li * n_slots * n_kv_ : nullptr;
      float* vs = a.v_scale ? a.v_scale->data_ptr<float>() + li * n_slots * n_kv_ : nullptr;
      norm_rows<T>(x, L.attn_norm, h);
      Tensor qkv = L.qkv(h).contiguous();
      TORCH_CHECK(qkv.scalar_type() == dtype_ && qkv.size(1) == (n_heads_ + 2 * n_kv_) * d, "qkv: unexpected shape");
      per_token(t, [&](int64_t i) {
        const int64_t slot = write[i];
        warmkv::rope_store(ptr<T>(qkv) + i * qkv.size(1), n_heads_, n_kv_, d, cos + i * d, sin + i * d,
                           ptr_or_null(L.qk_norm), eps, q.data_ptr<float>() + i * n_heads_ * d,
                           kp + slot * slot_rows * d, vp + slot * slot_rows * d, ks ? ks + slot * slot_rows : nullptr,
                           vs ? vs + slot * slot_rows : nullptr, head_rows);
      });
      const warmkv::PoolLayer<K> pool{kp, vp, ks, vs, slot_rows, head_rows};
      warmkv::attend(q.data_ptr<float>(), pool, keys, n_heads_, n_kv_, d, scale, att.data(), bf16_);
      T* op = ptr<T>(o);
      for (int64_t j = 0; j < t * n_heads_ * d; j++) op[j] = warmkv::from_f<T>(att[j]);
      x = L.o.add_to(x, o);
      norm_rows<T>(x, L.ffn_norm, h);
      Tensor gu = L.gate_up(h).contiguous();
      const int64_t hidden = gu.size(1) / 2;
      Tensor act = at::empty({t, hidden}, opts.dtype(dtype_));
      per_token(t, [&](int64_t i) { warmkv::silu_mul(ptr<T>(gu) + i * 2 * hidden, hidden, ptr<T>(act) + i * hidden); });
      x = L.down.add_to(x, act);
    }
    return x;
  }

 public:
  // The attention kernel: "bf16" (attention_bf16.h: bfloat16 products, where the CPU has them and
  // the head size is 64 or 128) or "f32" (float32 throughout). They round differently: K/V and
  // logits made under one are close to the other's, not bitwise.
  std::string attention() const { return bf16_ ? "bf16" : "f32"; }

  void set_attention(const std::string& kind) {
    TORCH_CHECK(kind == "f32" || kind == "bf16", "attention must be f32 or bf16, got ", kind);
    TORCH_CHECK(kind == "f32" || bf16_usable(head_dim_, n_heads_ / n_kv_),
                "the bf16 attention kernel needs AVX-512 BF16 and a head size of 64 or 128");
    bf16_ = kind == "bf16";
  }

  static bool bf16_usable(int64_t d, int64_t group) {
#ifdef WARMKV_BF16
    return (d == 64 || d == 128) && group <= warmkv::bf16::kMaxRows;
#else
    (void)d;
    (void)group;
    return false;
#endif
  }

 private:
  template <typename T>
  void norm_rows(const Tensor& x, const optional<Tensor>& weight, Tensor& out) const {
    const int64_t t = x.size(0), dim = x.size(1);
    const float* w = ptr_or_null(weight);
    per_token(t, [&](int64_t i) {
      warmkv::rms_norm(x.data_ptr<float>() + i * dim, w, dim, static_cast<float>(eps_), ptr<T>(out) + i * dim);
    });
  }

  // f(i) for every token: on the thread pool for a prefill piece, inline for a few decode rows (a
  // fork costs more than their work). Each token's arithmetic is its own, whatever the thread.
  template <typename F>
  static void per_token(int64_t t, const F& f) {
    at::parallel_for(0, t, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; i++) f(i);
    });
  }

  int64_t n_heads_, n_kv_, head_dim_;
  double eps_, scale_;
  at::ScalarType dtype_;
  bool bf16_ = false;  // float32 by default: bf16 is faster for prefill pieces deep in a context, slower to decode
  std::vector<Layer> layers_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<DecodeLoop>(m, "DecodeLoop")
      .def(py::init<int64_t, int64_t, int64_t, double, double, at::ScalarType>())
      .def("add_layer", &DecodeLoop::add_layer)
      // The step runs without the GIL: a server's other threads go on while a model steps.
      .def("run", &DecodeLoop::run, py::call_guard<py::gil_scoped_release>())
      .def("attention", &DecodeLoop::attention)
      .def("set_attention", &DecodeLoop::set_attention);
  m.def("qmatmul", &qmatmul, py::call_guard<py::gil_scoped_release>());
  m.def("qmatmul_isa", &warmkv::qmm::isa);
  m.def("attend", &attend, py::call_guard<py::gil_scoped_release>());
  m.def("bf16_attention", &DecodeLoop::bf16_usable);  // (head_dim, group): is the bf16 kernel built for it
  m.def("huge_page_empty", &huge_page_empty);
  m.def("parallel_threads", &parallel_threads);
  m.def("set_qmatmul_grain", [](int64_t g) { warmkv::qmm::tile_grain = std::max<int64_t>(1, g); });
}
