// Minimal fork-join parallelism for the CPU kernels: split [0, n) into contiguous chunks,
// one per thread. Chunks are contiguous and each index is processed exactly once, so the
// results never depend on the thread count (no cross-thread reductions here).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <thread>
#include <vector>

#include "common/fp16.h"

namespace qf {

// Threads used by the CPU kernels: QFORMATS_NUM_THREADS if set, else the hardware threads.
inline int& num_threads_setting() {
  static int n = [] {
    if (const char* env = std::getenv("QFORMATS_NUM_THREADS")) {
      const int v = std::atoi(env);
      if (v > 0) return v;
    }
    const unsigned hw = std::thread::hardware_concurrency();
    return hw ? static_cast<int>(hw) : 1;
  }();
  return n;
}
inline int num_threads() { return num_threads_setting(); }
inline void set_num_threads(int n) { num_threads_setting() = n > 0 ? n : 1; }

// Calls fn(begin, end) over disjoint chunks covering [0, n). `grain` is the smallest chunk
// worth a thread (in units of the index: rows, blocks, ...); small inputs stay on the caller.
template <class Fn>
void parallel_for(int64_t n, int64_t grain, Fn&& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t max_threads = std::max<int64_t>(1, std::min<int64_t>(num_threads(), (n + grain - 1) / grain));
  if (max_threads == 1) {
    fn(int64_t(0), n);
    return;
  }
  const int64_t chunk = (n + max_threads - 1) / max_threads;
  std::vector<std::thread> workers;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(max_threads));
  workers.reserve(static_cast<size_t>(max_threads - 1));
  for (int64_t t = 1; t < max_threads; ++t) {
    const int64_t b = t * chunk, e = std::min(n, b + chunk);
    if (b >= e) break;
    workers.emplace_back([&, t, b, e] {
      try {
        fn(b, e);
      } catch (...) {
        errors[static_cast<size_t>(t)] = std::current_exception();
      }
    });
  }
  try {
    fn(int64_t(0), std::min(n, chunk));
  } catch (...) {
    errors[0] = std::current_exception();
  }
  for (auto& w : workers) w.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace qf

namespace qf {

// Blocks per thread at least (~16-64 KiB of input): below that, starting a thread costs more
// than it saves.
constexpr int64_t kGrainBlocks = 512;

// fn(b) for every block index b in [0, n_blocks), threaded: the driver of every blockwise
// CPU codec (each block is independent, so the output never depends on the thread count).
template <class Fn>
void for_each_block(int64_t n_blocks, Fn&& fn, int64_t grain = kGrainBlocks) {
  parallel_for(n_blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) fn(b);
  });
}

}  // namespace qf
