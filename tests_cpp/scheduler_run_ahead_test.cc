// Run-ahead (advance / commit) against plain update(): the same requests end
// with the same tokens and finish reasons, whatever the steps looked like.
//
// The "model" is a token oracle: the token a sequence samples at a position is
// a hash of (the request, which of its n samples, the position), as a real
// model's is a function of the tokens before it. Run-ahead schedules step t+1
// before step t's tokens are known, so its steps differ (a row finished by EOS
// runs once more, blocks come back a step later, preemptions move), but no
// request may gain, lose or change a token, or finish differently.
#include <gtest/gtest.h>

#include <map>
#include <random>

#include "scheduler.h"
#include "scheduler_test_util.h"

namespace pagedserve {
namespace {

using testing::max_tokens;
using testing::prompt_of;
using testing::small_config;

constexpr TokenId kEos = 2;

struct Outcome {
  std::vector<TokenId> tokens;
  FinishReason reason = FinishReason::kNone;
  bool operator==(const Outcome&) const = default;
};

struct Request {
  std::vector<TokenId> prompt;
  StopParams params;
  int32_t arrival_step = 0;
};

// Tags name a request's samples across both runs: request * 8 + sample index.
TokenId oracle(int64_t tag, int32_t position) {
  uint64_t h = static_cast<uint64_t>(tag) * 0x9E3779B97F4A7C15ull ^ static_cast<uint64_t>(position) * 0xC2B2AE3D27D4EB4Full;
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 32;
  return h % 9 == 0 ? kEos : static_cast<TokenId>(3 + h % 20);
}

class Driver {
 public:
  Driver(SchedulerConfig config, bool run_ahead) : scheduler_(config), run_ahead_(run_ahead) {}

  std::map<int64_t, Outcome> run(const std::vector<Request>& requests) {
    size_t next = 0;
    for (int32_t step = 0; next < requests.size() || scheduler_.has_unfinished() || scheduler_.has_advanced(); ++step) {
      EXPECT_LT(step, 100000) << "never drains";
      if (step >= 100000) break;
      for (; next < requests.size() && requests[next].arrival_step <= step; ++next) add(requests[next], next);
      one_step();
    }
    EXPECT_EQ(scheduler_.pool().num_free(), scheduler_.pool().num_blocks()) << "blocks leaked";
    return outcomes_;
  }

  int64_t advanced = 0, dead_rows = 0, preemptions = 0;

 private:
  void add(const Request& r, size_t index) {
    const SeqId id = scheduler_.add_sequence(r.prompt, r.params);
    tags_[id] = static_cast<int64_t>(index) * 8;
    outcomes_[tags_[id]].tokens = r.prompt;
  }

  std::vector<TokenId> sample(const StepOutput& out) {
    std::vector<TokenId> sampled;
    for (size_t r = 0; r < out.sample_rows.size(); ++r) {
      const SeqId id = out.seq_ids[static_cast<size_t>(out.sample_rows[r])];
      const int32_t position = out.seq_lens[static_cast<size_t>(out.sample_rows[r])];
      const int64_t tag = tags_.at(id);  // sample j of a forking prompt is its child of tag + j
      for (int32_t j = 0; j < out.num_samples[r]; ++j) sampled.push_back(oracle(tag + j, position));
    }
    return sampled;
  }

  void one_step() {
    auto out = scheduler_.schedule();
    preemptions += static_cast<int64_t>(out->preempted.size());
    for (const FinishedSeq& f : out->rejected) outcomes_[tags_.at(f.id)].reason = f.reason;
    if (advanced_) {  // on the device, the last step's tokens exist before this one's forward
      apply(*advanced_, advanced_sampled_, scheduler_.commit(advanced_sampled_));
      advanced_.reset();
    }
    const std::vector<TokenId> sampled = sample(*out);
    if (run_ahead_ && out->num_seqs > 0 && out->total_samples == static_cast<int32_t>(out->sample_rows.size())) {
      scheduler_.advance();
      advanced_ = out;
      advanced_sampled_ = sampled;
      ++advanced;
    } else {
      apply(*out, sampled, scheduler_.update(sampled));
    }
  }

  void apply(const StepOutput& out, const std::vector<TokenId>& sampled, const UpdateResult& result) {
    std::map<SeqId, std::vector<ForkedSeq>> forks;
    for (const ForkedSeq& f : result.forks) forks[f.parent].push_back(f);
    size_t first = 0;
    for (size_t r = 0; r < out.sample_rows.size(); ++r) {
      const SeqId id = out.seq_ids[static_cast<size_t>(out.sample_rows[r])];
      const size_t n = static_cast<size_t>(out.num_samples[r]);
      const size_t k = first;
      first += n;
      Outcome& o = outcomes_.at(tags_.at(id));
      if (o.reason != FinishReason::kNone) {  // finished after this step was scheduled: nobody gets its token
        ++dead_rows;
        continue;
      }
      ASSERT_EQ(forks[id].size(), n - 1);
      for (const ForkedSeq& f : forks[id]) {
        tags_[f.child] = tags_.at(id) + f.sample_index;
        Outcome& child = outcomes_[tags_[f.child]];
        child.tokens = o.tokens;
        child.tokens.push_back(sampled[k + static_cast<size_t>(f.sample_index)]);
      }
      o.tokens.push_back(sampled[k]);
    }
    for (const FinishedSeq& f : result.finished) outcomes_.at(tags_.at(f.id)).reason = f.reason;
    for (const auto& [id, tag] : tags_) {  // the scheduler holds the same tokens, no placeholder left
      if (const Sequence* seq = scheduler_.find(id)) {
        EXPECT_EQ(seq->tokens, outcomes_.at(tag).tokens) << "tag " << tag;
      }
    }
  }

