// Randomized property test: the scheduler and its block pool against a plain
// model of what they must do.
//
// A simulated runner keeps a shadow KV cache (what token each slot holds) and
// applies every step the way the GPU would: block copies, then writes through
// the slot mapping. After every step it checks that each scheduled sequence
// reads back exactly its own tokens through its block table — the property
// paged attention relies on, across prefix hits, forks, copy-on-write and
// preemption. After every operation it checks the block accounting: each
// block's refcount equals the number of tables holding it, nothing leaked or
// double-freed, and the pool is all free once every sequence is gone.
// With a sliding window, rows read only their first query's window, and a
// running sequence holds no block wholly before its next query's window.
// Run-ahead (advance / commit): the next step is scheduled before the last
// one's tokens are committed; its forward runs after the commit, as on the
// device, with the deferred inputs taken from those tokens.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <initializer_list>
#include <map>
#include <random>
#include <set>
#include <utility>

#include "scheduler.h"

namespace pagedserve {
namespace {

constexpr TokenId kEos = 2;
constexpr int64_t kEmptySlot = -1;

// How often each interesting event happened: the test asserts they all did,
// so a change that makes the random driver vacuous fails.
struct Coverage {
  int64_t steps = 0, tokens = 0, preemptions = 0, copies = 0, prefix_hit_blocks = 0, rejected = 0, forks = 0,
          in_flight_aborts = 0, finished = 0, dropped_blocks = 0, longer_than_pool = 0, advanced = 0,
          deferred_inputs = 0, dead_rows = 0;
};

struct ModelSeq {
  std::vector<TokenId> tokens;
  int32_t num_prompt = 0;
  StopParams params;
};

class PropertyHarness {
 public:
  PropertyHarness(std::mt19937_64& rng, Coverage& coverage, bool sliding_window = false, bool run_ahead = false)
      : rng_(rng), coverage_(coverage), run_ahead_(run_ahead) {
    config_.num_blocks = pick(4, 40);
    config_.block_size = std::vector<int32_t>{1, 2, 4, 8}[static_cast<size_t>(pick(0, 3))];
    config_.max_num_seqs = pick(1, 8);
    config_.max_num_batched_tokens = config_.max_num_seqs + pick(0, 24);
    config_.max_model_len = pick(8, 64);
    config_.enable_prefix_caching = pick(0, 3) != 0;
    config_.watermark = pick(0, 1) ? 0.0 : 0.1;
    config_.eos_token_ids = {kEos};
    if (sliding_window) config_.sliding_window = pick(1, 12);
    scheduler_ = std::make_unique<Scheduler>(config_);
    kv_.assign(static_cast<size_t>(config_.num_blocks * config_.block_size), kEmptySlot);
    for (int i = 0; i < 3; ++i) bases_.push_back(random_tokens(pick(1, 20)));
  }

  ~PropertyHarness() { coverage_.prefix_hit_blocks += scheduler_->pool().prefix_counters().hit_blocks; }

  void run(int operations) {
    for (int op = 0; op < operations; ++op) {
      const int dice = pick(0, 99);
      if (dice < 30) {
        add();
      } else if (dice < 85) {
        step();
      } else if (dice < 93) {
        finish_random(FinishReason::kAbort);
      } else {
        finish_random(FinishReason::kStop);
      }
      check_accounting();
    }
    drain();
  }

 private:
  int32_t pick(int32_t lo, int32_t hi) { return std::uniform_int_distribution<int32_t>(lo, hi)(rng_); }

  std::vector<TokenId> random_tokens(int32_t n) {
    std::vector<TokenId> t(static_cast<size_t>(n));
    for (auto& x : t) x = pick(3, 8);  // tiny vocabulary: many shared prefixes
    return t;
  }

