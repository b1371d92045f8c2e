// ThreadPool: persistent worker threads for the CPU ops.
//
// The calling thread always takes part, so a pool of N threads starts N - 1
// workers. A worker that finishes a job spins for kSpinTime waiting for the
// next one before it sleeps on a condition variable: a model step calls the
// ops back to back a few microseconds apart, and waking a sleeping thread
// costs tens of microseconds, more than a small op's whole run. The caller
// waits for the workers the same way. Longer idle periods cost no CPU, so
// torch's own intra-op threads keep the cores between steps.
//
// run() hands out task indices one at a time from an atomic counter, so
// tasks of uneven cost (sequences of different lengths) balance themselves.
// A run() issued while the pool is busy (a second Python thread, or a task
// that itself calls run()) executes inline on its caller instead of waiting.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace pagedserve::ops {

class ThreadPool {
 public:
  // fn(task, worker): worker is in [0, num_threads()) and unique among the
  // tasks running at the same moment, so it can index per-worker scratch.
  using TaskFn = std::function<void(int64_t task, int worker)>;

  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  static constexpr std::chrono::microseconds kSpinTime{50};

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs fn for every task in [0, num_tasks) and returns when all are done.
  // The first exception a task throws is rethrown here (after the rest ran).
  void run(int64_t num_tasks, const TaskFn& fn);

 private:
  struct Job {
    const TaskFn* fn = nullptr;
    int64_t num_tasks = 0;
    std::atomic<int64_t> next_task{0};
    std::atomic<int> active_workers{0};  // changed under mutex_; read by the caller's spin
    std::exception_ptr error;  // guarded by mutex_
  };

  void worker_loop(int worker);
  void drain(Job& job, int worker);
  static void run_inline(int64_t num_tasks, const TaskFn& fn);

  std::vector<std::thread> workers_;
  std::atomic<bool> busy_{false};
  std::mutex mutex_;
  std::condition_variable work_ready_;
  std::condition_variable job_done_;
  Job* job_ = nullptr;        // guarded by mutex_
  std::atomic<uint64_t> generation_{0};  // bumped under mutex_ per job, so workers take each once
  bool stopping_ = false;     // guarded by mutex_
};

}  // namespace pagedserve::ops
