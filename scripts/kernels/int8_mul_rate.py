"""This CPU's int8 multiply rate: the ceiling of the native 4-bit kernel at many decode rows.

At one row a decode step reads every weight once and waits on memory; each extra row reads
nothing new but adds its integer products. How much an extra row costs is therefore set by how
many int8 products the cores can multiply per second. This times the instruction the kernel
uses, alone in a register loop (8 independent chains, no memory), on 1 thread and on T threads:
AVX2 `vpmaddubsw` (32 products; the Q4 kernel adds 8 of them in int16 and widens once with
`vpmaddwd`, the Q8 head needs a `vpmaddwd` after each), or AVX-512 VNNI `vpdpbusd` (64).

Compare its ceilings with `scripts/kernels/qmatmul_rows.py`'s marginal GMAC/s.

    .venv/bin/python scripts/kernels/int8_mul_rate.py
    .venv/bin/python scripts/kernels/int8_mul_rate.py --threads 1 --iters 20000000
"""

from __future__ import annotations

import argparse
import os

from torch.utils import cpp_extension

SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <chrono>
#include <string>
#include <tuple>

// Multiply instructions per second per thread, from `iters` rounds of 8 independent chains,
// each thread on its own; returns (instruction, products per instruction, rate of each thread).
// widen: AVX2's vpmaddwd instead (the Q4 kernel's widening step, the Q8 head's second multiply).
std::tuple<std::string, int64_t, std::vector<double>> rate(int64_t iters, int64_t threads, bool widen) {
  std::vector<double> out(threads);
#pragma omp parallel num_threads(threads)
  {
    const int id = omp_get_thread_num();
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(1), a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm512_set1_epi32(i);
#define WARMKV_MUL(v) v = _mm512_dpbusd_epi32(v, w, x)
#else
    __m256i w = _mm256_set1_epi8(3), a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_set1_epi16(i);
#define WARMKV_MUL(v) v = widen ? _mm256_madd_epi16(w, v) : _mm256_maddubs_epi16(w, v)
#endif
    __typeof__(a[0]) a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3], a4 = a[4], a5 = a[5], a6 = a[6], a7 = a[7];
#pragma omp barrier
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t it = 0; it < iters; it++) {
      WARMKV_MUL(a0); WARMKV_MUL(a1); WARMKV_MUL(a2); WARMKV_MUL(a3);
      WARMKV_MUL(a4); WARMKV_MUL(a5); WARMKV_MUL(a6); WARMKV_MUL(a7);
      // Keeps the chains in registers and the loop from being folded away.
      asm volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), "+x"(a6), "+x"(a7), "+x"(w));
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    out[id] = 8.0 * iters / s;
  }
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return {"vpdpbusd zmm", 64, out};
#else
  if (widen) return {"vpmaddwd ymm", 16, out};
  return {"vpmaddubsw ymm", 32, out};
#endif
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--iters", type=int, default=100_000_000, help="rounds of 8 multiplies per thread")
    args = ap.parse_args()
    ext = cpp_extension.load_inline(
        "warmkv_int8_mul_rate",
        cpp_sources=SOURCE,
        functions=["rate"],
        extra_cflags=["-O3", "-march=native", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
    )
    totals = {}
    for widen in (False, True):
        name, products, one = ext.rate(args.iters, 1, widen)
        totals[name] = total = sum(ext.rate(args.iters, args.threads, widen)[2])
        print(f"{name}: {one[0] / 1e9:.2f} G/s on 1 thread, {total / 1e9:.2f} G/s on {args.threads} threads")
        if products == 64:  # VNNI: one instruction per 64 products in both kernels, nothing to widen
            print(f"Q4 and Q8 kernel ceiling: {total * products / 1e9:.1f} GMAC/s")
            return
    # The Q4 kernel: 8 maddubs per 256 products of a block, then one madd; the Q8 head: a madd
    # after every maddubs. Each ceiling takes the instructions at their own rates, back to back.
    mul, wide = 1 / totals["vpmaddubsw ymm"], 1 / totals["vpmaddwd ymm"]
    q4, q8 = 256 / (8 * mul + wide), 32 / (mul + wide)
    print(f"Q4 kernel ceiling: {q4 / 1e9:.1f} GMAC/s; Q8 head: {q8 / 1e9:.1f} GMAC/s")


if __name__ == "__main__":
    main()