  void add() {
    std::vector<TokenId> prompt = bases_[static_cast<size_t>(pick(0, 2))];
    const auto suffix = random_tokens(pick(0, 12));
    prompt.insert(prompt.end(), suffix.begin(), suffix.end());
    if (prompt.empty()) prompt.push_back(3);
    StopParams p;
    p.max_tokens = pick(1, 24);
    p.min_tokens = pick(0, 2) == 0 ? pick(0, p.max_tokens) : 0;
    p.ignore_eos = pick(0, 4) == 0;
    if (pick(0, 3) == 0) p.stop_token_ids = {pick(3, 8)};
    p.n = pick(0, 4) == 0 ? pick(2, 3) : 1;
    const SeqId id = scheduler_->add_sequence(prompt, p);
    model_[id] = ModelSeq{prompt, static_cast<int32_t>(prompt.size()), p};
  }

  void finish_random(FinishReason reason) {
    if (model_.empty()) return;
    auto it = std::next(model_.begin(), pick(0, static_cast<int32_t>(model_.size()) - 1));
    ASSERT_TRUE(scheduler_->finish(it->first, reason));
    model_.erase(it);
  }

  void step() {
    const bool idle_with_waiting = scheduler_->num_running() == 0 && scheduler_->num_waiting() > 0;
    auto out = scheduler_->schedule();
    for (const FinishedSeq& r : out->rejected) {
      ASSERT_TRUE(model_.count(r.id));
      model_.erase(r.id);
    }
    if (idle_with_waiting) {
      ASSERT_TRUE(out->num_seqs > 0 || !out->rejected.empty()) << "waiting requests with nothing running: stall";
    }
    // On the device the last step's tokens exist before this forward reads them.
    const std::vector<TokenId> last_sampled = advanced_sampled_;
    commit_advanced();
    if (::testing::Test::HasFatalFailure()) return;
    std::vector<TokenId> input_ids = out->input_ids;
    ASSERT_EQ(out->deferred_tokens.size(), out->deferred_samples.size());
    for (size_t i = 0; i < out->deferred_tokens.size(); ++i) {
      const auto token = static_cast<size_t>(out->deferred_tokens[i]);
      ASSERT_EQ(input_ids[token], 0);
      input_ids[token] = last_sampled.at(static_cast<size_t>(out->deferred_samples[i]));
      ++coverage_.deferred_inputs;
    }
    simulate_forward(*out, input_ids);
    ++coverage_.steps;
    coverage_.tokens += out->num_tokens;
    coverage_.preemptions += static_cast<int64_t>(out->preempted.size());
    coverage_.copies += static_cast<int64_t>(out->block_copies.size());
    coverage_.rejected += static_cast<int64_t>(out->rejected.size());
    if (pick(0, 9) == 0 && out->num_seqs > 0) {  // abort a row while its step is in flight
      const SeqId victim = out->seq_ids[static_cast<size_t>(pick(0, out->num_seqs - 1))];
      if (model_.count(victim)) {
        ASSERT_TRUE(scheduler_->abort(victim));
        model_.erase(victim);
        ++coverage_.in_flight_aborts;
      }
    }
    std::vector<TokenId> sampled(static_cast<size_t>(out->total_samples));
    for (auto& t : sampled) t = pick(0, 5) == 0 ? kEos : pick(3, 8);
    if (run_ahead_ && out->total_samples == static_cast<int32_t>(out->sample_rows.size()) && pick(0, 3) != 0) {
      scheduler_->advance();  // the next schedule() comes before these tokens are committed
      advanced_ = out;
      advanced_sampled_ = sampled;
      ++coverage_.advanced;
      return;
    }
    const UpdateResult result = scheduler_->update(sampled);
    coverage_.forks += static_cast<int64_t>(result.forks.size());
    coverage_.finished += static_cast<int64_t>(result.finished.size());
    apply_to_model(*out, sampled, result);
  }

  void commit_advanced() {
    if (!advanced_) return;
    const auto step = std::move(advanced_);
    const UpdateResult result = scheduler_->commit(advanced_sampled_);
    ASSERT_TRUE(result.forks.empty());
    coverage_.finished += static_cast<int64_t>(result.finished.size());
    apply_to_model(*step, advanced_sampled_, result);
    advanced_sampled_.clear();
  }

