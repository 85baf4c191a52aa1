// y = x W^T with W in 4- or 8-bit blocks of 32 (Q4_0, Q4_1, Q8_0), for CPU decode.
//
// Decode reads every weight once per step, so it runs at memory speed only if the weights
// stay packed and each byte is touched once. Each activation row is quantized to int8 once
// per matmul (a scale and a code sum per block of 32); a block's dot product is then an
// exact integer sum of u8 weight codes x s8 activations (AVX-512 VNNI dpbusd, AVX2
// maddubs/madd, or plain C++), scaled once in float.
//
// Layout: tiles of 16 output rows; per tile, per block of 32 inputs:
//   Q4: 256 bytes, byte p*64 + r*4 + e holds row r's element 4p+e (low nibble) and 16+4p+e (high)
//   Q8: 512 bytes, byte j*64 + r*4 + e holds row r's element 4j+e, as u8 = code + 128
//   then 16 fp16 scales d, then (Q4_1 only) 16 fp16 minima m.
// One 64-byte load then feeds one dpbusd whose 16 int32 lanes are the tile's 16 rows: no
// horizontal sums. w = d * (u - 8) (Q4_0), d * u + m (Q4_1), d * (u - 128) (Q8_0).
//
// Batch invariance: a row's float operations are the same whatever else is in the batch
// (rows are grouped only to share weight loads), and the integer sums are exact, so every
// instruction set gives the same bits.

#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define WARMKV_QMM_VNNI 1
#elif defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define WARMKV_QMM_AVX2 1
#endif
#if defined(__AVX2__)
#include <immintrin.h>  // quantize_row's AVX2 path (also on AVX-512 machines)
#endif

namespace warmkv::qmm {

enum Kind : int64_t { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2 };
constexpr int64_t kTile = 16, kBlock = 32;  // rows per tile, inputs per block
#if defined(WARMKV_QMM_VNNI)
constexpr int64_t kGroup = 8;  // batch rows per pass over a tile: 8 x 3 accumulators fit AVX-512's 32 registers
#else
constexpr int64_t kGroup = 4;
#endif
#ifndef WARMKV_QMM_PREFETCH
#define WARMKV_QMM_PREFETCH 4
#endif
constexpr int64_t kPrefetch = WARMKV_QMM_PREFETCH;  // blocks ahead (a hint: past the end is harmless)

inline int64_t code_bytes(int64_t kind) { return kind == kQ8_0 ? 512 : 256; }
inline int64_t block_bytes(int64_t kind) { return code_bytes(kind) + (kind == kQ4_1 ? 64 : 32); }
inline int32_t offset(int64_t kind) { return kind == kQ4_0 ? 8 : kind == kQ8_0 ? 128 : 0; }

inline const char* isa() {
#if defined(WARMKV_QMM_VNNI)
  return "avx512-vnni";
#elif defined(WARMKV_QMM_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

// A group of n (<= kGroup) activation rows in int8, interleaved per block so that one address
// plus a constant reaches every row: q[b][r][32] codes, and per (b, r) the absmax scale d, the
// code sum times the weights' offset c (Q4_0, Q8_0), and dx times the code sum ms (Q4_1).
struct QGroup {
  const int8_t* q;
  const float* d;
  const int32_t* c;
  const float* ms;
};

// Row r of a group of n: round-to-nearest-even int8 codes with an absmax scale per block of 32.
// The AVX2 path computes the same values: the max is exact in any order, x * inv is one IEEE
// multiply either way, cvtps rounds to nearest even (the default mode, as nearbyint), and the
// code sum is an exact integer sum.
inline void quantize_row(const float* x, int64_t k, int64_t kind, int64_t n, int64_t r, int8_t* q, float* d,
                         int32_t* c, float* ms) {
  for (int64_t b = 0; b < k / kBlock; b++) {
    const float* xb = x + b * kBlock;
    int8_t* qb = q + (b * n + r) * kBlock;
    int32_t sum = 0;
    float scale;
#if defined(__AVX2__)
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 v[4];
    for (int j = 0; j < 4; j++) v[j] = _mm256_loadu_ps(xb + 8 * j);
    __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                              _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float m = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    scale = m / 127.f;
    const __m256 inv = _mm256_set1_ps(m > 0.f ? 127.f / m : 0.f);
    __m256i i32[4];
    for (int j = 0; j < 4; j++) i32[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));
    const __m256i i16 = _mm256_packs_epi32(i32[0], i32[1]), j16 = _mm256_packs_epi32(i32[2], i32[3]);
    // packs works per 128-bit lane: put the 8 groups of 4 codes back in order.
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i i8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(i16, j16), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), i8);
    const __m256i s32 = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    sum = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
#else
    float m = 0.f;
    for (int i = 0; i < kBlock; i++) m = std::max(m, std::abs(xb[i]));
    scale = m / 127.f;
    const float inv = m > 0.f ? 127.f / m : 0.f;
    for (int i = 0; i < kBlock; i++) {
      const int8_t v = static_cast<int8_t>(std::nearbyint(xb[i] * inv));
      qb[i] = v;
      sum += v;
    }
#endif
    d[b * n + r] = scale;
    c[b * n + r] = offset(kind) * sum;
    ms[b * n + r] = scale * static_cast<float>(sum);
  }
}

