// Scheduler: continuous batching over a paged KV cache.
//
// A sequence's state is the container it lives in: the waiting queue, the
// running list (admission order), or gone (finished sequences release their
// blocks at once and are reported, then forgotten).
//
// schedule() builds one step under three limits: max_num_seqs rows,
// max_num_batched_tokens tokens, and the pool's free blocks.
//   1. Running decodes, one token each, in admission order.
//   2. Running partial prefills continue their prompt, chunked to the budget.
//   3. Waiting sequences are admitted FCFS, reusing cached prefix blocks, with
//      a chunk of their prompt (chunked prefill) while blocks stay above a
//      small watermark. The queue head is never skipped: a head that does not
//      fit now blocks the rest; a head that can never fit is rejected.
// A running sequence that cannot get a block preempts running sequences not
// yet scheduled this step, most recently admitted first, never itself while
// another candidate exists. A victim drops its blocks (full ones stay cached),
// keeps its tokens, and goes to the front of the queue to be recomputed.
//
// Sliding window W (config.sliding_window, for models whose every layer
// attends over a window of W, and which pass window = W to paged_attention):
// after each step, a sequence gives back the blocks wholly before its next
// query's window (positions < num_computed - W + 1; BlockTable::
// drop_blocks_before), so it holds about W / block_size + 1 blocks however
// long it grows. Admission and the "can never fit" check count only those
// live blocks: a prompt longer than the pool is prefilled in chunks that fit.
// Dropped blocks that were registered stay in the prefix cache (evictable),
// and a preempted sequence recomputes from position 0 as usual.
//
// Between schedule() and the next schedule(), update() must receive the
// step's sampled tokens (none for a step that samples nothing), or advance()
// must stand in for them:
//
// Run-ahead (the engine's async scheduling): advance() records the step as
// computed and gives each sampling row a placeholder token (kPendingToken),
// so the next schedule() can run before the sampled tokens reach the host;
// its StepOutput names the inputs still on the device (deferred_tokens /
// deferred_samples). commit() then writes the real tokens and applies every
// stopping rule, exactly as update() would have; it must come before the
// next advance() or update(). A row whose placeholder reaches max_tokens or
// max_model_len is not scheduled again; one that commit() finishes on EOS or
// a stop token ran one extra row, whose token nobody receives. That row's KV
// lands in blocks commit() has released, but no step scheduled into them
// can run before it: steps run in the device's stream order.
//
//   schedule() -> advance() -> schedule() -> commit(t) -> advance() -> ...
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "block_pool.h"
#include "core_types.h"
#include "scheduler_stats.h"
#include "sequence.h"
#include "step_output.h"

namespace pagedserve {

struct SchedulerConfig {
  int32_t num_blocks = 0;
  int32_t block_size = 16;
  int32_t max_num_seqs = 256;
  int32_t max_num_batched_tokens = 8192;
  int32_t max_model_len = 8192;
  bool enable_prefix_caching = true;
  // Admission keeps this fraction of the pool free while anything runs, so
  // running sequences can grow without preempting the newcomers at once.
  double watermark = 0.01;
  std::vector<TokenId> eos_token_ids;
  // Every layer's attention window (0: full attention); see above.
  int32_t sliding_window = 0;
};

class Scheduler {
 public:
  // Throws std::invalid_argument on an inconsistent config.
  explicit Scheduler(SchedulerConfig config);
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Queues a sequence and returns its id. Throws std::invalid_argument on an
  // empty prompt or nonsensical params; a prompt that cannot fit is accepted
  // here and rejected by schedule(), so it is reported like any other finish.
  // use_prefix_cache=false computes the whole prompt even where the prefix cache
  // holds it (a request that needs every prompt position's output, e.g. prompt
  // logprobs, on a model whose freed window blocks cannot be read back).
  // cache_salt: only sequences with the same salt share cached blocks (block_hash.h).
  SeqId add_sequence(std::span<const TokenId> prompt, StopParams params, bool use_prefix_cache = true,
                     uint64_t cache_salt = 0);

  // Builds the next step. Throws std::logic_error if the previous step's
  // update() (or advance()) has not been called.
  std::shared_ptr<const StepOutput> schedule();

  // Appends the sampled tokens (StepOutput::total_samples of them, in
  // sample-row order), forks n > 1 prompts, finishes sequences on EOS, stop
  // token ids, max_tokens and max_model_len, and registers newly full blocks
  // with the prefix cache.
  UpdateResult update(std::span<const TokenId> sampled);

