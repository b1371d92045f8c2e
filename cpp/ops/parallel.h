// How the ops split work across the ops thread pool.
//
// An op estimates its total work (roughly: elements touched or multiply-adds)
// and asks for a ParallelRun. Below kMinParallelWork, waking threads costs
// more than it saves, so the run is inline with one worker.
//
//   ParallelRun run = parallel_run(total_work);
//   std::vector<Scratch> scratch(run.num_workers());
//   run.for_each(num_tasks, [&](int64_t task, int worker) { ... scratch[worker] ... });
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>

#include "ops/thread_pool.h"

namespace pagedserve::ops {

// About 20 microseconds of single-core work: the point where a wake-up pays off.
inline constexpr int64_t kMinParallelWork = 1 << 16;

class ParallelRun {
 public:
  explicit ParallelRun(std::shared_ptr<ThreadPool> pool) : pool_(std::move(pool)) {}

  int num_workers() const { return pool_ ? pool_->num_threads() : 1; }
  void for_each(int64_t num_tasks, const ThreadPool::TaskFn& fn) const;

 private:
  std::shared_ptr<ThreadPool> pool_;  // null: inline; kept alive across set_num_threads
};

ParallelRun parallel_run(int64_t total_work);

// For loops of equal-cost items: runs fn(begin, end) over contiguous ranges
// covering [0, num_items), a few ranges per worker.
template <typename Fn>
void parallel_for_range(int64_t num_items, int64_t work_per_item, Fn&& fn) {
  const ParallelRun run = parallel_run(num_items * work_per_item);
  const int64_t num_ranges = std::min<int64_t>(num_items, 4 * int64_t{run.num_workers()});
  if (num_ranges <= 1) {
    if (num_items > 0) fn(int64_t{0}, num_items);
    return;
  }
  run.for_each(num_ranges, [&](int64_t range, int) {
    fn(num_items * range / num_ranges, num_items * (range + 1) / num_ranges);
  });
}

}  // namespace pagedserve::ops
