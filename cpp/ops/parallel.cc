// The process-wide pool behind set_num_threads(). It is the one piece of
// shared state in the ops: a thread pool is a process resource, and a second
// pool per caller would oversubscribe the cores.
#include "ops/parallel.h"

#include <algorithm>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

#if defined(__linux__)
#include <sched.h>
#endif

#include "ops/ops.h"

namespace pagedserve::ops {
namespace {

// The cores this process may run on: its affinity mask (taskset, a container's cpuset, a
// tensor-parallel rank's share), not the machine's count: 16 threads pinned to 2 cores would
// take turns on them and every step would wait for the slowest.
int usable_cores() {
#if defined(__linux__)
  cpu_set_t mask;
  if (sched_getaffinity(0, sizeof(mask), &mask) == 0) return std::max(1, CPU_COUNT(&mask));
#endif
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

struct PoolSlot {
  std::mutex mutex;
  int num_threads = usable_cores();
  std::shared_ptr<ThreadPool> pool;  // built on first parallel use
};

PoolSlot& pool_slot() {
  static PoolSlot slot;
  return slot;
}

std::shared_ptr<ThreadPool> shared_pool() {
  PoolSlot& slot = pool_slot();
  std::lock_guard lock(slot.mutex);
  if (slot.num_threads <= 1) return nullptr;
  if (!slot.pool) slot.pool = std::make_shared<ThreadPool>(slot.num_threads);
  return slot.pool;
}

}  // namespace

void ParallelRun::for_each(int64_t num_tasks, const ThreadPool::TaskFn& fn) const {
  if (pool_) {
    pool_->run(num_tasks, fn);
    return;
  }
  for (int64_t task = 0; task < num_tasks; ++task) fn(task, 0);
}

ParallelRun parallel_run(int64_t total_work) {
  if (total_work < kMinParallelWork) return ParallelRun(nullptr);
  return ParallelRun(shared_pool());
}

void set_num_threads(int num_threads) {
  if (num_threads < 1) {
    throw std::invalid_argument("set_num_threads: num_threads must be >= 1, got " + std::to_string(num_threads));
  }
  std::shared_ptr<ThreadPool> old_pool;
  {
    PoolSlot& slot = pool_slot();
    std::lock_guard lock(slot.mutex);
    if (slot.num_threads == num_threads) return;
    slot.num_threads = num_threads;
    old_pool = std::move(slot.pool);  // runs in flight keep their own reference
  }
  // old_pool's threads are joined here, outside the lock, if nothing else holds it.
}

int num_threads() {
  PoolSlot& slot = pool_slot();
  std::lock_guard lock(slot.mutex);
  return slot.num_threads;
}

}  // namespace pagedserve::ops
