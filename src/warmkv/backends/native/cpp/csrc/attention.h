// Attention of a step's query tokens, each over its own keys, read straight from the paged K/V
// pool in its storage type (no gather, no conversion of the context).
//
// Every loop has a fixed order that depends on neither the batch, the tile a query shares, nor the
// thread count, so a token's numbers are the same alone, in a batch, or as a verified draft, and
// the same prefilled in a piece as decoded.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <tuple>
#include <vector>

#include "attention_bf16.h"
#include "parallel.h"
#include "simd.h"

namespace warmkv {

// dot(q, k) over d elements, k converted from its storage type.
template <typename K>
inline float dot(const float* q, const K* k, int64_t d) {
  int64_t j = 0;
  float s = 0.f;
#ifdef WARMKV_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= d; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), load8(k + j), acc);
  s = hsum(acc);
#endif
  for (; j < d; j++) s += q[j] * to_f(k[j]);
  return s;
}

// acc[j] += p * v[j]
template <typename K>
inline void axpy(float p, const K* v, int64_t d, float* acc) {
  int64_t j = 0;
#ifdef WARMKV_AVX2
  const __m256 pv = _mm256_set1_ps(p);
  for (; j + 8 <= d; j += 8) _mm256_storeu_ps(acc + j, _mm256_fmadd_ps(pv, load8(v + j), _mm256_loadu_ps(acc + j)));
#endif
  for (; j < d; j++) acc[j] += p * to_f(v[j]);
}

// p[i] = exp(s[i] - m), returns the sum (in a fixed order).
inline float exp_shifted(float* s, int64_t n, float m) {
  int64_t i = 0;
  float total = 0.f;
#ifdef WARMKV_AVX2
  __m256 acc = _mm256_setzero_ps();
  const __m256 mv = _mm256_set1_ps(m);
  for (; i + 8 <= n; i += 8) {
    __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv));
    _mm256_storeu_ps(s + i, p);
    acc = _mm256_add_ps(acc, p);
  }
  total = hsum(acc);
#endif
  for (; i < n; i++) {
    s[i] = std::exp(s[i] - m);
    total += s[i];
  }
  return total;
}

// One layer of a K/V pool, [slots, n_kv, d], with int8 scales [slots, n_kv] or none. Rows of d
// elements: (slot, kv head)'s is row slot * slot_rows + h * head_rows, its scale at that index
// (slot-major: slot_rows = n_kv, head_rows = 1; the engine's head-major pool: 1 and slots).
template <typename K>
struct PoolLayer {
  const K* k;
  const K* v;
  const float* k_scale;
  const float* v_scale;
  int64_t slot_rows, head_rows;
};

constexpr int64_t kChunk = 128;  // keys per chunk: fixed, so results do not depend on the thread count

// One task: a chunk of keys [t0, t0 + n) for the kv heads [h0, h1).
template <typename K>
struct Task {
  PoolLayer<K> pool;
  const int64_t* slots;
  int64_t first, h0, h1, t0, n;

  int64_t slot(int64_t i) const { return first >= 0 ? first + t0 + i : slots[t0 + i]; }
  int64_t row(int64_t i, int64_t h) const { return slot(i) * pool.slot_rows + h * pool.head_rows; }
  const K* k_row(int64_t i, int64_t h, int64_t d) const { return pool.k + row(i, h) * d; }
  const K* v_row(int64_t i, int64_t h, int64_t d) const { return pool.v + row(i, h) * d; }
  float k_scale(int64_t i, int64_t h) const { return pool.k_scale ? pool.k_scale[row(i, h)] : 1.f; }
  float v_scale(int64_t i, int64_t h) const { return pool.v_scale ? pool.v_scale[row(i, h)] : 1.f; }
  // f(i, h) for every key and kv head of the task, in the pool's memory order: a head's keys in
  // turn over a head-major pool, every head of a key in turn over a slot-major one (either way a
  // head's keys come in order, so its sums add up the same).
  template <typename F>
  void each_row(const F& f) const {
    if (pool.head_rows > 1) {
      for (int64_t h = h0; h < h1; h++)
        for (int64_t i = 0; i < n; i++) f(i, h);
    } else {
      for (int64_t i = 0; i < n; i++)
        for (int64_t h = h0; h < h1; h++) f(i, h);
    }
  }
};

