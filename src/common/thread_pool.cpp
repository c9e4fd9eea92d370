#include "common/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

namespace qf {

namespace {

// The CPUs this process may run on (taskset / cgroup cpusets shrink it), else the hardware threads.
int available_cpus() {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
#endif
  const unsigned hw = std::thread::hardware_concurrency();
  return hw ? static_cast<int>(hw) : 1;
}

// The starting setting, and in `note` why QFORMATS_NUM_THREADS was ignored or capped. strtoll with
// a whole-string and range check: atoi would wrap "99999999999" into an arbitrary int.
int initial_threads(std::string& note) {
  const int fallback = std::min(available_cpus(), kMaxThreads);
  const char* env = std::getenv("QFORMATS_NUM_THREADS");
  if (env == nullptr || *env == '\0') return fallback;
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(env, &end, 10);
  const std::string shown = std::string("QFORMATS_NUM_THREADS=") + env;
  if (end == env || *end != '\0' || (errno == ERANGE && v < 0) || v < 1) {
    note = shown + " is not an integer >= 1: ignored, using " + std::to_string(fallback) + " threads";
    return fallback;
  }
  if (errno == ERANGE || v > kMaxThreads) {
    note = shown + " is above the maximum: using " + std::to_string(kMaxThreads) + " threads";
    return kMaxThreads;
  }
  return static_cast<int>(v);
}

struct Setting {
  std::atomic<int> n{1};
  std::string note;
};

Setting& setting() {
  static Setting* s = [] {  // never destroyed: kernels may run while other modules unload
    auto* p = new Setting;
    p->n = initial_threads(p->note);
    return p;
  }();
  return *s;
}

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
  explicit Pool(int workers) { start(workers); }

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

  // Stops every worker and starts `workers` new ones, after the running job (if any) finishes.
  void resize(int workers) {
    std::lock_guard<std::mutex> submit(submit_);
    if (workers == static_cast<int>(threads_.size()) && workers == wanted_) return;
    stop_all();
    start(workers);
  }

  int workers() const { return alive_.load(std::memory_order_relaxed); }

 private:
  // Creating a thread fails under a process or memory limit (std::system_error, or bad_alloc for
  // its bookkeeping): the pool then runs with fewer workers, down to none (the caller alone). The
  // limit is then reached, so the caller's next allocation or thread would fail too (under an
  // address-space cap, what is left is less than one thread's stack): the pool starts again with
  // three quarters of the workers it could make, which leaves the rest of that room to the caller.
  void start(int workers) {
    wanted_ = workers;
    if (spawn(workers) < workers && !threads_.empty()) {
      const int keep = static_cast<int>(threads_.size()) * 3 / 4;
      stop_all();
      spawn(keep);
    }
    alive_.store(static_cast<int>(threads_.size()), std::memory_order_relaxed);
  }

  // Starts up to n workers; returns how many started.
  int spawn(int n) {
    for (int i = 0; i < n; ++i) {
      try {
        threads_.emplace_back([this] { loop(); });
      } catch (...) {
        return i;
      }
    }
    return n;
  }

  void stop_all() {
    {
      std::lock_guard<std::mutex> lock(m_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
    threads_.clear();
    {
      std::lock_guard<std::mutex> lock(m_);
      stop_ = false;
    }
  }

  void loop() {
    in_pool_job = true;  // a kernel that calls parallel_chunks from a chunk runs it inline
    uint64_t seen;
    {
      std::lock_guard<std::mutex> lock(m_);
      seen = generation_;
    }
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(m_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
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
  bool stop_ = false;
  std::vector<std::thread> threads_;
  int wanted_ = 0;
  std::atomic<int> alive_{0};
};

// The pool, created on the first parallel job. Never destroyed: idle workers sleep on a condition
// variable and die with the process. A forked child has none of its parent's threads (and may
// inherit a locked mutex of the pool), so it drops the parent's pool, unfreed, and starts its own.
std::mutex g_mu;  // guards creating the pool and changing the setting
std::atomic<Pool*> g_pool{nullptr};

void register_fork_handlers() {
#if defined(__linux__)
  pthread_atfork([] { g_mu.lock(); }, [] { g_mu.unlock(); },
                 [] {
                   g_pool.store(nullptr, std::memory_order_release);
                   in_pool_job = false;
                   g_mu.unlock();
                 });
#endif
}

Pool& pool() {
  Pool* p = g_pool.load(std::memory_order_acquire);
  if (p) return *p;
  std::lock_guard<std::mutex> lock(g_mu);
  p = g_pool.load(std::memory_order_acquire);
  if (!p) {
    static std::once_flag fork_handlers;
    std::call_once(fork_handlers, register_fork_handlers);
    p = new Pool(setting().n.load() - 1);
    g_pool.store(p, std::memory_order_release);
  }
  return *p;
}

}  // namespace

int num_threads() { return setting().n.load(std::memory_order_relaxed); }

void set_num_threads(int n) {
  n = std::clamp(n, 1, kMaxThreads);
  std::lock_guard<std::mutex> lock(g_mu);
  setting().n.store(n, std::memory_order_relaxed);
  if (Pool* p = g_pool.load(std::memory_order_acquire)) p->resize(n - 1);
}

std::string num_threads_env_note() { return setting().note; }

int pool_workers() {
  Pool* p = g_pool.load(std::memory_order_acquire);
  return p ? p->workers() : 0;
}

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

}  // namespace qf
