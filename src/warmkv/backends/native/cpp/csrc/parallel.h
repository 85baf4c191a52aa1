// Tasks of uneven cost on torch's thread pool, each thread taking the next one when it is free.
//
// at::parallel_for hands each thread one fixed, contiguous part of its range. When tasks differ
// in cost (attention over a prefill piece deep in its prompt beside decode rows near the start of
// theirs) or a thread is preempted (a server's other threads share the cores), the others then
// wait at the join. Which thread runs a task never changes its numbers.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace warmkv {

// body(take) runs once on each thread; take(i) sets i to the next unclaimed task in [0, n) and
// returns false when none is left. On one thread (or inside a parallel region) body runs once and
// takes every task in order.
template <typename Body>
void parallel_tasks(int64_t n, const Body& body) {
  if (n <= 0) return;
  std::atomic<int64_t> next{0};
  auto take = [&](int64_t& i) {
    i = next.fetch_add(1, std::memory_order_relaxed);
    return i < n;
  };
  const int64_t threads = std::min<int64_t>(std::max(at::get_num_threads(), 1), n);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { body(take); });
}

}  // namespace warmkv