// The softmax of one head's scores in place; (max, sum) into each query head's partial.
inline void softmax_parts(float* s, int64_t group, int64_t n, int64_t d, float* part) {
  for (int64_t g = 0; g < group; g++) {
    float* sg = s + g * kChunk;
    const float m = *std::max_element(sg, sg + n);
    part[g * (d + 2)] = m;
    part[g * (d + 2) + 1] = exp_shifted(sg, n, m);
  }
}

// Scores and weighted values of one task, written as (max, sum, acc[d]) per query head: kv head h's
// partials at part(h). qs: all queries, pre-scaled; s: scratch of (h1 - h0) * group * kChunk.
// Any head size and group: plain loops. Each head's arithmetic, and its order, is the same
// whatever the task's head range.
template <typename K, typename Part>
void attend_task(const Task<K>& t, const float* qs, int64_t group, int64_t d, float* s, Part part) {
  t.each_row([&](int64_t i, int64_t h) {
    const K* kr = t.k_row(i, h, d);
    const float ks = t.k_scale(i, h);
    float* sh = s + (h - t.h0) * group * kChunk;
    for (int64_t g = 0; g < group; g++) sh[g * kChunk + i] = dot(qs + (h * group + g) * d, kr, d) * ks;
  });
  for (int64_t h = t.h0; h < t.h1; h++) {
    float* p = part(h);
    softmax_parts(s + (h - t.h0) * group * kChunk, group, t.n, d, p);
    for (int64_t g = 0; g < group; g++) std::fill(p + g * (d + 2) + 2, p + (g + 1) * (d + 2), 0.f);
  }
  t.each_row([&](int64_t i, int64_t h) {
    const K* vr = t.v_row(i, h, d);
    const float vs = t.v_scale(i, h);
    const float* sh = s + (h - t.h0) * group * kChunk;
    float* p = part(h);
    for (int64_t g = 0; g < group; g++) axpy(sh[g * kChunk + i] * vs, vr, d, p + g * (d + 2) + 2);
  });
}

// Up to kTileQ query tokens of one sequence (a prefill piece's, or a draft's) over the same chunk
// of keys: each key row is read once for all of them. Query q sees the chunk's first len[q] keys
// (causal: later queries see more); its partials go to part(q, h).
constexpr int64_t kTileQ = 4;

#ifdef WARMKV_AVX2
constexpr int64_t kAhead = 8;  // keys ahead of the score loop whose key rows are prefetched

template <typename K>
inline void prefetch_row(const K* p, int64_t bytes) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
}

// Registers of a value row one pass of the value loop covers: the largest divisor of the row's NV
// registers whose G * VB accumulators and VB value registers fit the register file, so a pass's
// accumulators never spill (AVX-512's 32 registers take a whole 64-float row for up to 6 query
// heads per kv head, where AVX2's 16 took a quarter of it for 3).
template <typename L, int NV, int G>
constexpr int value_regs() {
  for (int vb = NV; vb > 1; vb--)
    if (NV % vb == 0 && (G + 1) * vb <= L::kRegs - 2) return vb;
  return 1;
}

