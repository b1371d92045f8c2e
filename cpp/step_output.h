// StepOutput: what the scheduler decided for one step, as flat int32 arrays
// a runner can copy to a device as they are.
//
// Rows are sequences. Rows that bring exactly one token (decodes) come first,
// [0, num_decodes); prefill chunks follow. Row s brings the tokens
// input_ids[query_start_loc[s] : query_start_loc[s + 1]] at positions
// [seq_lens[s] - q_len, seq_lens[s]) and attends to its first seq_lens[s]
// tokens through block_tables[s * max_blocks_per_seq : ...].
#pragma once

#include <cstdint>
#include <vector>

#include "core_types.h"
#include "sequence.h"

namespace pagedserve {

// Pads block_tables rows; never read by a correct kernel (it stops at seq_lens).
inline constexpr BlockId kPadBlock = 0;

struct FinishedSeq {
  SeqId id;
  FinishReason reason;
  TokenId stop_token = -1;  // the stop token id that finished it, when reason == kStop from update()
};

struct ForkedSeq {
  SeqId parent;
  SeqId child;
  int32_t sample_index;  // which of the parent's n samples the child carries, in [1, n)
};

struct StepOutput {
  int32_t num_seqs = 0;
  int32_t num_tokens = 0;
  int32_t num_decodes = 0;  // leading rows with one token each
  int32_t max_query_len = 0;
  int32_t max_seq_len = 0;
  int32_t max_blocks_per_seq = 0;

  std::vector<SeqId> seq_ids;               // [num_seqs]
  std::vector<int32_t> input_ids;           // [num_tokens]
  std::vector<int32_t> positions;           // [num_tokens]
  std::vector<int32_t> slot_mapping;        // [num_tokens] block * block_size + offset
  std::vector<int32_t> query_start_loc;     // [num_seqs + 1]
  std::vector<int32_t> seq_lens;            // [num_seqs] context length including this step's tokens
  std::vector<int32_t> prompt_lens;         // [num_seqs] the sequence's prompt length (length-dependent rope)
  std::vector<int32_t> block_tables;        // [num_seqs, max_blocks_per_seq] padded with kPadBlock;
                                            // -1 (kDroppedBlock) before a sliding window (block_table.h)

  // Rows whose last token's logits must be sampled (their pending tokens end here).
  std::vector<int32_t> sample_rows;         // [num_sample_rows] index into rows
  std::vector<int32_t> logits_indices;      // [num_sample_rows] index into tokens
  std::vector<int32_t> num_samples;         // [num_sample_rows] n for a prompt about to fork, else 1
  int32_t total_samples = 0;                // update() expects this many sampled tokens

  // Tokens still on the device (the advanced step's samples, Scheduler::advance): input_ids holds 0
  // at token deferred_tokens[i]; the runner puts sample deferred_samples[i] of that step there.
  std::vector<int32_t> deferred_tokens;     // [num_deferred] index into tokens
  std::vector<int32_t> deferred_samples;    // [num_deferred] index into the advanced step's samples

  std::vector<BlockCopy> block_copies;      // apply before the forward, in order
  // Finished by schedule() without running: can never fit (kRejected), or
  // outgrew the whole pool while running alone (kLength).
  std::vector<FinishedSeq> rejected;
  std::vector<SeqId> preempted;             // sent back to waiting this step

  int32_t num_prefill_tokens() const { return num_tokens - num_decodes; }
};

// What update() (or commit()) did with the sampled tokens.
struct UpdateResult {
  std::vector<FinishedSeq> finished;
  std::vector<ForkedSeq> forks;
};

}  // namespace pagedserve
