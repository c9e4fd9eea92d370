#include "gemm/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "common/parallel.h"

namespace qf::gemm {

namespace {

struct Job {
  const std::function<void(int64_t, int64_t)>* fn;
  int64_t n = 0, chunk = 1, n_chunks = 0;
  std::atomic<int64_t> next{0};  // next chunk to claim
  std::atomic<int64_t> done{0};  // chunks finished
  std::mutex m;
  std::condition_variable finished;
  std::exception_ptr error;

  // Claims and runs chunks until none is left. The caller's fn is only touched for a claimed
  // chunk, and the submitting thread waits for every claimed chunk, so it stays valid.
  void work() {
    for (;;) {
      const int64_t c = next.fetch_add(1, std::memory_order_relaxed);
      if (c >= n_chunks) return;
      try {
        (*fn)(c* chunk, std::min(n, (c + 1) * chunk));
      } catch (...) {
        std::lock_guard<std::mutex> lock(m);
        if (!error) error = std::current_exception();
      }
      if (done.fetch_add(1, std::memory_order_acq_rel) + 1 == n_chunks) {
        std::lock_guard<std::mutex> lock(m);
        finished.notify_all();
      }
    }
  }
};

thread_local bool in_pool_job = false;

class Pool {
 public:
  explicit Pool(int workers) {
    for (int i = 0; i < workers; ++i) std::thread([this] { loop(); }).detach();
  }
  // Runs the job with the workers; false (nothing run) when another thread's job holds the pool.
  bool run(const std::shared_ptr<Job>& job) {
    std::unique_lock<std::mutex> submit(submit_, std::try_to_lock);
    if (!submit.owns_lock()) return false;
    {
      std::lock_guard<std::mutex> lock(m_);
      job_ = job;
      ++generation_;
    }
    wake_.notify_all();
    in_pool_job = true;
    job->work();
    in_pool_job = false;
    {
      std::unique_lock<std::mutex> lock(job->m);
      job->finished.wait(lock, [&] { return job->done.load(std::memory_order_acquire) == job->n_chunks; });
    }
    {
      std::lock_guard<std::mutex> lock(m_);
      job_.reset();  // late workers find no job (or a finished one: no chunk left to claim)
    }
    return true;
  }

 private:
  void loop() {
    uint64_t seen = 0;
    in_pool_job = true;
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(m_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        job = job_;
      }
      if (job) job->work();
    }
  }

  std::mutex submit_, m_;
  std::condition_variable wake_;
  std::shared_ptr<Job> job_;
  uint64_t generation_ = 0;
};

Pool& pool() {
  // Never destroyed: the workers sleep on a condition variable when idle and die with the process.
  static Pool* p = new Pool(std::max(0, num_threads() - 1));
  return *p;
}

}  // namespace

void parallel_chunks(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int threads = num_threads();
  if (threads <= 1 || n <= grain || in_pool_job) {
    fn(0, n);
    return;
  }
  auto job = std::make_shared<Job>();
  job->fn = &fn;
  job->n = n;
  job->chunk = std::max(grain, (n + 4 * int64_t(threads) - 1) / (4 * int64_t(threads)));
  job->n_chunks = (n + job->chunk - 1) / job->chunk;
  if (!pool().run(job)) {
    fn(0, n);
    return;
  }
  if (job->error) std::rethrow_exception(job->error);
}

}  // namespace qf::gemm
