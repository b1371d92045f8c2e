// Vocabulary types shared by the memory core, the scheduler and the ops.
#pragma once

#include <cstdint>

namespace pagedserve {

// Index of a KV block in the runner's cache tensors, in [0, num_blocks).
using BlockId = int32_t;
// A token id of the model's vocabulary.
using TokenId = int32_t;
// A sampled token still on the device (Scheduler::advance); never a model input.
inline constexpr TokenId kPendingToken = -1;
// Scheduler-assigned, never reused within one Scheduler.
using SeqId = int64_t;

// Copy-on-write order: the runner must copy block `src` into block `dst`
// (every layer, keys and values) before the step's forward pass.
struct BlockCopy {
  BlockId src;
  BlockId dst;
};

}  // namespace pagedserve
