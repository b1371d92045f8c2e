// Helpers for driving a Scheduler in tests.
#pragma once

#include <numeric>
#include <optional>
#include <vector>

#include "scheduler.h"

namespace pagedserve::testing {

inline std::vector<TokenId> prompt_of(int32_t length, TokenId first = 100) {
  std::vector<TokenId> t(static_cast<size_t>(length));
  std::iota(t.begin(), t.end(), first);
  return t;
}

inline SchedulerConfig small_config(int32_t num_blocks, int32_t block_size = 4) {
  SchedulerConfig c;
  c.num_blocks = num_blocks;
  c.block_size = block_size;
  c.max_num_seqs = 8;
  c.max_num_batched_tokens = 64;
  c.max_model_len = 1024;
  c.watermark = 0.0;
  c.eos_token_ids = {2};
  return c;
}

inline StopParams max_tokens(int32_t n) {
  StopParams p;
  p.max_tokens = n;
  return p;
}

// One engine step: schedule, then answer every sample row with `token`.
inline std::shared_ptr<const StepOutput> step(Scheduler& s, UpdateResult* result = nullptr, TokenId token = 7) {
  auto out = s.schedule();
  std::vector<TokenId> sampled(static_cast<size_t>(out->total_samples), token);
  UpdateResult r = s.update(sampled);
  if (result) *result = std::move(r);
  return out;
}

inline int32_t q_len(const StepOutput& out, int32_t row) {
  return out.query_start_loc[static_cast<size_t>(row) + 1] - out.query_start_loc[static_cast<size_t>(row)];
}

inline std::optional<int32_t> row_of(const StepOutput& out, SeqId id) {
  for (int32_t r = 0; r < out.num_seqs; ++r)
    if (out.seq_ids[static_cast<size_t>(r)] == id) return r;
  return std::nullopt;
}

}  // namespace pagedserve::testing
