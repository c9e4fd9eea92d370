// The CPU threads of every codec and GEMM: one persistent pool and one thread-count setting per
// process. They live in a shared library (libqformats_threads) that every extension module links,
// so qformats._runtime.set_num_threads, QFORMATS_NUM_THREADS and the CLI's --threads change the
// threads of every format (a static copy per extension would give each module its own setting).
//
// The pool hands out chunks of a job dynamically. The calling thread works too and returns as
// soon as every chunk is done, without waiting for workers that have not woken up yet; a worker
// descheduled by another process on a busy machine delays the call by at most the chunk it holds.
// Each item is processed by exactly one thread, whole, so results never depend on the schedule
// or on the thread count.
#pragma once
#include <cstdint>
#include <functional>
#include <string>

#if defined(_WIN32)
#define QF_THREADS_API
#else
#define QF_THREADS_API __attribute__((visibility("default")))
#endif

namespace qf {

// The most threads the setting takes: far above any useful count for memory-bound kernels; what
// the OS refuses below it is handled by running with the threads that could be created.
constexpr int kMaxThreads = 1024;

// The thread-count setting: QFORMATS_NUM_THREADS when it is an integer in [1, kMaxThreads]
// (larger values are capped), else the hardware threads (capped the same way).
QF_THREADS_API int num_threads();
// Sets it (clamped to [1, kMaxThreads]); a pool already started is resized at once, waiting for a
// running job to finish, so the process's OS threads follow the setting.
QF_THREADS_API void set_num_threads(int n);
// Why QFORMATS_NUM_THREADS was ignored or capped ("" when it was not): shown by the Python layer.
QF_THREADS_API std::string num_threads_env_note();
// Worker threads alive now (the pool starts on the first parallel job, with num_threads() - 1
// workers, or fewer when the OS refuses to create more).
QF_THREADS_API int pool_workers();

// fn(i0, i1) over disjoint ranges covering [0, n): chunks of about n / (4 * threads) items, at
// least `grain`. Small jobs (n <= grain), calls from inside a pool job, and calls while another
// thread's job holds the pool run on the caller alone. Rethrows the first exception of fn.
QF_THREADS_API void parallel_chunks(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

}  // namespace qf
