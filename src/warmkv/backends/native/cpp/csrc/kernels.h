// CPU kernels of a decode step around attention and the matmuls, on raw rows: RMSNorm, SiLU-gate,
// RoPE with the K/V pool write (attention is attention.h).
//
// A decode step of a small model is ~50 tiny ATen ops per layer (norms, RoPE, cache
// writes, a gather and a dtype conversion of the whole context, two batched matmuls and
// a softmax); their fixed costs outweigh the work. Here each is one pass over its data,
// vectorized with AVX2/F16C where the compiler targets them (the extension is built on
// the machine that runs it) and plain C++ elsewhere. Every loop has a fixed order that
// depends on neither the batch nor the thread count, so a token's numbers are the same
// alone, in a batch, or as a verified draft.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace warmkv {

// out[i] = x[i] * rsqrt(mean(x^2) + eps) * w[i] (w may be null), rounded once to T.
template <typename T>
void rms_norm(const float* x, const float* w, int64_t n, float eps, T* out) {
  float ss = 0.f;
  int64_t i = 0;
#ifdef WARMKV_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  ss = hsum(acc);
#endif
  for (; i < n; i++) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (i = 0; i < n; i++) out[i] = from_f<T>(w ? x[i] * r * w[i] : x[i] * r);
}

// out[i] = silu(gate[i]) * up[i], with gate = gu[0, n) and up = gu[n, 2n).
template <typename T>
void silu_mul(const T* gu, int64_t n, T* out) {
  int64_t i = 0;
#ifdef WARMKV_AVX2
  alignas(32) float tmp[8];
  const __m256 one = _mm256_set1_ps(1.f);
  for (; i + 8 <= n; i += 8) {
    __m256 g = load8(gu + i), u = load8(gu + n + i);
    __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    _mm256_store_ps(tmp, _mm256_mul_ps(s, u));
    for (int j = 0; j < 8; j++) out[i + j] = from_f<T>(tmp[j]);
  }
#endif
  for (; i < n; i++) {
    const float g = to_f(gu[i]);
    out[i] = from_f<T>(g / (1.f + std::exp(-g)) * to_f(gu[n + i]));
  }
}

// Store one head's d floats into a K/V pool row; int8 keeps an absmax scale per token and head.
template <typename K>
void store_head(const float* x, int64_t d, K* dst, float* scale) {
  for (int64_t j = 0; j < d; j++) dst[j] = from_f<K>(x[j]);
}
template <>
inline void store_head<int8_t>(const float* x, int64_t d, int8_t* dst, float* scale) {
  float m = 0.f;
  for (int64_t j = 0; j < d; j++) m = std::max(m, std::abs(x[j]));
  const float s = std::max(m, 1e-8f) / 127.f;
  for (int64_t j = 0; j < d; j++) dst[j] = static_cast<int8_t>(std::nearbyint(x[j] / s));
  *scale = s;
}

// One token's fused q/k/v row -> (optional per-head q/k RMSNorm) -> RoPE (rotate-half layout;
// sin carries the sign of the first half) -> q as float32, k and v stored into the pool rows of
// the token's slot: kv head h's at k_dst + h * head_rows * d (its scale at k_scale + h * head_rows).
template <typename T, typename K>
void rope_store(const T* qkv, int64_t n_heads, int64_t n_kv, int64_t d, const float* cos, const float* sin,
                const float* qk_norm, float eps, float* q, K* k_dst, K* v_dst, float* k_scale, float* v_scale,
                int64_t head_rows) {
  std::vector<float> x(d), y(d);
  const int64_t half = d / 2;
  for (int64_t h = 0; h < n_heads + n_kv; h++) {
    const T* src = qkv + h * d;
    for (int64_t j = 0; j < d; j++) x[j] = to_f(src[j]);
    if (qk_norm) rms_norm(x.data(), qk_norm + h * d, d, eps, x.data());
    for (int64_t j = 0; j < d; j++) y[j] = x[j] * cos[j] + x[(j + half) % d] * sin[j];
    if (h < n_heads) {
      std::copy(y.begin(), y.end(), q + h * d);
    } else {
      const int64_t kh = h - n_heads;
      store_head(y.data(), d, k_dst + kh * head_rows * d, k_scale ? k_scale + kh * head_rows : nullptr);
    }
  }
  const T* v = qkv + (n_heads + n_kv) * d;
  for (int64_t h = 0; h < n_kv; h++) {
    for (int64_t j = 0; j < d; j++) x[j] = to_f(v[h * d + j]);
    store_head(x.data(), d, v_dst + h * head_rows * d, v_scale ? v_scale + h * head_rows : nullptr);
  }
}

}  // namespace warmkv