  // What the runner does: copies, then writes, then every row reads its context.
  void simulate_forward(const StepOutput& out, const std::vector<TokenId>& input_ids) {
    std::set<BlockId> copy_dsts, copy_srcs;
    for (const BlockCopy& c : out.block_copies) {
      ASSERT_TRUE(copy_dsts.insert(c.dst).second) << "two copies into block " << c.dst;
      copy_srcs.insert(c.src);
    }
    for (BlockId d : copy_dsts) ASSERT_FALSE(copy_srcs.count(d)) << "block " << d << " both copied from and into";
    const auto bs = static_cast<size_t>(config_.block_size);
    for (const BlockCopy& c : out.block_copies) {
      std::copy_n(kv_.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(c.src) * bs), bs,
                  kv_.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(c.dst) * bs));
    }
    std::set<int32_t> written;
    for (int32_t i = 0; i < out.num_tokens; ++i) {
      const int32_t slot = out.slot_mapping[static_cast<size_t>(i)];
      ASSERT_TRUE(written.insert(slot).second) << "two tokens write slot " << slot;
      kv_[static_cast<size_t>(slot)] = encode(out.positions[static_cast<size_t>(i)], input_ids[static_cast<size_t>(i)]);
    }
    for (int32_t r = 0; r < out.num_seqs; ++r) {
      const auto it = model_.find(out.seq_ids[static_cast<size_t>(r)]);
      const int32_t begin = out.query_start_loc[static_cast<size_t>(r)];
      const int32_t end = out.query_start_loc[static_cast<size_t>(r) + 1];
      for (int32_t i = begin; i < end; ++i) {
        // Its own block; or, for a row whose sequence commit() finished after schedule(), a released
        // block nobody can take before this forward has run (the next schedule() comes after it).
        const int32_t refs = scheduler_->pool().refcount(out.slot_mapping[static_cast<size_t>(i)] / config_.block_size);
        ASSERT_EQ(refs, it == model_.end() ? 0 : 1) << "write into a shared or foreign block";
      }
      if (it == model_.end()) {
        ++coverage_.dead_rows;
        continue;
      }
      const ModelSeq& seq = it->second;
      const int32_t seq_len = out.seq_lens[static_cast<size_t>(r)];
      ASSERT_LE(seq_len, static_cast<int32_t>(seq.tokens.size()));
      ASSERT_EQ(r < out.num_decodes, end - begin == 1);
      for (int32_t i = begin; i < end; ++i) {
        ASSERT_EQ(out.positions[static_cast<size_t>(i)], seq_len - (end - i));
        ASSERT_EQ(input_ids[static_cast<size_t>(i)], seq.tokens[static_cast<size_t>(out.positions[static_cast<size_t>(i)])]);
      }
      // What paged attention reads: from the first query's window start on.
      for (int32_t pos = window_start(seq_len - (end - begin)); pos < seq_len; ++pos) {
        const BlockId block =
            out.block_tables[static_cast<size_t>(r * out.max_blocks_per_seq + pos / config_.block_size)];
        const auto slot = static_cast<size_t>(block * config_.block_size + pos % config_.block_size);
        ASSERT_EQ(kv_[slot], encode(pos, seq.tokens[static_cast<size_t>(pos)]))
            << "row " << r << " reads the wrong KV at position " << pos;
      }
    }
    ASSERT_LE(out.num_tokens, config_.max_num_batched_tokens);
  }

  int32_t window_start(int32_t position) const {
    return config_.sliding_window > 0 ? std::max(0, position - config_.sliding_window + 1) : 0;
  }

  static int64_t encode(int32_t pos, TokenId token) { return static_cast<int64_t>(pos) * 1000 + token; }