  // Run-ahead (see above). advance() takes the scheduled step without its tokens; every
  // sampling row must draw one sample (no n > 1 prompt about to fork). Throws
  // std::logic_error out of order. commit() takes the advanced step's tokens (total_samples).
  void advance();
  UpdateResult commit(std::span<const TokenId> sampled);
  bool has_advanced() const { return advanced_ != nullptr; }

  // Finish a waiting or running sequence now and release its blocks
  // (abort: kAbort; a stop string found by the caller: kStop). Returns false if
  // the id is unknown or already finished. Safe between schedule() and update():
  // the step's row for it is ignored.
  bool abort(SeqId id) { return finish(id, FinishReason::kAbort); }
  bool finish(SeqId id, FinishReason reason);

  bool has_unfinished() const { return !sequences_.empty(); }
  int32_t num_waiting() const { return static_cast<int32_t>(waiting_.size()); }
  int32_t num_running() const { return static_cast<int32_t>(running_.size()); }
  const Sequence* find(SeqId id) const;
  std::vector<SeqId> running_ids() const;
  std::vector<SeqId> waiting_ids() const;
  SchedulerStats stats() const;
  const SchedulerConfig& config() const { return config_; }
  const BlockPool& pool() const { return pool_; }

 private:
  void schedule_decodes(StepOutput& out, int32_t& budget);
  void schedule_partial_prefills(StepOutput& out, int32_t& budget);
  void admit_waiting(StepOutput& out, int32_t& budget);
  // Makes seq's next `count` positions writable, preempting others as needed,
  // and adds seq to the step. Returns false if seq could not be scheduled (it
  // was preempted itself, or finished because it cannot fit even alone).
  bool reserve_or_preempt(Sequence& seq, int32_t count, StepOutput& out);
  void add_to_step(Sequence& seq, int32_t count);
  // The most tokens (at most `limit`) seq can write next without preemption.
  int32_t writable_tokens(const Sequence& seq, int32_t limit) const;
  Sequence* pick_victim(const Sequence& requester) const;
  void preempt(Sequence& seq, StepOutput& out);
  FinishReason never_fits(const Sequence& seq) const;  // kNone if it might fit
  int32_t blocks_for(int32_t num_tokens) const;
  // The first position a query at `position` attends to (0 without a window).
  int32_t window_start(int32_t position) const;
  // Releases seq's blocks; reap() removes it from every container.
  void finish_now(Sequence& seq, FinishReason reason);
  void reap();
  // The step's rows have computed their tokens: num_computed_tokens, prefix-cache
  // registration and window drops (update() and advance()).
  void mark_computed(const StepOutput& step);
  Sequence* live(SeqId id);  // nullptr once finished (aborted since schedule())
  void append_token(Sequence& seq, TokenId token, UpdateResult& result);
  // Applies EOS, stop token ids, max_tokens and max_model_len to seq's last token.
  void check_stop(Sequence& seq, TokenId token, UpdateResult& result);
  // seq's tokens have reached max_tokens or max_model_len (the placeholder counted).
  bool at_length_limit(const Sequence& seq) const;
  // Running and not yet in this step, nor awaiting a commit that ends it by length.
  bool schedulable(const Sequence& seq) const;
  void fork_children(Sequence& parent, std::span<const TokenId> samples, UpdateResult& result);
  void build_arrays(StepOutput& out);

  SchedulerConfig config_;
  BlockPool pool_;
  std::unordered_map<SeqId, std::unique_ptr<Sequence>> sequences_;  // waiting and running
  std::deque<Sequence*> waiting_;
  std::vector<Sequence*> running_;
  std::vector<std::pair<Sequence*, int32_t>> scheduled_;  // rows of the step being built, with token counts
  std::vector<SeqId> finished_ids_;                        // finished, not yet reaped
  std::shared_ptr<StepOutput> in_flight_;
  std::shared_ptr<StepOutput> advanced_;  // advance()d, its tokens not yet committed
  SeqId next_id_ = 0;
  uint64_t next_admit_order_ = 0;
  int64_t num_preemptions_ = 0;
  int64_t num_preempted_tokens_ = 0;
  int32_t watermark_blocks_ = 0;
  SchedulerStats last_step_{};
};

}  // namespace pagedserve
