// Sequence: one stream of tokens the scheduler drives, with its block table.
#pragma once

#include <cstdint>
#include <vector>

#include "block_table.h"
#include "core_types.h"

namespace pagedserve {

enum class FinishReason : uint8_t {
  kNone = 0,      // still running or waiting
  kStop = 1,      // EOS, a stop token id, or a stop string (Scheduler::finish)
  kLength = 2,    // max_tokens, max_model_len, or the KV pool cannot hold it alone
  kAbort = 3,     // Scheduler::abort
  kRejected = 4,  // could never be scheduled: prompt longer than max_model_len or the pool, n > max_num_seqs
};

// Per-sequence stopping rules the scheduler applies in update().
struct StopParams {
  int32_t max_tokens = 16;
  int32_t min_tokens = 0;  // EOS and stop token ids are ignored before this many tokens
  bool ignore_eos = false;
  std::vector<TokenId> stop_token_ids;
  int32_t n = 1;  // parallel samples: forked after the prompt's prefill
};

enum class SeqStatus : uint8_t { kWaiting, kRunning };

struct Sequence {
  Sequence(SeqId id_, std::vector<TokenId> tokens_, StopParams params_, BlockPool& pool)
      : id(id_),
        tokens(std::move(tokens_)),
        num_prompt_tokens(static_cast<int32_t>(tokens.size())),
        params(std::move(params_)),
        table(pool) {}

  int32_t num_tokens() const { return static_cast<int32_t>(tokens.size()); }
  int32_t num_generated() const { return num_tokens() - num_prompt_tokens; }
  // Tokens whose KV is not in the cache yet: 1 while decoding, more while prefilling.
  int32_t num_pending() const { return num_tokens() - num_computed_tokens; }
  bool finished() const { return finish_reason != FinishReason::kNone; }
  // Sequence slots this one occupies in the running batch once forked.
  int32_t batch_slots() const { return forked ? 1 : params.n; }

  SeqId id;
  std::vector<TokenId> tokens;  // prompt followed by generated tokens
  int32_t num_prompt_tokens;
  int32_t num_computed_tokens = 0;
  StopParams params;
  BlockTable table;
  SeqStatus status = SeqStatus::kWaiting;
  FinishReason finish_reason = FinishReason::kNone;  // set once: the sequence is done and holds no blocks
  uint64_t admit_order = 0;  // larger = admitted later; LIFO preemption picks the largest
  bool forked = false;       // the n > 1 fork has happened (or n == 1)
  bool use_prefix_cache = true;  // false: admission never adopts cached blocks (its KV is computed anew)
  bool scheduled = false;    // part of the step being built
  // Run-ahead (Scheduler::advance): the last token is kPendingToken, standing for sample
  // `awaiting_sample` of the advanced step until commit() writes it; -1 otherwise.
  int32_t awaiting_sample = -1;
  int32_t num_preemptions = 0;
};

}  // namespace pagedserve
