// Threads of the CPU GEMMs: a persistent pool (created on first use, qf::num_threads() - 1
// workers, never torn down) that hands out chunks of a job dynamically. The calling thread
// works too and returns as soon as every chunk is done, without waiting for workers that have
// not woken up yet; a worker descheduled by another process on a busy machine delays the call by
// at most the chunk it holds, not by a fixed share of the work (as a static split would).
// Each item is processed by exactly one thread, whole, so results never depend on the schedule.
#pragma once
#include <cstdint>
#include <functional>

namespace qf::gemm {

// fn(i0, i1) over disjoint ranges covering [0, n): chunks of about n / (4 * threads) items, at
// least `grain`. Small jobs (n <= grain), calls from inside a pool job, and calls while another
// thread's job holds the pool run on the caller alone. Rethrows the first exception of fn.
void parallel_chunks(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

}  // namespace qf::gemm
