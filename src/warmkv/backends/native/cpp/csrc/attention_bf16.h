// Attention deep in a context on AVX-512 BF16 (vdpbf16ps): a tile of query rows (up to 24: the
// queries of a prefill piece times the query heads of one kv head) over a chunk of keys, flash
// style. Keys come in blocks of 16 read straight from the pool in its storage type, rounded to
// bfloat16 and packed in registers: K transposed (a lane per key, so scores come out 16 keys to a
// register and no dot product ends in a horizontal sum), V with each two keys' values
// interleaved. Products are bfloat16, sums float32; the softmax runs online over the blocks.
// Over int8 keys (the q8_0 pool) the scores are integer instead: queries rounded to int8 with a
// scale per row, keys read as bytes, 4 dims a lane (vpdpbusd does ~3x the products of vdpbf16ps
// a second here). Its values are integer too: V's bytes 4 keys a lane, the weights rounded to a
// byte against the row's largest in the block, int32 sums (vpdpbusd), one float scale per row and
// block. A byte's 8 bits are bfloat16's; the perplexity 16K deep moved +0.23% against float32 K/V.
//
// Every row's arithmetic is its own: a row's scores, softmax and weighted values do not depend
// on the other rows of its tile, and blocks start at key 0 of the context (a chunk is a whole
// number of blocks), so a token gets the same bits prefilled in any piece as decoded alone.

#pragma once

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define WARMKV_BF16 1

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "simd.h"

namespace warmkv::bf16 {

constexpr int kRegs = 4;  // registers of scores per row in a block
constexpr int64_t kBlock = 16 * kRegs;  // keys per block
// Keys per task: fixed, so results do not depend on the thread count. 2048 rather than 512: a
// quarter of the partials to write and merge, and each task's K/V one longer run (a decode row
// 16K deep, 2 threads: 7.7-8.3 -> 6.6-7.2 ms; its 8 tasks still keep both threads busy).
constexpr int64_t kChunk = 2048;
constexpr int kMaxRows = 24;  // query rows per tile

// 2^t (t <= 0, or a rounding above) for the lanes in m, 0 in the others: 2^(t - n) for
// n = round(t) by a degree-4 polynomial (relative error 3e-6, below the 2^-9 of the bfloat16 or
// byte the weight is rounded to next), scaled by 2^n in one vscalefps (exact, down through the
// subnormals). The softmax calls it on s * log2(e) - max * log2(e), one fma. Cephes'
// full-precision e^x took 14 instructions to this one's 8; in a prefill tile the softmax issued
// as many as the dot products.
inline __m512 exp2_16(__mmask16 m, __m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-150.f));  // 2^-150 is below the smallest float: 0
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);  // exact, in [-0.5, 0.5]
  __m512 y = _mm512_fmadd_ps(_mm512_set1_ps(9.6003955171e-3f), f, _mm512_set1_ps(5.5916893825e-2f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4023718463e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9312199484e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(m, y, n);
}

inline __m512i pack2(__m512 lo, __m512 hi) { return (__m512i)_mm512_cvtne2ps_pbh(hi, lo); }

// Elements [32z, 32z + 32) of a pool row as 32 bfloat16 (round to nearest even).
inline __m512i load32(const float* p) { return pack2(_mm512_loadu_ps(p), _mm512_loadu_ps(p + 16)); }
inline __m512i load32(const c10::Half* p) {
  const __m256i* h = reinterpret_cast<const __m256i*>(p);
  return pack2(_mm512_cvtph_ps(_mm256_loadu_si256(h)), _mm512_cvtph_ps(_mm256_loadu_si256(h + 1)));
}
inline __m512i load32(const c10::BFloat16* p) { return _mm512_loadu_si512(p); }
inline __m512i load32(const int8_t* p) {  // exact: bfloat16 holds every int8
  const __m128i* b = reinterpret_cast<const __m128i*>(p);
  return pack2(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(b))),
               _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(b + 1))));
}

