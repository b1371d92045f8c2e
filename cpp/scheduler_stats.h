// SchedulerStats: a snapshot of the scheduler and its block pool.
#pragma once

#include <cstdint>

namespace pagedserve {

struct SchedulerStats {
  int32_t num_running = 0;
  int32_t num_waiting = 0;

  int32_t num_blocks = 0;
  int32_t num_free_blocks = 0;       // free + evictable
  int32_t num_evictable_blocks = 0;  // cached, held by nobody
  int32_t num_used_blocks = 0;
  double pool_utilization = 0.0;     // used / total
  // Slots in held blocks that hold no token: at most block_size - 1 per sequence.
  int64_t internal_fragmentation_slots = 0;
  // Block references beyond one per block: blocks a non-sharing allocator would also need.
  int64_t blocks_saved_by_sharing = 0;

  int64_t prefix_queried_blocks = 0;
  int64_t prefix_hit_blocks = 0;
  int64_t prefix_evictions = 0;
  double prefix_hit_rate = 0.0;  // hit / queried, 0 when nothing was queried

  int64_t num_preemptions = 0;
  int64_t num_preempted_tokens = 0;  // computed tokens dropped by preemption (recomputed on readmission)

  // The last schedule() call.
  int32_t step_num_seqs = 0;
  int32_t step_prefill_tokens = 0;
  int32_t step_decode_tokens = 0;
};

}  // namespace pagedserve