  void apply_to_model(const StepOutput& out, const std::vector<TokenId>& sampled, const UpdateResult& result) {
    std::map<SeqId, FinishReason> finished;
    for (const FinishedSeq& f : result.finished) finished[f.id] = f.reason;
    std::map<SeqId, std::vector<ForkedSeq>> forks;
    for (const ForkedSeq& f : result.forks) forks[f.parent].push_back(f);
    size_t offset = 0;
    for (size_t r = 0; r < out.sample_rows.size(); ++r) {
      const auto n = static_cast<size_t>(out.num_samples[r]);
      const SeqId id = out.seq_ids[static_cast<size_t>(out.sample_rows[r])];
      const size_t first = offset;
      offset += n;
      if (!model_.count(id)) continue;  // aborted in flight
      ModelSeq parent = model_[id];
      ASSERT_EQ(forks[id].size(), n - 1);
      for (const ForkedSeq& f : forks[id]) {
        ModelSeq child = parent;
        child.params.n = 1;
        child.tokens.push_back(sampled[first + static_cast<size_t>(f.sample_index)]);
        model_[f.child] = child;
        expect_finish(f.child, finished);
      }
      model_[id].tokens.push_back(sampled[first]);
      expect_finish(id, finished);
    }
    for (const auto& [id, reason] : finished) ASSERT_FALSE(model_.count(id)) << "unexpected finish of " << id;
    for (const auto& [id, seq] : model_) {
      const Sequence* real = scheduler_->find(id);
      ASSERT_NE(real, nullptr) << "sequence " << id << " lost";
      ASSERT_EQ(real->tokens, seq.tokens);
    }
  }

  void expect_finish(SeqId id, std::map<SeqId, FinishReason>& finished) {
    const ModelSeq& seq = model_.at(id);
    const TokenId last = seq.tokens.back();
    const auto generated = static_cast<int32_t>(seq.tokens.size()) - seq.num_prompt;
    FinishReason want = FinishReason::kNone;
    const bool stop = std::count(seq.params.stop_token_ids.begin(), seq.params.stop_token_ids.end(), last) > 0;
    if (generated >= seq.params.min_tokens && ((last == kEos && !seq.params.ignore_eos) || stop)) {
      want = FinishReason::kStop;
    } else if (generated >= seq.params.max_tokens || static_cast<int32_t>(seq.tokens.size()) >= config_.max_model_len) {
      want = FinishReason::kLength;
    }
    auto it = finished.find(id);
    const FinishReason got = it == finished.end() ? FinishReason::kNone : it->second;
    ASSERT_EQ(got, want) << "sequence " << id;
    if (got != FinishReason::kNone) {
      finished.erase(it);
      model_.erase(id);
    }
  }

  void check_accounting() {
    const BlockPool& pool = scheduler_->pool();
    ASSERT_NO_THROW(pool.check_invariants());
    std::vector<int32_t> holders(static_cast<size_t>(config_.num_blocks), 0);
    int32_t live = 0;
    for (const auto& ids : {scheduler_->running_ids(), scheduler_->waiting_ids()}) {
      for (SeqId id : ids) {
        ++live;
        const Sequence* seq = scheduler_->find(id);
        ASSERT_NE(seq, nullptr);
        if (seq->status == SeqStatus::kWaiting) {
          ASSERT_EQ(seq->table.num_blocks(), 0) << "waiting with blocks";
        }
        const auto blocks = seq->table.blocks();
        // Blocks wholly before the next query's window are back in the pool, the rest held.
        const int32_t first_live = seq->status == SeqStatus::kRunning
                                       ? window_start(seq->num_computed_tokens) / config_.block_size
                                       : 0;
        for (int32_t i = 0; i < static_cast<int32_t>(blocks.size()); ++i) {
          const BlockId b = blocks[static_cast<size_t>(i)];
          ASSERT_EQ(b == kDroppedBlock, i < first_live) << "sequence " << id << " block index " << i;
          if (b != kDroppedBlock) ++holders[static_cast<size_t>(b)];
        }
        coverage_.dropped_blocks += first_live;
        coverage_.longer_than_pool += seq->num_computed_tokens > config_.num_blocks * config_.block_size;
      }
    }
    ASSERT_EQ(live, static_cast<int32_t>(model_.size()));
    for (BlockId b = 0; b < config_.num_blocks; ++b) {
      ASSERT_EQ(pool.refcount(b), holders[static_cast<size_t>(b)]) << "block " << b;
    }
  }

  void drain() {
    for (int guard = 0; scheduler_->has_unfinished(); ++guard) {
      ASSERT_LT(guard, 100000) << "scheduler never drains";
      step();
      check_accounting();
    }
    commit_advanced();  // a step whose every row was aborted
    ASSERT_FALSE(scheduler_->has_advanced());
    ASSERT_EQ(scheduler_->pool().num_free(), config_.num_blocks) << "blocks leaked";
    ASSERT_EQ(scheduler_->pool().total_refs(), 0);
  }