// The float step of one block for one row, shared by every instruction set: acc += (dot - c) * (d * dx),
// and for Q4_1 acc += m * ms.
inline float scalar_step(float acc, int32_t dot, int64_t kind, float d, float m, float dx, int32_t c, float ms) {
  acc = std::fma(static_cast<float>(dot - c), d * dx, acc);
  return kind == kQ4_1 ? std::fma(m, ms, acc) : acc;
}

// u8 code of row r, element i of a block.
inline int32_t code_at(const uint8_t* blk, int64_t kind, int r, int i) {
  if (kind == kQ8_0) return blk[(i / 4) * 64 + r * 4 + i % 4];
  const int hi = i >= 16, j = i % 16;
  const uint8_t byte = blk[(j / 4) * 64 + r * 4 + j % 4];
  return hi ? byte >> 4 : byte & 0x0F;
}

// Plain C++: a group of n rows against one tile; out[r * kTile + row] for row in the tile.
inline void tile_scalar(const uint8_t* tile, int64_t kind, int64_t nb, const QGroup& x, int n, float* out) {
  const int64_t bb = block_bytes(kind), cb = code_bytes(kind);
  for (int r = 0; r < n; r++) {
    for (int o = 0; o < kTile; o++) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; b++) {
        const uint8_t* blk = tile + b * bb;
        const int64_t br = b * n + r;
        int32_t dot = 0;
        for (int i = 0; i < kBlock; i++) dot += code_at(blk, kind, o, i) * x.q[br * kBlock + i];
        c10::Half dh, mh;
        std::memcpy(&dh, blk + cb + 2 * o, 2);
        std::memcpy(&mh, blk + cb + 32 + 2 * o, kind == kQ4_1 ? 2 : 0);
        const float m = kind == kQ4_1 ? static_cast<float>(mh) : 0.f;
        acc = scalar_step(acc, dot, kind, static_cast<float>(dh), m, x.d[br], x.c[br], x.ms[br]);
      }
      out[r * kTile + o] = acc;
    }
  }
}

#if defined(WARMKV_QMM_VNNI)
inline __m512i bcast4(const int8_t* p) {  // 4 codes into every int32 lane (folds into a broadcast load)
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

template <int N, int64_t KIND>
inline void tile_simd(const uint8_t* tile, int64_t nb, const QGroup& x, float* out) {
  constexpr int64_t bb = KIND == kQ8_0 ? 544 : KIND == kQ4_1 ? 320 : 288, cb = KIND == kQ8_0 ? 512 : 256;
  // Integer chains per row: the sums are exact, so a split changes no bits, only the latency a
  // lone row waits on; with 4+ rows their chains already overlap, and registers are better spent.
  constexpr int C = N < 4 ? 2 : 1;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[N];
  for (int r = 0; r < N; r++) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* blk = tile + b * bb;
    const int8_t* q = x.q + b * N * kBlock;  // row r's codes of this block: q + 32 r
    _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetch * bb), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetch * bb + 128), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetch * bb + 256), _MM_HINT_T0);
    __m512i dot[N][C];
    for (int r = 0; r < N; r++)
      for (int i = 0; i < C; i++) dot[r][i] = _mm512_setzero_si512();
    if constexpr (KIND == kQ8_0) {
      for (int j = 0; j < 8; j++) {
        const __m512i w = _mm512_loadu_si512(blk + 64 * j);
        for (int r = 0; r < N; r++)
          dot[r][j % C] = _mm512_dpbusd_epi32(dot[r][j % C], w, bcast4(q + r * kBlock + 4 * j));
      }
    } else {
      for (int p = 0; p < 4; p++) {
        const __m512i raw = _mm512_loadu_si512(blk + 64 * p);
        const __m512i lo = _mm512_and_si512(raw, low), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
        for (int r = 0; r < N; r++) {
          dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], lo, bcast4(q + r * kBlock + 4 * p));
          dot[r][C - 1] = _mm512_dpbusd_epi32(dot[r][C - 1], hi, bcast4(q + r * kBlock + 16 + 4 * p));
        }
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + cb)));
    for (int r = 0; r < N; r++) {
      __m512i v = C == 2 ? _mm512_add_epi32(dot[r][0], dot[r][C - 1]) : dot[r][0];
      if constexpr (KIND != kQ4_1) v = _mm512_sub_epi32(v, _mm512_set1_epi32(x.c[b * N + r]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_mul_ps(d, _mm512_set1_ps(x.d[b * N + r])), acc[r]);
      if constexpr (KIND == kQ4_1) {
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + cb + 32)));
        acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.ms[b * N + r]), acc[r]);
      }
    }
  }
  for (int r = 0; r < N; r++) _mm512_storeu_ps(out + r * kTile, acc[r]);
}
#elif defined(WARMKV_QMM_AVX2)
// Q8: the sum of 4 adjacent code x activation products into each int32 lane, exact. w ^ 0x80 is
// the signed code, and maddubs wants one side unsigned: |code| x sign(code) * x.
inline __m256i dot4_q8(__m256i w, __m256i x) {
  const __m256i ws = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(ws), _mm256_sign_epi8(x, ws)), _mm256_set1_epi16(1));
}