// r[i]'s dword j -> r[j]'s dword i. Inlined by force: GCC left it a call, and the rows then went
// through memory (the kernel 0.15 -> 0.14 ms with K/V in cache).
__attribute__((always_inline)) inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int a = 0; a < 8; a++) {
    t[2 * a] = _mm512_unpacklo_epi32(r[2 * a], r[2 * a + 1]);
    t[2 * a + 1] = _mm512_unpackhi_epi32(r[2 * a], r[2 * a + 1]);
  }
  __m512i u[16];  // u[4b + c]'s 128-bit lane L: column 4L + c of rows 4b..4b+3
  for (int b = 0; b < 4; b++) {
    u[4 * b] = _mm512_unpacklo_epi64(t[4 * b], t[4 * b + 2]);
    u[4 * b + 1] = _mm512_unpackhi_epi64(t[4 * b], t[4 * b + 2]);
    u[4 * b + 2] = _mm512_unpacklo_epi64(t[4 * b + 1], t[4 * b + 3]);
    u[4 * b + 3] = _mm512_unpackhi_epi64(t[4 * b + 1], t[4 * b + 3]);
  }
  for (int c = 0; c < 4; c++) {  // a 4x4 transpose of 128-bit lanes over u[c], u[4 + c], u[8 + c], u[12 + c]
    const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i v3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

// A block's keys and values for one kv head, packed for vdpbf16ps. k[j][c]: lane i holds dims
// (2j, 2j + 1) of key 16c + i. v[i][z]: key pairs (2i, 2i + 1) interleaved per dim in bfloat16;
// unpacklo/hi take dims in 128-bit lanes, so register z lane l holds dim 32(z / 2) + 8(l / 4) +
// 4(z % 2) + l % 4. From an int8 pool, v[i][z] holds the bytes of keys 4i..4i + 3 per dim instead
// (for vpdpbusd), register z lane l dim 64(z / 4) + 16(l / 4) + 4(z % 4) + l % 4, and only
// v[0 .. kBlock / 4) is used.
template <int D>
struct Packed {
  __m512i k[D / 2][kRegs];
  __m512i v[kBlock / 2][D / 16];
  // Accumulators in those lanes -> dims in order, 16 a register: 128-bit lanes moved whole (each
  // holds 4 consecutive dims either way). Element by element, the 64 moves a row stalled the
  // stores of a tile's partials (~11% of the tile's time in a prefill piece).
  template <bool I8>
  static void in_order(const __m512* o, __m512* out) {
    for (int z = 0; z < D / 16; z += I8 ? 4 : 2) {
      if constexpr (I8) {  // registers z..z + 3: a 4 x 4 transpose of their lanes
        const __m512 t0 = _mm512_shuffle_f32x4(o[z], o[z + 1], 0x44), t1 = _mm512_shuffle_f32x4(o[z], o[z + 1], 0xEE);
        const __m512 t2 = _mm512_shuffle_f32x4(o[z + 2], o[z + 3], 0x44);
        const __m512 t3 = _mm512_shuffle_f32x4(o[z + 2], o[z + 3], 0xEE);
        out[z] = _mm512_shuffle_f32x4(t0, t2, 0x88);
        out[z + 1] = _mm512_shuffle_f32x4(t0, t2, 0xDD);
        out[z + 2] = _mm512_shuffle_f32x4(t1, t3, 0x88);
        out[z + 3] = _mm512_shuffle_f32x4(t1, t3, 0xDD);
      } else {  // registers z, z + 1: their lanes interleaved
        const __m512 lo = _mm512_shuffle_f32x4(o[z], o[z + 1], 0x44), hi = _mm512_shuffle_f32x4(o[z], o[z + 1], 0xEE);
        out[z] = _mm512_shuffle_f32x4(lo, lo, 0xD8);
        out[z + 1] = _mm512_shuffle_f32x4(hi, hi, 0xD8);
      }
    }
  }
};

template <typename K, int D, typename Keys>
inline void pack(const Keys& keys, int64_t nb, Packed<D>* out) {
  constexpr int Z = D / 32;
  // Over int8 keys k[j][c] lane i holds dims 4j..4j+3 of key 16c + i instead, each byte + 128
  // (unsigned, as vpdpbusd reads its first operand; a row's correction is 128 times its query's sum).
  constexpr bool i8 = std::is_same_v<K, int8_t>;
  constexpr int ZK = i8 ? D / 64 : Z;  // registers per key row
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  auto key_reg = [&](const K* kr, int z) {  // a missing key: zeros (bytes 128: zero as well)
    if constexpr (i8) return kr ? _mm512_xor_si512(_mm512_loadu_si512(kr + 64 * z), flip) : flip;
    else return kr ? load32(kr + 32 * z) : _mm512_setzero_si512();
  };
  const K* kr[kBlock];
  const K* vr[kBlock];
  keys.rows(nb, kBlock, kr, vr);  // past nb: nullptr
  for (int c = 0; c < kRegs; c++) {  // every register, past nb zeros: the scores then take no count
    __m512i rows[ZK][16];
    for (int64_t i = 0; i < 16; i++)
      for (int z = 0; z < ZK; z++) rows[z][i] = key_reg(kr[16 * c + i], z);
    for (int z = 0; z < ZK; z++) {
      transpose16(rows[z]);
      for (int j = 0; j < 16; j++) out->k[16 * z + j][c] = rows[z][j];
    }
  }
  if constexpr (i8) {
    for (int64_t i = 0; i < nb; i += 4) {  // a missing key: zeros, as beyond a row's end
      const K* const* r = vr + i;
      auto row = [&](int e, int z) { return r[e] ? _mm512_loadu_si512(r[e] + 64 * z) : _mm512_setzero_si512(); };
      for (int z = 0; z < D / 64; z++) {
        const __m512i a = row(0, z), b = row(1, z), c = row(2, z), d = row(3, z);
        const __m512i ab0 = _mm512_unpacklo_epi8(a, b), ab1 = _mm512_unpackhi_epi8(a, b);
        const __m512i cd0 = _mm512_unpacklo_epi8(c, d), cd1 = _mm512_unpackhi_epi8(c, d);
        out->v[i / 4][4 * z] = _mm512_unpacklo_epi16(ab0, cd0);
        out->v[i / 4][4 * z + 1] = _mm512_unpackhi_epi16(ab0, cd0);
        out->v[i / 4][4 * z + 2] = _mm512_unpacklo_epi16(ab1, cd1);
        out->v[i / 4][4 * z + 3] = _mm512_unpackhi_epi16(ab1, cd1);
      }
    }
    return;
  }
  auto value_reg = [&](const K* p, int z) { return load32(p + 32 * z); };
  for (int64_t i = 0; i < nb; i += 2) {
    const K* a = vr[i];
    const K* b = vr[i + 1];  // a missing key: zeros, as beyond a row's end
    for (int z = 0; z < Z; z++) {
      const __m512i x = value_reg(a, z);
      const __m512i y = b ? value_reg(b, z) : _mm512_setzero_si512();
      out->v[i / 2][2 * z] = _mm512_unpacklo_epi16(x, y);
      out->v[i / 2][2 * z + 1] = _mm512_unpackhi_epi16(x, y);
    }
  }
}

// The K and V rows of the block two on, prefetched into L2 a few lines at a time between the
// arithmetic of the current one, so that their loads overlap it. Without them the pack of each
// block waited on memory with no arithmetic beside it: the hardware prefetcher did not run far
// enough ahead of this loop (one thread read 5.9 GB/s of an int8 pool 16K deep; 8.8 with them).
// A burst of a whole block's prefetches at its start stalled the block's own work instead (1.3x
// slower); the next block alone, or into L1, hid less of the wait (7.4-7.9 GB/s).
constexpr int64_t kAheadBlocks = 2;

template <typename K, int D>
struct Ahead {
  static constexpr int kLines = (D * static_cast<int>(sizeof(K)) + 63) / 64;  // cache lines per row
  const K* k[kBlock];
  const K* v[kBlock];
  int lines = 0, at = 0, per = 0;  // lines to prefetch, lines issued, lines per step
  // the first count keys of keys, over `steps` calls of issue()
  template <typename Keys>
  void start(const Keys& keys, int64_t count, int steps) {
    lines = static_cast<int>(2 * count) * kLines;
    at = 0;
    per = (lines + steps - 1) / steps;
    if (count > 0) keys.rows(count, kBlock, k, v);
  }
  void issue() {  // rows in turn: key i's K row, then its V row
    for (const int end = std::min(lines, at + per); at < end; at++) {
      const int row = at / kLines;
      const K* r = (row % 2 ? v : k)[row / 2];
      _mm_prefetch(reinterpret_cast<const char*>(r) + 64 * (at % kLines), _MM_HINT_T1);
    }
  }
};

// s[r][c] = q_r . k (keys 16c..16c+15) for NR rows: each row's dot products in one order,
// whatever NR. Not inlined, here and in the value loops: inlined into attend_tile, GCC 12 copied
// every accumulator between registers at each step, and tested the key count at each product.
template <int D, int NR, typename A>
__attribute__((noinline)) void scores(const Packed<D>& p, const uint32_t* const* q, __m512 (*s)[kRegs], A& ahead) {
  __m512 acc[NR][kRegs];
  for (int r = 0; r < NR; r++)
    for (int c = 0; c < kRegs; c++) acc[r][c] = _mm512_setzero_ps();
  for (int j = 0; j < D / 2; j++) {
    ahead.issue();
    for (int r = 0; r < NR; r++) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(q[r][j]);
      for (int c = 0; c < kRegs; c++)
        acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)p.k[j][c], w);
    }
  }
  for (int r = 0; r < NR; r++)
    for (int c = 0; c < kRegs; c++) s[r][c] = acc[r][c];
}