// Head size D and group G known at compile time: each key row is converted once into registers
// and serves every query head of its group, for every query of the tile. A query's arithmetic,
// and its order, are the same whatever else is in its tile: a score is one dot product, and each
// output element accumulates its keys in order in one register lane (the same FMAs as a memory
// axpy), whatever the register width L and however many registers a pass covers.
template <typename L, typename K, int D, int G, typename Part>
void attend_tile_fixed(const Task<K>& t, const float* const* qs, const int64_t* len, int64_t nq, float* s,
                       Part part) {
  using R = typename L::R;
  static_assert(D % 16 == 0, "a row must fill whole registers of either width (the widths' bits must agree)");
  constexpr int W = L::W, NV = D / W, VB = value_regs<L, NV, G>();
  const int64_t span = t.h1 - t.h0, per_q = span * G * kChunk;
  t.each_row([&](int64_t i, int64_t h) {
    const K* kr = t.k_row(i, h, D);
    // The value rows come in while the scores are computed: the pass below reads them a key
    // at a time, and a paged pool's blocks break up the stride the hardware prefetcher follows.
    prefetch_row(t.v_row(i, h, D), D * sizeof(K));
    if (i + kAhead < t.n) prefetch_row(t.k_row(i + kAhead, h, D), D * sizeof(K));
    R k[NV];
    for (int v = 0; v < NV; v++) k[v] = L::load(kr + W * v);
    const float ks = t.k_scale(i, h);
    for (int64_t qi = 0; qi < nq; qi++) {
      if (i >= len[qi]) continue;
      float* sh = s + qi * per_q + (h - t.h0) * G * kChunk;
      for (int g = 0; g < G; g++) sh[g * kChunk + i] = L::template score<D>(qs[qi] + (h * G + g) * D, k) * ks;
    }
  });
  for (int64_t qi = 0; qi < nq; qi++) {
    const int64_t n = len[qi];
    if (n <= 0) continue;
    for (int64_t h = t.h0; h < t.h1; h++) {
      float* p = part(qi, h);
      float* sh = s + qi * per_q + (h - t.h0) * G * kChunk;
      softmax_parts(sh, G, n, D, p);
      for (int vb = 0; vb < NV; vb += VB) {
        R acc[G][VB];
        for (int g = 0; g < G; g++)
          for (int u = 0; u < VB; u++) acc[g][u] = L::zero();
        for (int64_t i = 0; i < n; i++) {
          const K* vr = t.v_row(i, h, D) + W * vb;
          const float vs = t.v_scale(i, h);
          R x[VB];
          for (int u = 0; u < VB; u++) x[u] = L::load(vr + W * u);
          for (int g = 0; g < G; g++) {
            const R w = L::set1(sh[g * kChunk + i] * vs);
            for (int u = 0; u < VB; u++) acc[g][u] = L::fma(w, x[u], acc[g][u]);
          }
        }
        for (int g = 0; g < G; g++)
          for (int u = 0; u < VB; u++) L::store(p + g * (D + 2) + 2 + W * (vb + u), acc[g][u]);
      }
    }
  }
}
#endif