// Halves h0 .. h0 + H - 1 of a tile (output rows 8h .. 8h + 7 of each) over all its blocks. Both
// halves in one pass read each 64-byte line of a block once and share the activation
// broadcasts, but AVX2 has 16 registers: 2N accumulators and 2N dot sums fit for N <= 2 and
// spill beyond, so larger groups take one half at a time. Each output's operations, and their
// order over the blocks, are those of any other split.
template <int N, int64_t KIND, int H>
inline void halves_simd(const uint8_t* tile, int64_t nb, const QGroup& x, int h0, float* out) {
  constexpr int64_t bb = KIND == kQ8_0 ? 544 : KIND == kQ4_1 ? 320 : 288, cb = KIND == kQ8_0 ? 512 : 256;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[H][N];
  for (int h = 0; h < H; h++)
    for (int r = 0; r < N; r++) acc[h][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* blk = tile + b * bb;
    const int8_t* q = x.q + b * N * kBlock;  // row r's codes of this block: q + 32 r
    // At one or two rows a block's arithmetic is short next to its fetch, and the hardware
    // prefetcher alone left the kernel at ~13-15 GB/s of the ~17 two cores stream on a Zen 1 VM;
    // with the hint, ~17-19. Past a tile's last block the lines are the next tile's.
    for (int64_t l = 0; l < bb; l += 64)
      _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetch * bb + l), _MM_HINT_T0);
    __m256i dot[H][N];
    if constexpr (KIND == kQ8_0) {
      for (int h = 0; h < H; h++)
        for (int r = 0; r < N; r++) dot[h][r] = _mm256_setzero_si256();
      for (int j = 0; j < 8; j++) {
        for (int h = 0; h < H; h++) {
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * j + 32 * (h0 + h)));
          for (int r = 0; r < N; r++) {
            int32_t x4;
            std::memcpy(&x4, q + r * kBlock + 4 * j, 4);
            dot[h][r] = _mm256_add_epi32(dot[h][r], dot4_q8(w, _mm256_set1_epi32(x4)));
            asm volatile("" : "+x"(dot[h][r]));  // see the Q4 loop
          }
        }
      }
    } else {
      // The eight maddubs sums of a block add up in int16 before one madd widens them: a lane
      // pair is at most 2 * 15 * 127 = 3810, eight of them 30480 < 32767, so the sum stays exact.
      __m256i s16[H][N];
      for (int h = 0; h < H; h++)
        for (int r = 0; r < N; r++) s16[h][r] = _mm256_setzero_si256();
      for (int p = 0; p < 4; p++) {
        for (int h = 0; h < H; h++) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * p + 32 * (h0 + h)));
          const __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
          for (int r = 0; r < N; r++) {
            int32_t xl, xh;
            std::memcpy(&xl, q + r * kBlock + 4 * p, 4);
            std::memcpy(&xh, q + r * kBlock + 16 + 4 * p, 4);
            const __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(xl)),
                                               _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xh)));
            s16[h][r] = _mm256_add_epi16(s16[h][r], t);
            // An empty asm that "changes" the sum: without it GCC computes a block's products for
            // every row first and spills them to the stack to add them up (10-15% slower at 4+ rows).
            asm volatile("" : "+x"(s16[h][r]));
          }
        }
      }
      for (int h = 0; h < H; h++)
        for (int r = 0; r < N; r++) dot[h][r] = _mm256_madd_epi16(s16[h][r], ones);
    }
    for (int h = 0; h < H; h++) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + cb + 16 * (h0 + h))));
      for (int r = 0; r < N; r++) {
        __m256i v = dot[h][r];
        if constexpr (KIND == kQ4_0) v = _mm256_sub_epi32(v, _mm256_set1_epi32(x.c[b * N + r]));
        acc[h][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_mul_ps(d, _mm256_set1_ps(x.d[b * N + r])), acc[h][r]);
        if constexpr (KIND == kQ4_1) {
          const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + cb + 32 + 16 * (h0 + h))));
          acc[h][r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.ms[b * N + r]), acc[h][r]);
        }
      }
    }
  }
  for (int h = 0; h < H; h++)
    for (int r = 0; r < N; r++) _mm256_storeu_ps(out + r * kTile + 8 * (h0 + h), acc[h][r]);
}

