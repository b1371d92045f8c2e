#include "ops/thread_pool.h"

#include <algorithm>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace pagedserve::ops {
namespace {

// Spins until done() or `limit` has passed; returns done().
template <typename Done>
bool spin_until(Done&& done, std::chrono::microseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (done()) return true;
#if defined(__x86_64__)
      _mm_pause();
#endif
    }
    if (std::chrono::steady_clock::now() >= deadline) return done();
  }
}

}  // namespace

ThreadPool::ThreadPool(int num_threads) {
  const int num_workers = std::max(num_threads, 1) - 1;
  workers_.reserve(static_cast<size_t>(num_workers));
  for (int w = 0; w < num_workers; ++w) workers_.emplace_back([this, w] { worker_loop(w + 1); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  work_ready_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::run_inline(int64_t num_tasks, const TaskFn& fn) {
  for (int64_t task = 0; task < num_tasks; ++task) fn(task, 0);
}

void ThreadPool::run(int64_t num_tasks, const TaskFn& fn) {
  if (num_tasks <= 0) return;
  bool expected = false;
  if (workers_.empty() || num_tasks == 1 || !busy_.compare_exchange_strong(expected, true)) {
    run_inline(num_tasks, fn);
    return;
  }
  Job job;
  job.fn = &fn;
  job.num_tasks = num_tasks;
  {
    std::lock_guard lock(mutex_);
    job_ = &job;
    ++generation_;
  }
  work_ready_.notify_all();
  drain(job, 0);
  std::exception_ptr error;
  {
    // Every task has been claimed; wait for the workers still inside one. A
    // worker that wakes after this sees job_ == nullptr and goes back to sleep.
    const auto workers_done = [&] { return job.active_workers.load(std::memory_order_acquire) == 0; };
    spin_until(workers_done, kSpinTime);
    std::unique_lock lock(mutex_);
    job_done_.wait(lock, workers_done);
    job_ = nullptr;
    error = job.error;
  }
  busy_.store(false);
  if (error) std::rethrow_exception(error);
}

void ThreadPool::worker_loop(int worker) {
  uint64_t seen_generation = 0;
  for (;;) {
    Job* job = nullptr;
    spin_until([&] { return generation_.load(std::memory_order_acquire) != seen_generation; }, kSpinTime);
    {
      std::unique_lock lock(mutex_);
      work_ready_.wait(lock, [&] { return stopping_ || generation_.load() != seen_generation; });
      if (stopping_) return;
      seen_generation = generation_.load();
      job = job_;
      if (job == nullptr) continue;
      ++job->active_workers;
    }
    drain(*job, worker);
    {
      std::lock_guard lock(mutex_);
      if (job->active_workers.fetch_sub(1, std::memory_order_acq_rel) == 1) job_done_.notify_one();
    }
  }
}

void ThreadPool::drain(Job& job, int worker) {
  for (;;) {
    const int64_t task = job.next_task.fetch_add(1, std::memory_order_relaxed);
    if (task >= job.num_tasks) return;
    try {
      (*job.fn)(task, worker);
    } catch (...) {
      std::lock_guard lock(mutex_);
      if (!job.error) job.error = std::current_exception();
    }
  }
}

}  // namespace pagedserve::ops