// scores over int8 keys: row r's query as int8 bytes, 4 dims a dword, with its scale qs[r] and
// the sum of its bytes qsum[r]; exact integer sums (|sum| < 2^24 for D <= 128), one rounding.
template <int D, int NR, typename A>
__attribute__((noinline)) void scores_i8(const Packed<D>& p, const uint32_t* const* q, const float* qs,
                                         const int32_t* qsum, __m512 (*s)[kRegs], A& ahead) {
  __m512i acc[NR][kRegs];
  for (int r = 0; r < NR; r++)
    for (int c = 0; c < kRegs; c++) acc[r][c] = _mm512_setzero_si512();
  for (int j = 0; j < D / 4; j++) {
    ahead.issue();
    for (int r = 0; r < NR; r++) {
      const __m512i w = _mm512_set1_epi32(static_cast<int>(q[r][j]));
      for (int c = 0; c < kRegs; c++)
        acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], p.k[j][c], w);
    }
  }
  for (int r = 0; r < NR; r++) {
    const __m512i corr = _mm512_set1_epi32(128 * qsum[r]);
    const __m512 sc = _mm512_set1_ps(qs[r]);
    for (int c = 0; c < kRegs; c++) s[r][c] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][c], corr)), sc);
  }
}

// Queries for int8 keys: each row of d dims scaled, then rounded to int8 against its largest
// magnitude (scale amax / 127), 4 bytes a dword; qs, qsum per row.
inline void quantize_queries(const float* q, int64_t rows, int64_t d, float scale, uint32_t* out, float* qs,
                             int32_t* qsum) {
  for (int64_t r = 0; r < rows; r++) {
    const float* x = q + r * d;
    float amax = 0.f;
    for (int64_t j = 0; j < d; j++) amax = std::max(amax, std::fabs(x[j] * scale));
    const float step = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    int8_t* o = reinterpret_cast<int8_t*>(out + r * d / 4);
    int32_t sum = 0;
    for (int64_t j = 0; j < d; j++) {
      const int v = static_cast<int>(std::nearbyint(std::clamp(x[j] * scale * inv, -127.f, 127.f)));
      o[j] = static_cast<int8_t>(v);
      sum += v;
    }
    qs[r] = step;
    qsum[r] = sum;
  }
}