template <int N, int64_t KIND>
inline void tile_simd(const uint8_t* tile, int64_t nb, const QGroup& x, float* out) {
  if constexpr (N <= 2) {
    halves_simd<N, KIND, 2>(tile, nb, x, 0, out);
  } else {
    halves_simd<N, KIND, 1>(tile, nb, x, 0, out);
    halves_simd<N, KIND, 1>(tile, nb, x, 1, out);
  }
}
#endif

// A group of n (<= kGroup) rows against one tile.
inline void tile_rows(const uint8_t* tile, int64_t kind, int64_t nb, const QGroup& x, int n, float* out) {
#if defined(WARMKV_QMM_VNNI) || defined(WARMKV_QMM_AVX2)
#if defined(WARMKV_QMM_VNNI)
#define WARMKV_QMM_WIDE(K)                                \
  case 5: return tile_simd<5, K>(tile, nb, x, out);    \
  case 6: return tile_simd<6, K>(tile, nb, x, out);    \
  case 7: return tile_simd<7, K>(tile, nb, x, out);    \
  case 8: return tile_simd<8, K>(tile, nb, x, out);
#else
#define WARMKV_QMM_WIDE(K)
#endif
#define WARMKV_QMM_CASE(K)                                \
  switch (n) {                                            \
    case 1: return tile_simd<1, K>(tile, nb, x, out);  \
    case 2: return tile_simd<2, K>(tile, nb, x, out);  \
    case 3: return tile_simd<3, K>(tile, nb, x, out);  \
    WARMKV_QMM_WIDE(K)                                    \
    default: return tile_simd<4, K>(tile, nb, x, out); \
  }
  if (kind == kQ4_0) WARMKV_QMM_CASE(kQ4_0)
  if (kind == kQ4_1) WARMKV_QMM_CASE(kQ4_1)
  WARMKV_QMM_CASE(kQ8_0)
#undef WARMKV_QMM_CASE
#undef WARMKV_QMM_WIDE
#else
  tile_scalar(tile, kind, nb, x, n, out);
#endif
}

// Tiles per parallel task: small enough to split a decode matmul over every thread, large
// enough that a task's fixed cost stays small next to reading its weights.
inline int64_t tile_grain = 8;

// y[t, n] (float32) = x[t, k] W^T. packed: [tiles, k/32, block_bytes] bytes.
inline void matmul(const float* x, int64_t t, int64_t k, const uint8_t* packed, int64_t kind, int64_t n, float* y) {
  const int64_t nb = k / kBlock, tiles = (n + kTile - 1) / kTile, bb = block_bytes(kind);
  // Rows in groups of kGroup (the last one shorter), each group interleaved per block (QGroup).
  std::vector<int8_t> q(t * k);
  std::vector<float> d(t * nb), ms(t * nb);
  std::vector<int32_t> c(t * nb);
  at::parallel_for(0, t, 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; i++) {
      const int64_t r0 = i - i % kGroup, g = std::min(kGroup, t - r0);
      quantize_row(x + i * k, k, kind, g, i - r0, q.data() + r0 * k, d.data() + r0 * nb, c.data() + r0 * nb,
                   ms.data() + r0 * nb);
    }
  });
  auto group = [&](int64_t r0) {
    return QGroup{q.data() + r0 * k, d.data() + r0 * nb, c.data() + r0 * nb, ms.data() + r0 * nb};
  };
  at::parallel_for(0, tiles, tile_grain, [&](int64_t begin, int64_t end) {
    float out[kGroup * kTile];
    for (int64_t ti = begin; ti < end; ti++) {
      const uint8_t* tile = packed + ti * nb * bb;
      const int64_t width = std::min(kTile, n - ti * kTile);
      for (int64_t r0 = 0; r0 < t; r0 += kGroup) {
        const int g = static_cast<int>(std::min(kGroup, t - r0));
        tile_rows(tile, kind, nb, group(r0), g, out);
        for (int r = 0; r < g; r++) std::copy(out + r * kTile, out + r * kTile + width, y + (r0 + r) * n + ti * kTile);
      }
    }
  });
}

}  // namespace warmkv::qmm