  Scheduler scheduler_;
  bool run_ahead_;
  std::map<SeqId, int64_t> tags_;
  std::map<int64_t, Outcome> outcomes_;
  std::shared_ptr<const StepOutput> advanced_;
  std::vector<TokenId> advanced_sampled_;
};

std::vector<Request> random_requests(std::mt19937_64& rng, int count) {
  auto pick = [&rng](int32_t lo, int32_t hi) { return std::uniform_int_distribution<int32_t>(lo, hi)(rng); };
  std::vector<Request> requests;
  int32_t arrival = 0;
  for (int i = 0; i < count; ++i) {
    Request r;
    r.prompt = prompt_of(pick(1, 40), static_cast<TokenId>(pick(0, 3) == 0 ? 100 : 100 + 50 * i));  // shared prefixes
    r.params = max_tokens(pick(1, 40));
    r.params.min_tokens = pick(0, 3) == 0 ? pick(0, r.params.max_tokens) : 0;
    r.params.ignore_eos = pick(0, 4) == 0;
    if (pick(0, 3) == 0) r.params.stop_token_ids = {static_cast<TokenId>(pick(3, 22))};
    r.params.n = pick(0, 5) == 0 ? 2 : 1;
    arrival += pick(0, 3);
    r.arrival_step = arrival;
    requests.push_back(std::move(r));
  }
  return requests;
}

TEST(SchedulerRunAhead, SameTokensAndFinishesAsUpdate) {
  std::mt19937_64 rng(11);
  int64_t advanced = 0, dead_rows = 0, preemptions = 0;
  for (int scenario = 0; scenario < 40; ++scenario) {
    SCOPED_TRACE("scenario " + std::to_string(scenario));
    SchedulerConfig config = small_config(/*num_blocks=*/std::uniform_int_distribution<int32_t>(24, 80)(rng));
    config.max_model_len = 72;
    config.max_num_batched_tokens = 24;
    const std::vector<Request> requests = random_requests(rng, 30);
    const auto plain = Driver(config, /*run_ahead=*/false).run(requests);
    Driver ahead(config, /*run_ahead=*/true);
    const auto run_ahead = ahead.run(requests);
    ASSERT_EQ(plain.size(), run_ahead.size());
    for (const auto& [tag, outcome] : plain) {
      ASSERT_NE(outcome.reason, FinishReason::kNone) << "tag " << tag;
      ASSERT_TRUE(run_ahead.at(tag) == outcome) << "tag " << tag << ": " << run_ahead.at(tag).tokens.size()
                                                << " tokens against " << outcome.tokens.size();
    }
    advanced += ahead.advanced;
    dead_rows += ahead.dead_rows;
    preemptions += ahead.preemptions;
  }
  std::printf("advanced steps %lld, rows run after their sequence finished %lld, preemptions %lld\n",
              static_cast<long long>(advanced), static_cast<long long>(dead_rows),
              static_cast<long long>(preemptions));
  EXPECT_GT(advanced, 1000);
  EXPECT_GT(dead_rows, 100);
  EXPECT_GT(preemptions, 20);
}

TEST(SchedulerRunAhead, ARowThatReachesMaxTokensIsNotScheduledAgain) {
  Scheduler s(small_config(16));
  const SeqId id = s.add_sequence(prompt_of(3), max_tokens(2));
  auto first = s.schedule();  // prefill, samples token 1
  s.advance();
  auto second = s.schedule();  // decodes the placeholder, samples token 2
  ASSERT_EQ(second->num_seqs, 1);
  ASSERT_EQ(second->deferred_tokens.size(), 1u);
  EXPECT_EQ(second->input_ids[0], 0);
  EXPECT_EQ(second->deferred_samples[0], 0);
  EXPECT_TRUE(s.commit(std::vector<TokenId>{7}).finished.empty());
  s.advance();
  auto third = s.schedule();  // token 2 ends it by length: nothing to run
  EXPECT_EQ(third->num_seqs, 0);
  const UpdateResult last = s.commit(std::vector<TokenId>{8});
  ASSERT_EQ(last.finished.size(), 1u);
  EXPECT_EQ(last.finished[0].id, id);
  EXPECT_EQ(last.finished[0].reason, FinishReason::kLength);
  EXPECT_NO_THROW(s.update({}));
  EXPECT_FALSE(s.has_unfinished());
  EXPECT_EQ(s.pool().num_free(), 16);
}

TEST(SchedulerRunAhead, CallsOutOfOrderThrow) {
  Scheduler s(small_config(16));
  s.add_sequence(prompt_of(3), max_tokens(4));
  EXPECT_THROW(s.advance(), std::logic_error);
  EXPECT_THROW(s.commit({}), std::logic_error);
  s.schedule();
  s.advance();
  EXPECT_THROW(s.advance(), std::logic_error);
  s.schedule();
  EXPECT_THROW(s.update(std::vector<TokenId>{7}), std::logic_error);  // the advanced step commits first
  EXPECT_THROW(s.commit({}), std::invalid_argument);                  // one token expected
  EXPECT_TRUE(s.has_advanced());
  EXPECT_NO_THROW(s.commit(std::vector<TokenId>{7}));
  EXPECT_NO_THROW(s.update(std::vector<TokenId>{8}));
  const SeqId forking = s.add_sequence(prompt_of(3, 200), [] { StopParams p = max_tokens(4); p.n = 2; return p; }());
  (void)forking;
  auto out = s.schedule();
  ASSERT_GT(out->total_samples, static_cast<int32_t>(out->sample_rows.size()));
  EXPECT_THROW(s.advance(), std::logic_error);  // a fork happens in update() only
}

}  // namespace
}  // namespace pagedserve