// o[r] += sum over key pairs i < n of (p[r][2i], p[r][2i + 1]) . (v[2i], v[2i + 1]), NR rows at once.
template <int D, int NR, typename A>
__attribute__((noinline)) void values(const Packed<D>& p, const uint32_t (*pb)[kBlock / 2], int64_t n, float (*o)[D],
                                      A& ahead) {
  __m512 acc[NR][D / 16];
  for (int r = 0; r < NR; r++)
    for (int z = 0; z < D / 16; z++) acc[r][z] = _mm512_load_ps(o[r] + 16 * z);
  for (int64_t i = 0; i < n; i++) {
    ahead.issue();
    for (int r = 0; r < NR; r++) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(pb[r][i]);
      for (int z = 0; z < D / 16; z++) acc[r][z] = _mm512_dpbf16_ps(acc[r][z], (__m512bh)p.v[i][z], w);
    }
  }
  for (int r = 0; r < NR; r++)
    for (int z = 0; z < D / 16; z++) _mm512_store_ps(o[r] + 16 * z, acc[r][z]);
}

// values over an int8 pool: pb holds each 4 keys' weights as bytes (0..255), row r's weight
// unit ws[r]; the block's sums are exact in int32 (64 keys x 255 x 128 < 2^31), then
// o[r] += sum * ws[r], one rounding. vpdpbusd takes 4 keys a lane where vpdpwssd took 2: the
// block's value products in half the instructions, which bound the kernel (~84% of its time).
template <int D, int NR, typename A>
__attribute__((noinline)) void values_u8(const Packed<D>& p, const uint32_t (*pb)[kBlock / 2], const float* ws,
                                         int64_t n, float (*o)[D], A& ahead) {
  __m512i acc[NR][D / 16];
  for (int r = 0; r < NR; r++)
    for (int z = 0; z < D / 16; z++) acc[r][z] = _mm512_setzero_si512();
  for (int64_t i = 0; i < n; i++) {
    ahead.issue();
    for (int r = 0; r < NR; r++) {
      const __m512i w = _mm512_set1_epi32(static_cast<int>(pb[r][i]));
      for (int z = 0; z < D / 16; z++) acc[r][z] = _mm512_dpbusd_epi32(acc[r][z], w, p.v[i][z]);
    }
  }
  for (int r = 0; r < NR; r++) {
    const __m512 unit = _mm512_set1_ps(ws[r]);
    for (int z = 0; z < D / 16; z++) {
      const __m512 sum = _mm512_cvtepi32_ps(acc[r][z]);
      _mm512_store_ps(o[r] + 16 * z, _mm512_fmadd_ps(sum, unit, _mm512_load_ps(o[r] + 16 * z)));
    }
  }
}