#ifdef WARMKV_BF16
// One kv head's keys of a task, from key b0 of its chunk on, as bf16::attend_tile reads them.
template <typename K, int D>
struct HeadKeys {
  const Task<K>* t;
  int64_t h, b0 = 0;
  HeadKeys at(int64_t b) const { return {t, h, b0 + b}; }
  bool scaled() const { return t->pool.k_scale != nullptr; }
  // kr[i], vr[i] = the K and V rows of keys i < nb, nullptr for nb <= i < count (a multiple of 8):
  // 8 addresses in a few instructions, once a block. A key at a time, each address reloaded the
  // task's fields and took two multiplies, and the prefetch and the pack each did it again.
  void rows(int64_t nb, int64_t count, const K** kr, const K** vr) const {
    const __m512i bytes = _mm512_set1_epi64(D * static_cast<int64_t>(sizeof(K)));
    const __m512i kb = _mm512_set1_epi64(reinterpret_cast<int64_t>(t->pool.k));
    const __m512i vb = _mm512_set1_epi64(reinterpret_cast<int64_t>(t->pool.v));
    for (int64_t i = 0; i < count; i += 8) {
      const __mmask8 m = mask(nb, i);
      const __m512i at = _mm512_mul_epu32(row_ids(i, m), bytes);  // rows < 2^32
      _mm512_storeu_si512(kr + i, _mm512_maskz_add_epi64(m, kb, at));
      _mm512_storeu_si512(vr + i, _mm512_maskz_add_epi64(m, vb, at));
    }
  }
  // ks[i], vs[i] = the scales of keys i < nb, 0 for nb <= i < count (a multiple of 8), 8 at a
  // time: loaded where the 8 keys' scales lie side by side (consecutive slots of a head-major
  // pool), else gathered (through the slot list, or a pool row apart in a slot-major pool). A
  // scalar loop of them cost as much as the scores of a decode row, and the gathers were ~30% of
  // a decode row's softmax with K/V in cache.
  void scales(int64_t nb, int64_t count, float* ks, float* vs) const {
    const __m512i step = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t i = 0; i < count; i += 8) {
      const __mmask8 m = mask(nb, i);
      const __m512i row = row_ids(i, m);
      const int64_t r0 = _mm_cvtsi128_si64(_mm512_castsi512_si128(row));  // lane 0: in m unless m is empty
      const __m512i run = _mm512_add_epi64(_mm512_set1_epi64(r0), step);
      if (t->pool.slot_rows == 1 && _mm512_mask_cmpeq_epi64_mask(m, row, run) == m) {
        _mm256_storeu_ps(ks + i, _mm256_maskz_loadu_ps(m, t->pool.k_scale + (m ? r0 : 0)));
        _mm256_storeu_ps(vs + i, _mm256_maskz_loadu_ps(m, t->pool.v_scale + (m ? r0 : 0)));
        continue;
      }
      _mm256_storeu_ps(ks + i, _mm512_mask_i64gather_ps(_mm256_setzero_ps(), m, row, t->pool.k_scale, 4));
      _mm256_storeu_ps(vs + i, _mm512_mask_i64gather_ps(_mm256_setzero_ps(), m, row, t->pool.v_scale, 4));
    }
  }

 private:
  static __mmask8 mask(int64_t nb, int64_t i) {  // keys i..i + 7 that are below nb
    return static_cast<__mmask8>((1u << std::clamp<int64_t>(nb - i, 0, 8)) - 1);
  }
  // The pool rows of keys i..i + 7 (those in m; the others are unset)
  __m512i row_ids(int64_t i, __mmask8 m) const {
    const int64_t at = t->t0 + b0 + i;
    const __m512i slot = t->first >= 0
                             ? _mm512_add_epi64(_mm512_set1_epi64(t->first + at), _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7))
                             : _mm512_maskz_loadu_epi64(m, t->slots + at);
    const __m512i slot_rows = _mm512_set1_epi64(t->pool.slot_rows);
    return _mm512_add_epi64(_mm512_mul_epu32(slot, slot_rows), _mm512_set1_epi64(h * t->pool.head_rows));  // slots < 2^32
  }
};
#endif

// The keys of one query token: slot ids `slots`, or the range starting at `first` when >= 0.
struct QueryKeys {
  const int64_t* slots;
  int64_t first, n;
};

