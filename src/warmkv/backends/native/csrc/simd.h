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

}  // namespace warmkv
