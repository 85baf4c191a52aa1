// SIMD helpers shared by the CPU kernels: storage types to float32 and back, 8-wide loads of
// every K/V storage type, a horizontal sum and e^x. AVX2/F16C where the compiler targets them
// (the extension is built on the machine that runs it); the kernels keep plain C++ paths.

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define WARMKV_AVX2 1
#if defined(__AVX512F__)
#define WARMKV_AVX512 1
#endif
#endif

namespace warmkv {

inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_f(c10::Half x) { return static_cast<float>(x); }
inline float to_f(int8_t x) { return static_cast<float>(x); }

template <typename T>
inline T from_f(float x) {
  return static_cast<T>(x);  // c10's Half and BFloat16 round to nearest even
}

#ifdef WARMKV_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const c10::BFloat16* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// e^x to ~2 ulp (Cephes' expf: x = n ln2 + g, |g| <= ln2/2, a degree-6 polynomial in g).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 g = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  g = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), g);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, g, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, g, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, g, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, g, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, g, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(g, g), _mm256_add_ps(g, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

// One float register of W lanes, for kernels written once for both widths. Lane for lane the two
// do the same operations: Lanes16's score() keeps Lanes8's two accumulators in its two halves, so
// AVX2 and AVX-512 machines compute the same bits.
#ifdef WARMKV_AVX2
struct Lanes8 {
  using R = __m256;
  static constexpr int W = 8, kRegs = 16;
  template <typename K>
  static R load(const K* p) { return load8(p); }
  static R loadf(const float* p) { return _mm256_loadu_ps(p); }
  static R zero() { return _mm256_setzero_ps(); }
  static R set1(float x) { return _mm256_set1_ps(x); }
  static R fma(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, R v) { _mm256_storeu_ps(p, v); }
  // dot(q, k) over the D floats of k[D / 8]: two accumulators (even and odd registers), then hsum.
  template <int D>
  static float score(const float* q, const R* k) {
    R a0 = _mm256_mul_ps(loadf(q), k[0]), a1 = _mm256_mul_ps(loadf(q + 8), k[1]);
    for (int v = 2; v < D / 8; v += 2) {
      a0 = fma(loadf(q + 8 * v), k[v], a0);
      a1 = fma(loadf(q + 8 * v + 8), k[v + 1], a1);
    }
    return hsum(_mm256_add_ps(a0, a1));
  }
};

#ifdef WARMKV_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const c10::BFloat16* p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

struct Lanes16 {
  using R = __m512;
  static constexpr int W = 16, kRegs = 32;
  template <typename K>
  static R load(const K* p) { return load16(p); }
  static R loadf(const float* p) { return _mm512_loadu_ps(p); }
  static R zero() { return _mm512_setzero_ps(); }
  static R set1(float x) { return _mm512_set1_ps(x); }
  static R fma(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, R v) { _mm512_storeu_ps(p, v); }
  // Lanes8::score's arithmetic: the low 8 lanes are its even accumulator, the high 8 its odd one.
  template <int D>
  static float score(const float* q, const R* k) {
    R a = _mm512_mul_ps(loadf(q), k[0]);
    for (int v = 1; v < D / 16; v++) a = fma(loadf(q + 16 * v), k[v], a);
    return hsum(_mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1))));
  }
};
using Lanes = Lanes16;
#else
using Lanes = Lanes8;
#endif
#endif

}  // namespace warmkv