// Every query token of a step over its own keys: out[i][h] = softmax(scale * q[i][h] . K_i^T) V_i
// for every query head h, grouped by the kv head they share. q, out: [queries, n_heads * d].
// Consecutive queries over one key list (a prefill piece's tokens: each sees one more key) form
// tiles of up to kTileQ that read each key row once. Tasks of (tile, kv head range, key chunk) run
// in one parallel region for all the queries (a region per query cost each of a step's streams a
// fork and a join per layer); the partial softmaxes are merged per query in chunk order. Chunks
// start at key 0, and neither a task's head range nor its tile changes how a (query, kv head,
// chunk) partial is computed: the thread count, the other queries and where a prefill piece
// begins never change a query's bits. A token prefilled in a piece gets the numbers it gets as
// a decode row.
//
// bf16: the flash kernel of attention_bf16.h where it is built and takes the head size (bfloat16
// products, or int8 scores over int8 K: close to the float32 kernel, not bitwise), with tiles of
// up to 24 query rows and chunks of 2048 keys; else the float32 kernel above.
template <typename K>
void attend(const float* q, PoolLayer<K> pool, const std::vector<QueryKeys>& keys, int64_t n_heads, int64_t n_kv,
            int64_t d, float scale, float* out, bool bf16 = false) {
  const int64_t nq = static_cast<int64_t>(keys.size()), group = n_heads / n_kv, row = n_heads * d;
  const int64_t stride = group * (d + 2);  // per (kv head, chunk): (max, sum, acc[d]) per query head
#ifdef WARMKV_BF16
  const bool fa = bf16 && (d == 64 || d == 128) && group <= bf16::kMaxRows;
  const int64_t kChunk = fa ? bf16::kChunk : warmkv::kChunk, kTileQ = fa ? bf16::kMaxRows / group : warmkv::kTileQ;
  constexpr int64_t kMaxTile = bf16::kMaxRows;
#else
  constexpr bool fa = false;
  constexpr int64_t kMaxTile = kTileQ;
  (void)bf16;
#endif
  // Queries over one key list (a prefill piece's) share tiles, and their tiles a task order.
  auto same_keys = [&](int64_t a, int64_t b) { return keys[a].slots == keys[b].slots && keys[a].first == keys[b].first; };
  std::vector<int64_t> chunks(nq), part_at(nq + 1, 0), tile_at{0};
  for (int64_t i = 0; i < nq; i++) {
    chunks[i] = (keys[i].n + kChunk - 1) / kChunk;
    part_at[i + 1] = part_at[i] + n_kv * chunks[i] * stride;
    const int64_t t0 = tile_at.back();
    const bool joins = i > t0 && i - t0 < kTileQ && same_keys(i, t0);
    if (i > 0 && !joins) tile_at.push_back(i);
  }
  tile_at.push_back(nq);
  const int64_t n_tiles = static_cast<int64_t>(tile_at.size()) - 1;
  // A tile's longest key list (its last query's, in a causal piece) sets its chunks and its tasks' keys.
  std::vector<int64_t> tile_longest(n_tiles), tile_chunks(n_tiles);
  int64_t all_chunks = 0;
  for (int64_t j = 0; j < n_tiles; j++) {
    int64_t longest = tile_at[j];
    for (int64_t i = tile_at[j] + 1; i < tile_at[j + 1]; i++) longest = keys[i].n > keys[longest].n ? i : longest;
    tile_longest[j] = longest;
    tile_chunks[j] = chunks[longest];
    all_chunks += tile_chunks[j];
  }
  // Enough tasks for every thread (twice over: they are taken one by one, so the threads finish
  // together), each spanning as many heads as that allows.
  const int64_t spans = std::clamp<int64_t>((2 * at::get_num_threads() + all_chunks - 1) / all_chunks, 1, n_kv);
  const int64_t per_span = (n_kv + spans - 1) / spans;
  std::vector<int64_t> task_at(n_tiles + 1, 0);  // tile j's tasks: [task_at[j], task_at[j + 1])
  for (int64_t j = 0; j < n_tiles; j++) task_at[j + 1] = task_at[j] + spans * tile_chunks[j];
  // The order tasks are taken in: the tiles of one key list (a prefill piece's) side by side for
  // each (head range, chunk), so a thread reads a chunk's K/V from memory once for all of them
  // and from its cache after, where tile by tile every tile read the whole context again.
  // (tile, local task) pairs; the order changes no partial's bits.
  std::vector<std::pair<int64_t, int64_t>> order(task_at[n_tiles]);
  {
    std::vector<int64_t> list(n_tiles, 0);  // tiles over one key list share its number
    for (int64_t j = 1; j < n_tiles; j++) list[j] = list[j - 1] + (same_keys(tile_at[j - 1], tile_at[j]) ? 0 : 1);
    for (int64_t j = 0; j < n_tiles; j++)
      for (int64_t local = 0; local < task_at[j + 1] - task_at[j]; local++) order[task_at[j] + local] = {j, local};
    auto key = [&](const std::pair<int64_t, int64_t>& t) {  // (key list, head range, chunk)
      const int64_t nc = tile_chunks[t.first];
      return std::make_tuple(list[t.first], t.second / nc, t.second % nc);
    };
    std::stable_sort(order.begin(), order.end(), [&](const auto& x, const auto& y) { return key(x) < key(y); });
  }
  // Every partial is written before it is read: no need to zero megabytes of it per layer.
  std::unique_ptr<float[]> part(new float[part_at[nq]]);
  std::vector<float> qs(fa ? 0 : nq * row);
  for (int64_t i = 0; i < static_cast<int64_t>(qs.size()); i++) qs[i] = q[i] * scale;
#ifdef WARMKV_BF16
  // int8 keys: a row per (query, head) of int8 query bytes; else bfloat16 pairs
  constexpr bool i8 = std::is_same_v<K, int8_t>;
  std::vector<uint32_t> qb(fa ? nq * row / (i8 ? 4 : 2) : 0);
  std::vector<float> qscale(fa && i8 ? nq * n_heads : 0);
  std::vector<int32_t> qsum(qscale.size());
  if (fa && i8) bf16::quantize_queries(q, nq * n_heads, d, scale, qb.data(), qscale.data(), qsum.data());
  else if (fa) bf16::round_queries(q, nq * row, scale, qb.data());
#endif
  parallel_tasks(task_at[n_tiles], [&](const auto& take) {
    std::vector<float> s(fa ? 0 : kTileQ * per_span * group * kChunk);
    auto tile_of = [&](int64_t task) { return order[task].first; };
    // task (of tile j)'s keys, kv heads and chunk (no heads: h0 >= h1)
    auto task_keys = [&](int64_t task, int64_t j) {
      const int64_t local = order[task].second, nc = tile_chunks[j], c = local % nc;
      const int64_t h0 = (local / nc) * per_span, h1 = std::min(n_kv, h0 + per_span);
      const QueryKeys& k = keys[tile_longest[j]];
      return Task<K>{pool, k.slots, k.first, h0, h1, c * kChunk, std::min(kChunk, k.n - c * kChunk)};
    };
    // Each thread claims its next task before it runs the current one, so that the current one's
    // last blocks prefetch the next one's first: they lie elsewhere in the pool, where the
    // hardware prefetcher has no stream to follow.
    int64_t task = 0, next = 0;
    bool has_next = false;
    for (bool ok = take(task); ok; ok = has_next, task = next) {
      has_next = take(next);
      const Task<K> after = has_next ? task_keys(next, tile_of(next)) : Task<K>{pool, nullptr, 0, 0, 0, 0, 0};
      const int64_t j = tile_of(task), i0 = tile_at[j], nt = tile_at[j + 1] - i0;
      const Task<K> t = task_keys(task, j);
      const int64_t h0 = t.h0, h1 = t.h1, c = t.t0 / kChunk;
      if (h0 >= h1) continue;
      int64_t len[kMaxTile];
      const float* qt[kMaxTile];
      for (int64_t u = 0; u < nt; u++) {
        len[u] = std::clamp<int64_t>(keys[i0 + u].n - c * kChunk, 0, kChunk);
        qt[u] = fa ? nullptr : qs.data() + (i0 + u) * row;
      }
      auto part_of = [&](int64_t u, int64_t h) {
        return part.get() + part_at[i0 + u] + (h * chunks[i0 + u] + c) * stride;
      };
#ifdef WARMKV_BF16
      if (fa) {
        const uint32_t* qr[bf16::kMaxRows];
        float qsc[bf16::kMaxRows];  // int8 queries: each row's scale and byte sum
        int32_t qsums[bf16::kMaxRows];
        for (int64_t h = h0; h < h1; h++) {
          for (int64_t u = 0; u < nt; u++) {
            for (int64_t g = 0; g < group; g++) {
              const int64_t r = (i0 + u) * n_heads + h * group + g;
              qr[u * group + g] = qb.data() + r * d / (i8 ? 4 : 2);
              if (i8) qsc[u * group + g] = qscale[r], qsums[u * group + g] = qsum[r];
            }
          }
          auto out_of = [&](int64_t u, int64_t g) { return part_of(u, h) + g * (d + 2); };
          // then: the next head's keys of the same chunk, or past the last head the next task's first
          const bool last = h + 1 == h1;
          const Task<K>* tt = last ? &after : &t;
          const int64_t th = last ? after.h0 : h + 1, then_n = !last || after.h0 < after.h1 ? tt->n : 0;
          if (d == 64)
            bf16::attend_tile<K, 64>(HeadKeys<K, 64>{&t, h}, t.n, qr, qsc, qsums, len, nt, group, out_of,
                                     HeadKeys<K, 64>{tt, th}, then_n);
          else
            bf16::attend_tile<K, 128>(HeadKeys<K, 128>{&t, h}, t.n, qr, qsc, qsums, len, nt, group, out_of,
                                      HeadKeys<K, 128>{tt, th}, then_n);
        }
        continue;
      }
#endif
#ifdef WARMKV_AVX2
#define WARMKV_FIXED(D, G) \
  if (d == D && group == G) { attend_tile_fixed<Lanes, K, D, G>(t, qt, len, nt, s.data(), part_of); continue; }
      WARMKV_FIXED(64, 1) WARMKV_FIXED(64, 2) WARMKV_FIXED(64, 3) WARMKV_FIXED(64, 4) WARMKV_FIXED(64, 5)
      WARMKV_FIXED(64, 6) WARMKV_FIXED(64, 7) WARMKV_FIXED(64, 8) WARMKV_FIXED(128, 1) WARMKV_FIXED(128, 2)
      WARMKV_FIXED(128, 3) WARMKV_FIXED(128, 4) WARMKV_FIXED(128, 5) WARMKV_FIXED(128, 6) WARMKV_FIXED(128, 7)
      WARMKV_FIXED(128, 8)
#undef WARMKV_FIXED
#endif
      for (int64_t u = 0; u < nt; u++) {
        if (len[u] <= 0) continue;
        Task<K> tu = t;
        tu.n = len[u];
        attend_task(tu, qt[u], group, d, s.data(), [&](int64_t h) { return part_of(u, h); });
      }
    }
  });
  parallel_tasks(nq, [&](const auto& take) {
    std::vector<float> acc(d);
    for (int64_t i; take(i);) {
      const int64_t nc = chunks[i];
      const float* pi = part.get() + part_at[i];
      for (int64_t h = 0; h < n_kv; h++) {
        for (int64_t g = 0; g < group; g++) {
          float m = -INFINITY;
          for (int64_t c = 0; c < nc; c++) m = std::max(m, pi[(h * nc + c) * stride + g * (d + 2)]);
          float total = 0.f;
          std::fill(acc.begin(), acc.end(), 0.f);
          for (int64_t c = 0; c < nc; c++) {
            const float* p = pi + (h * nc + c) * stride + g * (d + 2);
            const float w = std::exp(p[0] - m);
            total += w * p[1];
            for (int64_t j = 0; j < d; j++) acc[j] += w * p[2 + j];
          }
          float* o = out + i * row + (h * group + g) * d;
          for (int64_t j = 0; j < d; j++) o[j] = acc[j] / total;
        }
      }
    }
  });
}

}  // namespace warmkv