  std::mt19937_64& rng_;
  Coverage& coverage_;
  bool run_ahead_;
  std::shared_ptr<const StepOutput> advanced_;  // advance()d, committed at the next step
  std::vector<TokenId> advanced_sampled_;
  SchedulerConfig config_;
  std::unique_ptr<Scheduler> scheduler_;
  std::vector<int64_t> kv_;
  std::vector<std::vector<TokenId>> bases_;
  std::map<SeqId, ModelSeq> model_;
};

// Runs `scenarios` harnesses of 1000 random operations each, from one seed; options(scenario) gives
// {sliding_window, run_ahead}. Stops at the first fatal failure.
template <typename Options>
void run_scenarios(uint64_t seed, int scenarios, Coverage& coverage, Options options) {
  std::mt19937_64 rng(seed);
  for (int scenario = 0; scenario < scenarios; ++scenario) {
    SCOPED_TRACE("scenario " + std::to_string(scenario));
    {
      const auto [sliding_window, run_ahead] = options(scenario);
      PropertyHarness harness(rng, coverage, sliding_window, run_ahead);
      harness.run(1000);
    }
    if (::testing::Test::HasFatalFailure()) return;
  }
}

// A coverage counter the driver must have moved past `more_than`, so that a change that makes the random
// driver vacuous fails; every counter is printed.
struct Floor {
  const char* name;
  int64_t Coverage::*counter;
  int64_t more_than;
};

void expect_coverage(const Coverage& coverage, std::initializer_list<Floor> floors) {
  for (const Floor& f : floors) {
    std::printf("%s %lld\n", f.name, static_cast<long long>(coverage.*f.counter));
    EXPECT_GT(coverage.*f.counter, f.more_than) << f.name;
  }
}

TEST(SchedulerProperty, SlidingWindowKeepsEveryInvariant) {
  Coverage coverage;
  run_scenarios(7, 40, coverage, [](int) { return std::pair{true, false}; });
  if (::testing::Test::HasFatalFailure()) return;
  expect_coverage(coverage, {{"preemptions", &Coverage::preemptions, 100},
                             {"prefix hit blocks", &Coverage::prefix_hit_blocks, 100},
                             {"dropped block entries", &Coverage::dropped_blocks, 1000},
                             {"checks of sequences longer than the pool", &Coverage::longer_than_pool, 10},
                             {"forks", &Coverage::forks, 100}});
}

TEST(SchedulerProperty, HundredThousandRandomOperationsKeepEveryInvariant) {
  Coverage coverage;
  run_scenarios(20261122, 100, coverage, [](int) { return std::pair{false, false}; });
  if (::testing::Test::HasFatalFailure()) return;
  expect_coverage(coverage, {{"steps", &Coverage::steps, 0},
                             {"tokens", &Coverage::tokens, 0},
                             {"preemptions", &Coverage::preemptions, 500},
                             {"block copies", &Coverage::copies, 500},
                             {"prefix hit blocks", &Coverage::prefix_hit_blocks, 500},
                             {"rejected", &Coverage::rejected, 50},
                             {"forks", &Coverage::forks, 500},
                             {"in-flight aborts", &Coverage::in_flight_aborts, 500},
                             {"finished", &Coverage::finished, 5000}});
}

TEST(SchedulerProperty, RunAheadKeepsEveryInvariant) {
  Coverage coverage;
  run_scenarios(20261128, 60, coverage, [](int scenario) { return std::pair{scenario % 3 == 0, true}; });
  if (::testing::Test::HasFatalFailure()) return;
  expect_coverage(coverage, {{"advanced steps", &Coverage::advanced, 5000},
                             {"deferred inputs", &Coverage::deferred_inputs, 5000},
                             {"rows whose sequence finished before their forward", &Coverage::dead_rows, 500},
                             {"preemptions", &Coverage::preemptions, 100},
                             {"forks", &Coverage::forks, 100},
                             {"in-flight aborts", &Coverage::in_flight_aborts, 100}});
}

}  // namespace
}  // namespace pagedserve
