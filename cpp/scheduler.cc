#include "scheduler.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "check.h"

namespace pagedserve {
namespace {

SchedulerConfig validated(SchedulerConfig c) {
  auto require = [](bool ok, const std::string& what) {
    if (!ok) throw std::invalid_argument("SchedulerConfig: " + what);
  };
  require(c.num_blocks > 0, "num_blocks must be positive");
  require(c.block_size > 0, "block_size must be positive");
  require(c.max_num_seqs > 0, "max_num_seqs must be positive");
  require(c.max_model_len > 0, "max_model_len must be positive");
  require(c.max_num_batched_tokens >= c.max_num_seqs,
          "max_num_batched_tokens must be at least max_num_seqs, so every running sequence can decode");
  require(c.watermark >= 0.0 && c.watermark < 1.0, "watermark must be in [0, 1)");
  require(c.sliding_window >= 0, "sliding_window must be >= 0 (0: full attention)");
  return c;
}

}  // namespace

Scheduler::Scheduler(SchedulerConfig config)
    : config_(validated(std::move(config))),
      pool_(config_.num_blocks, config_.block_size, config_.enable_prefix_caching),
      watermark_blocks_(static_cast<int32_t>(std::ceil(config_.watermark * config_.num_blocks))) {}

SeqId Scheduler::add_sequence(std::span<const TokenId> prompt, StopParams params, bool use_prefix_cache,
                              uint64_t cache_salt) {
  if (prompt.empty()) throw std::invalid_argument("the prompt is empty");
  if (std::any_of(prompt.begin(), prompt.end(), [](TokenId t) { return t < 0; }))
    throw std::invalid_argument("the prompt has a negative token id");
  if (params.max_tokens < 1) throw std::invalid_argument("max_tokens must be at least 1");
  if (params.min_tokens < 0) throw std::invalid_argument("min_tokens must be non-negative");
  if (params.n < 1) throw std::invalid_argument("n must be at least 1");
  const SeqId id = next_id_++;
  auto seq = std::make_unique<Sequence>(id, std::vector<TokenId>(prompt.begin(), prompt.end()), std::move(params),
                                        pool_);
  seq->forked = seq->params.n == 1;
  seq->use_prefix_cache = use_prefix_cache;
  seq->table.set_root_hash(salted_root_hash(cache_salt));
  waiting_.push_back(seq.get());
  sequences_.emplace(id, std::move(seq));
  return id;
}

std::shared_ptr<const StepOutput> Scheduler::schedule() {
  if (in_flight_) {
    throw std::logic_error("schedule() called twice: call update() with the last step's tokens (or advance()) first");
  }
  auto out = std::make_shared<StepOutput>();
  int32_t budget = config_.max_num_batched_tokens;
  scheduled_.clear();
  schedule_decodes(*out, budget);
  schedule_partial_prefills(*out, budget);
  // Admitting right after a preemption would only evict the newcomer next step.
  if (out->preempted.empty()) admit_waiting(*out, budget);
  // No block is allocated after this point in the step.
  pool_.end_step();
  build_arrays(*out);
  reap();
  in_flight_ = out;
  return out;
}

void Scheduler::schedule_decodes(StepOutput& out, int32_t& budget) {
  const std::vector<Sequence*> snapshot = running_;  // preemption edits running_
  for (Sequence* seq : snapshot) {
    if (budget == 0) break;
    if (!schedulable(*seq) || seq->num_pending() != 1) continue;
    if (reserve_or_preempt(*seq, 1, out)) --budget;
  }
}

void Scheduler::schedule_partial_prefills(StepOutput& out, int32_t& budget) {
  const std::vector<Sequence*> snapshot = running_;
  for (Sequence* seq : snapshot) {
    if (budget == 0) break;
    if (!schedulable(*seq)) continue;
    const int32_t wanted = std::min(seq->num_pending(), budget);
    // Take what fits now; preempt only when not even one token fits.
    const int32_t fits = writable_tokens(*seq, wanted);
    const int32_t bs = config_.block_size;
    const int32_t count = fits > 0 ? fits : std::min(wanted, bs - seq->num_computed_tokens % bs);
    if (reserve_or_preempt(*seq, count, out)) budget -= count;
  }
}

bool Scheduler::schedulable(const Sequence& seq) const {
  const bool ends_on_commit = seq.awaiting_sample >= 0 && at_length_limit(seq);
  return seq.status == SeqStatus::kRunning && !seq.finished() && !seq.scheduled && !ends_on_commit;
}

void Scheduler::admit_waiting(StepOutput& out, int32_t& budget) {
  int32_t slots = 0;
  for (const Sequence* seq : running_) slots += seq->batch_slots();
  while (!waiting_.empty() && budget > 0) {
    Sequence& seq = *waiting_.front();
    if (const FinishReason why = never_fits(seq); why != FinishReason::kNone) {
      finish_now(seq, why);
      out.rejected.push_back({seq.id, why});
      waiting_.pop_front();
      continue;
    }
    if (slots + seq.batch_slots() > config_.max_num_seqs) break;
    const PrefixMatch match = seq.use_prefix_cache ? BlockTable::find_prefix(pool_, seq.tokens, seq.table.root_hash())
                                                   : PrefixMatch{};
    const int32_t begin = match.num_tokens(config_.block_size);
    int32_t count = std::min(seq.num_tokens() - begin, budget);
    const auto matched = static_cast<int32_t>(match.blocks.size());
    // With a window the matched blocks before begin's window are dropped right
    // after adoption: only the live ones leave the free count.
    const int32_t first_live = std::min(matched, window_start(begin) / config_.block_size);
    int32_t adopted_evictable = match.num_evictable;
    if (first_live > 0) {
      adopted_evictable = 0;
      for (int32_t i = first_live; i < matched; ++i) {
        adopted_evictable += pool_.refcount(match.blocks[static_cast<size_t>(i)]) == 0 ? 1 : 0;
      }
    }
    const int32_t available = pool_.num_free() - adopted_evictable;
    const bool idle = running_.empty() && scheduled_.empty();
    const int32_t room = available - (idle ? 0 : watermark_blocks_);
    // A windowed prompt runs in chunks that fit (it frees blocks behind its window as it goes).
    if (config_.sliding_window > 0) count = std::min(count, (matched + room) * config_.block_size - begin);
    const int32_t needed = blocks_for(begin + count) - matched;
    if (count <= 0 || needed > room) break;  // FCFS: the head waits, nobody overtakes

    waiting_.pop_front();
    seq.table.adopt_prefix(match);
    seq.table.drop_blocks_before(window_start(begin));
    seq.num_computed_tokens = begin;
    const bool reserved = seq.table.prepare_write(begin, begin + count, out.block_copies);
    PS_CHECK(reserved, "admission checked free blocks but prepare_write failed");
    seq.status = SeqStatus::kRunning;
    seq.admit_order = ++next_admit_order_;
    running_.push_back(&seq);
    add_to_step(seq, count);
    budget -= count;
    slots += seq.batch_slots();
  }
}

bool Scheduler::reserve_or_preempt(Sequence& seq, int32_t count, StepOutput& out) {
  const int32_t begin = seq.num_computed_tokens;
  while (!seq.table.prepare_write(begin, begin + count, out.block_copies)) {
    if (Sequence* victim = pick_victim(seq)) {
      preempt(*victim, out);
    } else if (!scheduled_.empty() || seq.awaiting_sample >= 0) {
      // Everyone else runs this step and seq is the latest admitted left; or its last token is
      // still on the device, and admission after commit() finishes it with that token counted.
      preempt(seq, out);
      return false;
    } else {
      finish_now(seq, FinishReason::kLength);  // alone with the whole pool and still no room
      out.rejected.push_back({seq.id, FinishReason::kLength});
      return false;
    }
  }
  add_to_step(seq, count);
  return true;
}

void Scheduler::add_to_step(Sequence& seq, int32_t count) {
  seq.scheduled = true;
  scheduled_.emplace_back(&seq, count);
}

int32_t Scheduler::writable_tokens(const Sequence& seq, int32_t limit) const {
  const int32_t begin = seq.num_computed_tokens;
  const int32_t free = pool_.num_free();
  if (seq.table.blocks_needed(begin, begin + limit) <= free) return limit;
  int32_t lo = 0, hi = limit;  // blocks_needed grows with the range: binary search the largest fit
  while (lo < hi) {
    const int32_t mid = lo + (hi - lo + 1) / 2;
    if (seq.table.blocks_needed(begin, begin + mid) <= free) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

Sequence* Scheduler::pick_victim(const Sequence& requester) const {
  for (auto it = running_.rbegin(); it != running_.rend(); ++it) {
    Sequence* seq = *it;
    if (seq != &requester && !seq->scheduled && !seq->finished()) return seq;
  }
  return nullptr;
}

void Scheduler::preempt(Sequence& seq, StepOutput& out) {
  num_preempted_tokens_ += seq.num_computed_tokens;
  ++num_preemptions_;
  ++seq.num_preemptions;
  seq.table.release();
  seq.num_computed_tokens = 0;
  seq.status = SeqStatus::kWaiting;
  running_.erase(std::find(running_.begin(), running_.end(), &seq));
  // Victims go latest-admitted first, so pushing each to the front keeps
  // their original admission order at the head of the queue.
  waiting_.push_front(&seq);
  out.preempted.push_back(seq.id);
}

int32_t Scheduler::blocks_for(int32_t num_tokens) const {
  return (num_tokens + config_.block_size - 1) / config_.block_size;
}

int32_t Scheduler::window_start(int32_t position) const {
  return config_.sliding_window > 0 ? std::max(0, position - config_.sliding_window + 1) : 0;
}

FinishReason Scheduler::never_fits(const Sequence& seq) const {
  if (seq.num_prompt_tokens > config_.max_model_len || seq.batch_slots() > config_.max_num_seqs)
    return FinishReason::kRejected;
  // Alone, a windowed sequence needs its window's W - 1 earlier positions plus
  // the one it writes: at most ceil((W - 1) / block_size) + 1 blocks.
  const int32_t window_blocks =
      config_.sliding_window > 0 ? blocks_for(config_.sliding_window - 1) + 1 : blocks_for(seq.num_tokens());
  if (std::min(blocks_for(seq.num_tokens()), window_blocks) > config_.num_blocks)
    return seq.num_generated() == 0 ? FinishReason::kRejected : FinishReason::kLength;
  return FinishReason::kNone;
}

void Scheduler::finish_now(Sequence& seq, FinishReason reason) {
  seq.finish_reason = reason;
  seq.table.release();
  finished_ids_.push_back(seq.id);
}

void Scheduler::reap() {
  if (finished_ids_.empty()) return;
  auto gone = [](const Sequence* seq) { return seq->finished(); };
  running_.erase(std::remove_if(running_.begin(), running_.end(), gone), running_.end());
  waiting_.erase(std::remove_if(waiting_.begin(), waiting_.end(), gone), waiting_.end());
  for (SeqId id : finished_ids_) sequences_.erase(id);
  finished_ids_.clear();
}

bool Scheduler::finish(SeqId id, FinishReason reason) {
  PS_CHECK(reason != FinishReason::kNone, "finish() needs a reason");
  auto it = sequences_.find(id);
  if (it == sequences_.end() || it->second->finished()) return false;
  finish_now(*it->second, reason);
  reap();
  return true;
}

void Scheduler::build_arrays(StepOutput& out) {
  // Decode-shaped rows (one token) first, so kernels can split the batch.
  std::stable_partition(scheduled_.begin(), scheduled_.end(), [](const auto& row) { return row.second == 1; });
  const auto num_seqs = static_cast<int32_t>(scheduled_.size());
  int32_t num_tokens = 0, max_blocks = 0;
  for (const auto& [seq, count] : scheduled_) {
    num_tokens += count;
    max_blocks = std::max(max_blocks, seq->table.num_blocks());
  }
  out.num_decodes = static_cast<int32_t>(
      std::count_if(scheduled_.begin(), scheduled_.end(), [](const auto& row) { return row.second == 1; }));
  out.num_seqs = num_seqs;
  out.num_tokens = num_tokens;
  out.max_blocks_per_seq = max_blocks;
  out.seq_ids.reserve(static_cast<size_t>(num_seqs));
  out.input_ids.reserve(static_cast<size_t>(num_tokens));
  out.positions.reserve(static_cast<size_t>(num_tokens));
  out.slot_mapping.reserve(static_cast<size_t>(num_tokens));
  out.query_start_loc.reserve(static_cast<size_t>(num_seqs) + 1);
  out.seq_lens.reserve(static_cast<size_t>(num_seqs));
  out.prompt_lens.reserve(static_cast<size_t>(num_seqs));
  out.block_tables.assign(static_cast<size_t>(num_seqs) * static_cast<size_t>(max_blocks), kPadBlock);
  out.query_start_loc.push_back(0);
  int32_t row = 0;
  for (const auto& [seq, count] : scheduled_) {
    const int32_t begin = seq->num_computed_tokens;
    const int32_t end = begin + count;
    out.seq_ids.push_back(seq->id);
    for (int32_t pos = begin; pos < end; ++pos) {
      const TokenId token = seq->tokens[static_cast<size_t>(pos)];
      if (token == kPendingToken) {  // only ever the last token, of an advanced sampling row
        out.deferred_tokens.push_back(static_cast<int32_t>(out.input_ids.size()));
        out.deferred_samples.push_back(seq->awaiting_sample);
      }
      out.input_ids.push_back(token == kPendingToken ? 0 : token);
      out.positions.push_back(pos);
      out.slot_mapping.push_back(seq->table.slot(pos));
    }
    out.query_start_loc.push_back(static_cast<int32_t>(out.input_ids.size()));
    out.seq_lens.push_back(end);
    out.prompt_lens.push_back(seq->num_prompt_tokens);
    const auto blocks = seq->table.blocks();
    std::copy(blocks.begin(), blocks.end(),
              out.block_tables.begin() + static_cast<std::ptrdiff_t>(row) * max_blocks);
    out.max_query_len = std::max(out.max_query_len, count);
    out.max_seq_len = std::max(out.max_seq_len, end);
    if (end == seq->num_tokens()) {
      const int32_t n = seq->forked ? 1 : seq->params.n;
      out.sample_rows.push_back(row);
      out.logits_indices.push_back(out.query_start_loc.back() - 1);
      out.num_samples.push_back(n);
      out.total_samples += n;
    }
    seq->scheduled = false;
    ++row;
  }
  last_step_.step_num_seqs = num_seqs;
  last_step_.step_decode_tokens = out.num_decodes;
  last_step_.step_prefill_tokens = num_tokens - out.num_decodes;
}

const Sequence* Scheduler::find(SeqId id) const {
  auto it = sequences_.find(id);
  return it == sequences_.end() ? nullptr : it->second.get();
}

std::vector<SeqId> Scheduler::running_ids() const {
  std::vector<SeqId> ids;
  for (const Sequence* seq : running_) ids.push_back(seq->id);
  return ids;
}

std::vector<SeqId> Scheduler::waiting_ids() const {
  std::vector<SeqId> ids;
  for (const Sequence* seq : waiting_) ids.push_back(seq->id);
  return ids;
}

SchedulerStats Scheduler::stats() const {
  SchedulerStats s = last_step_;
  s.num_running = num_running();
  s.num_waiting = num_waiting();
  s.num_blocks = pool_.num_blocks();
  s.num_free_blocks = pool_.num_free();
  s.num_evictable_blocks = pool_.num_evictable();
  s.num_used_blocks = pool_.num_used();
  s.pool_utilization = static_cast<double>(s.num_used_blocks) / s.num_blocks;
  for (const Sequence* seq : running_) {
    s.internal_fragmentation_slots += std::max(0, seq->table.capacity() - seq->num_tokens());
  }
  s.blocks_saved_by_sharing = pool_.total_refs() - s.num_used_blocks;
  const PrefixCacheCounters& c = pool_.prefix_counters();
  s.prefix_queried_blocks = c.queried_blocks;
  s.prefix_hit_blocks = c.hit_blocks;
  s.prefix_evictions = c.evictions;
  s.prefix_hit_rate = c.queried_blocks ? static_cast<double>(c.hit_blocks) / static_cast<double>(c.queried_blocks) : 0.0;
  s.num_preemptions = num_preemptions_;
  s.num_preempted_tokens = num_preempted_tokens_;
  return s;
}

}  // namespace pagedserve
