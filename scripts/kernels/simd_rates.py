"""The dot-product instructions' rates on this CPU, one core: the roofs of the attention kernels.

Each rate is 16 independent accumulator chains of one instruction in a loop (no loads), so it is
the instruction's throughput, not a kernel's; the best of 7 runs. Printed per instruction: billions per second and
the GFLOP/s (integer GOP/s for vpdpbusd) they give, one core. The attention kernels' products
run on these: f32 FMA (the "f32" kernel), vdpbf16ps ("bf16" over f16/bf16/f32 K/V) and
vpdpbusd (its scores over int8 K/V).

    .venv/bin/python scripts/kernels/simd_rates.py
"""

from __future__ import annotations

import time

from torch.utils import cpp_extension

SOURCE = r"""
#include <immintrin.h>
#include <torch/extension.h>

#include <chrono>

template <typename Init, typename Step>
static double rate(Init init, Step step, int64_t n) {
  decltype(init(0)) acc[16];
  for (int i = 0; i < 16; i++) acc[i] = init(i);
  for (int64_t k = 0; k < n; k++) {
    for (int i = 0; i < 16; i++) acc[i] = step(acc[i]);
    asm volatile("" ::: "memory");
  }
  volatile double sink = 0;
  for (int i = 0; i < 16; i++) sink = sink + reinterpret_cast<float*>(&acc[i])[0];
  return 16.0 * n;
}

std::vector<double> rates(int64_t n) {
  std::vector<double> out;
  auto timed = [&](auto f) {
    auto t0 = std::chrono::steady_clock::now();
    double ops = f();
    out.push_back(ops / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  };
#ifdef __AVX512F__
  auto f32 = [](int i) { return _mm512_set1_ps(i); };  // float accumulators' starting values
  const __m512 a = _mm512_set1_ps(1.0001f), b = _mm512_set1_ps(1e-4f);
  timed([&] { return rate(f32, [&](__m512 x) { return _mm512_fmadd_ps(x, a, b); }, n); });
#else
  out.push_back(0);
#endif
#if defined(__AVX512BF16__)  // implies __AVX512F__: f32 is defined
  const __m512bh p = (__m512bh)_mm512_set1_epi32(0x3f803f80);
  timed([&] { return rate(f32, [&](__m512 x) { return _mm512_dpbf16_ps(x, p, p); }, n); });
#else
  out.push_back(0);
#endif
#if defined(__AVX512VNNI__)
  const __m512i u = _mm512_set1_epi32(0x01010101), s = _mm512_set1_epi32(0x01020304);
  auto i32 = [](int i) { return _mm512_set1_epi32(i); };
  timed([&] { return rate(i32, [&](__m512i x) { return _mm512_dpbusd_epi32(x, u, s); }, n); });
#else
  out.push_back(0);
#endif
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("rates", &rates); }
"""

REPS = 7
# instruction, FLOP (or integer ops) per instruction
ROWS = [("vfmadd231ps zmm (f32 FMA)", 32), ("vdpbf16ps zmm (bf16 pairs)", 64), ("vpdpbusd zmm (int8 quads)", 128)]


def main() -> None:
    mod = cpp_extension.load_inline(
        "warmkv_simd_rates", cpp_sources=SOURCE, extra_cflags=["-O2", "-march=native"], verbose=False
    )
    mod.rates(1_000_000)  # warm up the clock
    t0 = time.perf_counter()
    runs = [mod.rates(10_000_000) for _ in range(REPS)]  # the best of each: a shared VM's cores get taken
    got = [max(r) for r in zip(*runs, strict=True)]
    print(f"one core, best of {REPS} runs, {time.perf_counter() - t0:.1f} s")
    for (name, ops), r in zip(ROWS, got, strict=True):
        if r == 0:
            print(f"{name:30s} not built here")
            continue
        print(f"{name:30s} {r / 1e9:5.2f} G/s  {r * ops / 1e9:6.1f} G(FL)OP/s")


if __name__ == "__main__":
    main()
