// Scheduler, after the forward: the sampled tokens onto their sequences
// (update(), or advance() then commit() when the engine runs ahead), forks of
// n > 1 prompts, and every stopping rule. scheduler.cc builds the steps.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "check.h"
#include "scheduler.h"

namespace pagedserve {
namespace {

void check_sample_count(const StepOutput& step, std::span<const TokenId> sampled, const char* what) {
  if (sampled.size() != static_cast<size_t>(step.total_samples)) {
    throw std::invalid_argument(std::string(what) + " got " + std::to_string(sampled.size()) +
                                " sampled tokens, the step has " + std::to_string(step.total_samples));
  }
}

}  // namespace

Sequence* Scheduler::live(SeqId id) {
  auto it = sequences_.find(id);
  return it == sequences_.end() || it->second->finished() ? nullptr : it->second.get();
}

void Scheduler::mark_computed(const StepOutput& step) {
  for (int32_t s = 0; s < step.num_seqs; ++s) {
    Sequence* seq = live(step.seq_ids[static_cast<size_t>(s)]);
    if (!seq) continue;  // aborted since schedule()
    seq->num_computed_tokens = step.seq_lens[static_cast<size_t>(s)];
    seq->table.register_full_blocks(seq->tokens, seq->num_computed_tokens);
    // Blocks wholly before the next query's window are never read again.
    if (config_.sliding_window > 0) seq->table.drop_blocks_before(window_start(seq->num_computed_tokens));
  }
}

UpdateResult Scheduler::update(std::span<const TokenId> sampled) {
  if (!in_flight_) throw std::logic_error("update() called without a scheduled step");
  if (advanced_) throw std::logic_error("update() called before commit() of the advanced step");
  check_sample_count(*in_flight_, sampled, "update()");  // throws before anything changes: the caller may retry
  const std::shared_ptr<StepOutput> step = std::move(in_flight_);
  mark_computed(*step);
  UpdateResult result;
  size_t offset = 0;
  for (size_t r = 0; r < step->sample_rows.size(); ++r) {
    const auto n = static_cast<size_t>(step->num_samples[r]);
    const auto samples = sampled.subspan(offset, n);
    offset += n;
    Sequence* seq = live(step->seq_ids[static_cast<size_t>(step->sample_rows[r])]);
    if (!seq) continue;
    if (!seq->forked) fork_children(*seq, samples, result);
    append_token(*seq, samples[0], result);
  }
  reap();
  return result;
}

void Scheduler::advance() {
  if (!in_flight_) throw std::logic_error("advance() called without a scheduled step");
  if (advanced_) throw std::logic_error("advance() called before commit() of the previous advanced step");
  if (static_cast<size_t>(in_flight_->total_samples) != in_flight_->sample_rows.size()) {
    throw std::logic_error("advance(): a prompt of this step forks into n > 1 samples; call update()");
  }
  advanced_ = std::move(in_flight_);
  const StepOutput& step = *advanced_;
  mark_computed(step);
  for (size_t r = 0; r < step.sample_rows.size(); ++r) {
    Sequence* seq = live(step.seq_ids[static_cast<size_t>(step.sample_rows[r])]);
    if (!seq) continue;
    seq->tokens.push_back(kPendingToken);
    seq->awaiting_sample = static_cast<int32_t>(r);
  }
}

UpdateResult Scheduler::commit(std::span<const TokenId> sampled) {
  if (!advanced_) throw std::logic_error("commit() called without an advanced step");
  check_sample_count(*advanced_, sampled, "commit()");
  const std::shared_ptr<StepOutput> step = std::move(advanced_);
  UpdateResult result;
  for (size_t r = 0; r < step->sample_rows.size(); ++r) {
    Sequence* seq = live(step->seq_ids[static_cast<size_t>(step->sample_rows[r])]);
    if (!seq) continue;  // aborted, or stopped by a stop string, since advance()
    const auto position = static_cast<size_t>(step->seq_lens[static_cast<size_t>(step->sample_rows[r])]);
    PS_CHECK(position + 1 == seq->tokens.size() && seq->tokens[position] == kPendingToken &&
                 seq->awaiting_sample == static_cast<int32_t>(r),
             "commit(): the sequence's last token is not this step's placeholder");
    seq->tokens[position] = sampled[r];
    seq->awaiting_sample = -1;
    check_stop(*seq, sampled[r], result);
  }
  reap();
  return result;
}

void Scheduler::fork_children(Sequence& parent, std::span<const TokenId> samples, UpdateResult& result) {
  parent.forked = true;
  for (size_t i = 1; i < samples.size(); ++i) {
    StopParams params = parent.params;
    params.n = 1;
    const SeqId id = next_id_++;
    auto child = std::make_unique<Sequence>(id, parent.tokens, std::move(params), pool_);
    child->num_prompt_tokens = parent.num_prompt_tokens;
    child->num_computed_tokens = parent.num_computed_tokens;
    child->table = parent.table.fork();
    child->forked = true;
    child->status = SeqStatus::kRunning;
    child->admit_order = ++next_admit_order_;
    running_.push_back(child.get());
    Sequence& ref = *child;
    sequences_.emplace(id, std::move(child));
    result.forks.push_back({parent.id, id, static_cast<int32_t>(i)});
    append_token(ref, samples[i], result);
  }
}

void Scheduler::append_token(Sequence& seq, TokenId token, UpdateResult& result) {
  seq.tokens.push_back(token);
  check_stop(seq, token, result);
}

bool Scheduler::at_length_limit(const Sequence& seq) const {
  return seq.num_generated() >= seq.params.max_tokens || seq.num_tokens() >= config_.max_model_len;
}

void Scheduler::check_stop(Sequence& seq, TokenId token, UpdateResult& result) {
  const StopParams& p = seq.params;
  FinishReason reason = FinishReason::kNone;
  TokenId stop_token = -1;
  if (seq.num_generated() >= p.min_tokens) {
    const auto& eos = config_.eos_token_ids;
    const bool is_eos = !p.ignore_eos && std::find(eos.begin(), eos.end(), token) != eos.end();
    const bool is_stop = std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), token) != p.stop_token_ids.end();
    if (is_eos || is_stop) {
      reason = FinishReason::kStop;
      stop_token = token;
    }
  }
  if (reason == FinishReason::kNone && at_length_limit(seq)) reason = FinishReason::kLength;
  if (reason == FinishReason::kNone) return;
  finish_now(seq, reason);
  result.finished.push_back({seq.id, reason, stop_token});
}

}  // namespace pagedserve