// Queries as the kernel reads them: scaled, rounded once to bfloat16, dims (2j, 2j + 1) in dword j.
inline void round_queries(const float* q, int64_t n, float scale, uint32_t* out) {
  int64_t j = 0;
  const __m512 sv = _mm512_set1_ps(scale);
  for (; j + 32 <= n; j += 32) {
    const __m512i b = pack2(_mm512_mul_ps(_mm512_loadu_ps(q + j), sv), _mm512_mul_ps(_mm512_loadu_ps(q + j + 16), sv));
    _mm512_storeu_si512(out + j / 2, b);
  }
  for (; j < n; j += 2) {
    const c10::BFloat16 lo(q[j] * scale), hi(j + 1 < n ? q[j + 1] * scale : 0.f);
    out[j / 2] = static_cast<uint32_t>(lo.x) | (static_cast<uint32_t>(hi.x) << 16);
  }
}

// One tile over one kv head and chunk: rows r = u * group + g (query u of the tile, query head g
// of the kv head) see the chunk's first len[u] keys; (max, sum, acc[D]) of row r go to out(u, g).
// keys: rows(nb, count, kr, vr) and scales(nb, count, ks, vs) of the chunk's first nb keys.
// Over int8 keys, q holds each row's int8 query and qs, qsum its scale and byte sum
// (quantize_queries); else bfloat16 pairs (round_queries), and qs, qsum are unused. then: the
// keys the thread reads next (the next kv head's of the task) and how many, whose first blocks
// the last blocks prefetch; none when then_n is 0.
template <typename K, int D, typename Keys, typename Out>
void attend_tile(const Keys& keys, int64_t n, const uint32_t* const* q, const float* qs, const int32_t* qsum,
                 const int64_t* len, int64_t nq, int64_t group, Out out, const Keys& then, int64_t then_n) {
  constexpr bool i8 = std::is_same_v<K, int8_t>;
  constexpr int kScoreRows = 6, kValueRows = D == 64 ? (i8 ? 6 : 4) : 2;  // accumulators that fit the registers
  const int rows = static_cast<int>(nq * group);
  alignas(64) float o[kMaxRows][D];
  alignas(64) uint32_t pb[kMaxRows][kBlock / 2];
  alignas(64) float ks[kBlock], vs[kBlock];
  float m[kMaxRows], l[kMaxRows], ws[kMaxRows];  // ws: a row's weight unit in the block (int8 pool)
  __m512 s[kMaxRows][kRegs];
  for (int r = 0; r < rows; r++) {
    m[r] = -INFINITY;
    l[r] = 0.f;
    std::fill(o[r], o[r] + D, 0.f);
  }
  Packed<D> pk;
  Ahead<K, D> ahead;
  const bool scaled = keys.scaled();
  for (int64_t b0 = 0; b0 < n; b0 += kBlock) {
    const int64_t nb = std::min(kBlock, n - b0);
    const auto block = keys.at(b0);
    pack<K>(block, nb, &pk);
    // issue() calls of one score and one value pass over a whole block: a tile of more rows than
    // a pass takes issues its lines within the first passes, a short last block leaves some unissued
    constexpr int steps = i8 ? D / 4 + kBlock / 4 : D / 2 + kBlock / 2;
    // the block kAheadBlocks on: this chunk's, or past its last block the next head's
    const int64_t f = b0 + kAheadBlocks * kBlock, end = (n + kBlock - 1) / kBlock * kBlock;
    if (f < n) ahead.start(keys.at(f), std::min(kBlock, n - f), steps);
    else ahead.start(then.at(f - end), std::clamp<int64_t>(then_n - (f - end), 0, kBlock), steps);
    for (int r0 = 0; r0 < rows; r0 += kScoreRows) {
      switch (std::min(kScoreRows, rows - r0)) {
#define WARMKV_ROWS(N)                                                \
  case N:                                                             \
    if constexpr (i8)                                                 \
      scores_i8<D, N>(pk, q + r0, qs + r0, qsum + r0, s + r0, ahead); \
    else                                                              \
      scores<D, N>(pk, q + r0, s + r0, ahead);                        \
    break;
        WARMKV_ROWS(1) WARMKV_ROWS(2) WARMKV_ROWS(3) WARMKV_ROWS(4) WARMKV_ROWS(5) WARMKV_ROWS(6)
#undef WARMKV_ROWS
      }
    }
    if (scaled) block.scales(nb, kBlock, ks, vs);
    // The softmax in passes over the tile's rows. A row's steps each wait on the one before (its
    // max, e^x, the sums); a row at a time, the core sat in those waits (~40% of the kernel's time
    // in a prefill piece), where a pass overlaps the rows' chains.
    int64_t pairs = 0;  // key pairs (quads over an int8 pool) any row of the tile sees in this block
    int64_t valid[kMaxRows];  // the block's keys each row sees; none: its state stays as it is
    float top[kMaxRows];  // a row's largest weight in the block (its max score, in the first pass)
    __mmask16 mask[kMaxRows][kRegs];  // the keys of each register a row sees
    for (int r = 0; r < rows; r++) {  // scale the scores; each row's max
      valid[r] = std::min(nb, len[r / group] - b0);
      if (valid[r] <= 0) continue;
      pairs = std::max(pairs, i8 ? (valid[r] + 3) / 4 : (valid[r] + 1) / 2);
      __m512 mx = _mm512_set1_ps(-INFINITY);
      for (int c = 0; c < kRegs; c++) {
        mask[r][c] = static_cast<__mmask16>((1u << std::clamp<int64_t>(valid[r] - 16 * c, 0, 16)) - 1);
        if (scaled) s[r][c] = _mm512_mul_ps(s[r][c], _mm512_load_ps(ks + 16 * c));
        mx = _mm512_mask_max_ps(mx, mask[r][c], mx, s[r][c]);
      }
      top[r] = _mm512_reduce_max_ps(mx);
    }
    for (int r = 0; r < rows; r++) {  // a row's new max: what it has summed so far is rescaled
      if (valid[r] <= 0) continue;  // top[r] was not set
      const float mn = std::max(m[r], top[r]);
      if (mn == m[r]) continue;
      const float alpha = std::exp(m[r] - mn);
      l[r] *= alpha;
      const __m512 av = _mm512_set1_ps(alpha);
      for (int z = 0; z < D / 16; z++) _mm512_store_ps(o[r] + 16 * z, _mm512_mul_ps(_mm512_load_ps(o[r] + 16 * z), av));
      m[r] = mn;
    }
    for (int r = 0; r < rows; r++) {  // the weights: e^(s - max), times V's scale (in s)
      if (valid[r] <= 0) continue;
      const __m512 log2e = _mm512_set1_ps(1.44269504088896341f), shift = _mm512_set1_ps(-m[r] * 1.44269504088896341f);
      __m512 sum = _mm512_setzero_ps(), tv = _mm512_setzero_ps();
      for (int c = 0; c < kRegs; c++) {  // past the row's keys, weights 0: they add and weigh nothing
        const __m512 p = exp2_16(mask[r][c], _mm512_fmadd_ps(s[r][c], log2e, shift));
        sum = _mm512_add_ps(sum, p);
        s[r][c] = scaled ? _mm512_mul_ps(p, _mm512_load_ps(vs + 16 * c)) : p;
        tv = _mm512_max_ps(tv, s[r][c]);
      }
      l[r] += _mm512_reduce_add_ps(sum);
      top[r] = _mm512_reduce_max_ps(tv);  // >= 0: p and V's scales are
    }
    for (int r = 0; r < rows; r++) {  // rounded for the value products
      if (valid[r] <= 0) {
        std::fill(pb[r], pb[r] + kBlock / 2, 0u);
        ws[r] = 0.f;
        continue;
      }
      if constexpr (i8) {
        ws[r] = top[r] / 255.f;
        const __m512 inv = _mm512_set1_ps(top[r] > 0.f ? 255.f / top[r] : 0.f);
        for (int c = 0; c < kRegs; c++)
          _mm_store_si128(reinterpret_cast<__m128i*>(pb[r] + 4 * c),
                          _mm512_cvtusepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(s[r][c], inv))));
      } else {
        for (int c = 0; c < kRegs; c++)
          _mm256_store_si256(reinterpret_cast<__m256i*>(pb[r] + 8 * c), (__m256i)_mm512_cvtneps_pbh(s[r][c]));
      }
    }
    // Rows whose keys end sooner weigh the pairs beyond with zeros: adding them changes no bit.
    for (int r0 = 0; r0 < rows; r0 += kValueRows) {
      switch (std::min(kValueRows, rows - r0)) {
#define WARMKV_ROWS(N)                                                          \
  case N:                                                                       \
    if constexpr (N <= kValueRows) { /* wider passes: never taken, not built */ \
      if constexpr (i8)                                                         \
        values_u8<D, N>(pk, pb + r0, ws + r0, pairs, o + r0, ahead);            \
      else                                                                      \
        values<D, N>(pk, pb + r0, pairs, o + r0, ahead);                        \
    }                                                                           \
    break;
        WARMKV_ROWS(1) WARMKV_ROWS(2) WARMKV_ROWS(3) WARMKV_ROWS(4) WARMKV_ROWS(5) WARMKV_ROWS(6)
#undef WARMKV_ROWS
      }
    }
  }
  for (int r = 0; r < rows; r++) {
    if (len[r / group] <= 0) continue;
    float* dst = out(r / group, r % group);
    dst[0] = m[r];
    dst[1] = l[r];
    __m512 acc[D / 16], dims[D / 16];
    for (int z = 0; z < D / 16; z++) acc[z] = _mm512_load_ps(o[r] + 16 * z);
    Packed<D>::template in_order<i8>(acc, dims);
    for (int z = 0; z < D / 16; z++) _mm512_storeu_ps(dst + 2 + 16 * z, dims[z]);
  }
}

}  // namespace warmkv::bf16

#endif
