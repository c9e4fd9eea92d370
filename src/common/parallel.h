// Fork-join parallelism for the CPU codecs: split [0, n) into contiguous chunks run by the
// process's one thread pool (common/thread_pool.h). Each index is processed exactly once, so the
// results never depend on the thread count (no cross-thread reductions here).
#pragma once
#include <algorithm>
#include <cstdint>

#include "common/thread_pool.h"

namespace qf {

// Calls fn(begin, end) over disjoint chunks covering [0, n). `grain` is the smallest chunk
// worth a thread (in units of the index: rows, blocks, ...); small inputs stay on the caller.
template <class Fn>
void parallel_for(int64_t n, int64_t grain, Fn&& fn) {
  if (n <= 0) return;
  if (n <= std::max<int64_t>(grain, 1) || num_threads() <= 1) {
    fn(int64_t(0), n);  // without the std::function and the pool
    return;
  }
  parallel_chunks(n, grain, fn);
}

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
