#include "scheduler.h"

#include <gtest/gtest.h>

#include <algorithm>

#include "scheduler_test_util.h"

namespace pagedserve {
namespace {

using testing::max_tokens;
using testing::prompt_of;
using testing::q_len;
using testing::row_of;
using testing::small_config;
using testing::step;

TEST(Scheduler, RejectsBadConfigAndBadRequests) {
  SchedulerConfig c = small_config(8);
  c.max_num_batched_tokens = 4;  // fewer than max_num_seqs
  EXPECT_THROW(Scheduler{c}, std::invalid_argument);
  Scheduler s(small_config(8));
  EXPECT_THROW(s.add_sequence({}, max_tokens(1)), std::invalid_argument);
  EXPECT_THROW(s.add_sequence(prompt_of(3), max_tokens(0)), std::invalid_argument);
  StopParams p;
  p.n = 0;
  EXPECT_THROW(s.add_sequence(prompt_of(3), p), std::invalid_argument);
  EXPECT_THROW(s.update({}), std::logic_error) << "update() without schedule()";
}

TEST(Scheduler, StepArraysDescribeTheBatch) {
  Scheduler s(small_config(16));
  const SeqId a = s.add_sequence(prompt_of(5), max_tokens(4));
  const SeqId b = s.add_sequence(prompt_of(3, 200), max_tokens(4));
  auto out = s.schedule();
  ASSERT_EQ(out->num_seqs, 2);
  EXPECT_EQ(out->num_tokens, 8);
  EXPECT_EQ(out->num_decodes, 0);
  EXPECT_EQ(out->seq_ids, (std::vector<SeqId>{a, b}));
  EXPECT_EQ(out->query_start_loc, (std::vector<int32_t>{0, 5, 8}));
  EXPECT_EQ(out->seq_lens, (std::vector<int32_t>{5, 3}));
  EXPECT_EQ(out->positions, (std::vector<int32_t>{0, 1, 2, 3, 4, 0, 1, 2}));
  EXPECT_EQ(out->input_ids, (std::vector<int32_t>{100, 101, 102, 103, 104, 200, 201, 202}));
  EXPECT_EQ(out->max_blocks_per_seq, 2);
  for (int32_t r = 0; r < 2; ++r) {
    for (int32_t i = out->query_start_loc[static_cast<size_t>(r)]; i < out->query_start_loc[static_cast<size_t>(r) + 1]; ++i) {
      const int32_t pos = out->positions[static_cast<size_t>(i)];
      const BlockId block = out->block_tables[static_cast<size_t>(r * out->max_blocks_per_seq + pos / 4)];
      EXPECT_EQ(out->slot_mapping[static_cast<size_t>(i)], block * 4 + pos % 4);
    }
  }
  EXPECT_EQ(out->block_tables[3], kPadBlock) << "b needs one block: its row is padded";
  EXPECT_EQ(out->sample_rows, (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(out->logits_indices, (std::vector<int32_t>{4, 7}));
  EXPECT_EQ(out->total_samples, 2);
  s.update(std::vector<TokenId>{50, 60});
  auto next = s.schedule();
  EXPECT_EQ(next->num_decodes, 2);
  EXPECT_EQ(next->input_ids, (std::vector<int32_t>{50, 60}));
  EXPECT_EQ(next->positions, (std::vector<int32_t>{5, 3}));
  EXPECT_EQ(next->seq_lens, (std::vector<int32_t>{6, 4}));
}

TEST(Scheduler, AdmitsFcfsUnderMaxNumSeqs) {
  SchedulerConfig c = small_config(64);
  c.max_num_seqs = 2;
  Scheduler s(c);
  std::vector<SeqId> ids;
  for (int i = 0; i < 4; ++i) ids.push_back(s.add_sequence(prompt_of(2), max_tokens(2)));
  auto out = step(s);
  EXPECT_EQ(out->seq_ids, (std::vector<SeqId>{ids[0], ids[1]}));
  EXPECT_EQ(s.num_waiting(), 2);
  step(s);  // both finish (max_tokens 2)
  out = step(s);
  EXPECT_EQ(out->seq_ids, (std::vector<SeqId>{ids[2], ids[3]}));
}

TEST(Scheduler, TokenBudgetChunksLongPrompts) {
  SchedulerConfig c = small_config(64);
  c.max_num_batched_tokens = 10;
  Scheduler s(c);
  const SeqId id = s.add_sequence(prompt_of(25), max_tokens(3));
  std::vector<int32_t> chunks;
  for (int i = 0; i < 3; ++i) {
    auto out = step(s);
    ASSERT_EQ(out->seq_ids, std::vector<SeqId>{id});
    chunks.push_back(out->num_tokens);
    EXPECT_EQ(out->total_samples, i == 2 ? 1 : 0) << "only the last chunk samples";
  }
  EXPECT_EQ(chunks, (std::vector<int32_t>{10, 10, 5}));
  EXPECT_EQ(s.find(id)->num_generated(), 1);
}

TEST(Scheduler, DecodesGoFirstAndAreNeverStarvedByAPrefill) {
  SchedulerConfig c = small_config(64);
  c.max_num_batched_tokens = 8;
  Scheduler s(c);
  const SeqId a = s.add_sequence(prompt_of(3), max_tokens(20));
  const SeqId b = s.add_sequence(prompt_of(3, 300), max_tokens(20));
  step(s);  // both prefilled in one step
  const SeqId long_prompt = s.add_sequence(prompt_of(40, 500), max_tokens(2));
  for (int i = 0; i < 5; ++i) {
    auto out = step(s);
    ASSERT_GE(out->num_seqs, 2);
    EXPECT_EQ(out->num_decodes, 2);
    EXPECT_EQ(out->seq_ids[0], a);
    EXPECT_EQ(out->seq_ids[1], b);
    ASSERT_EQ(out->num_seqs, 3);
    EXPECT_EQ(out->seq_ids[2], long_prompt);
    EXPECT_EQ(q_len(*out, 2), 6) << "the chunk takes what the decodes leave of the budget";
  }
}

TEST(Scheduler, PartialPrefillContinuesBeforeNewAdmissions) {
  SchedulerConfig c = small_config(64);
  c.max_num_batched_tokens = 8;
  Scheduler s(c);
  const SeqId first = s.add_sequence(prompt_of(12), max_tokens(2));
  const SeqId second = s.add_sequence(prompt_of(4, 300), max_tokens(2));
  auto out = step(s);
  EXPECT_EQ(out->seq_ids, std::vector<SeqId>{first});
  out = step(s);
  ASSERT_EQ(out->num_seqs, 2);
  EXPECT_EQ(out->seq_ids[0], first);  // continues its last 4 tokens...
  EXPECT_EQ(out->seq_ids[1], second);  // ...then the newcomer gets the rest of the budget
  EXPECT_EQ(q_len(*out, 0), 4);
  EXPECT_EQ(q_len(*out, 1), 4);
}

TEST(Scheduler, QueueHeadThatDoesNotFitBlocksLaterOnes) {
  SchedulerConfig c = small_config(6);  // 24 token slots
  Scheduler s(c);
  s.add_sequence(prompt_of(12), max_tokens(8));  // 3 blocks, then grows
  step(s);
  const SeqId big = s.add_sequence(prompt_of(16, 300), max_tokens(1));   // 4 blocks: does not fit now
  const SeqId small = s.add_sequence(prompt_of(2, 400), max_tokens(1));  // would fit
  auto out = step(s);
  EXPECT_FALSE(row_of(*out, big).has_value());
  EXPECT_FALSE(row_of(*out, small).has_value()) << "FCFS: nobody overtakes the head";
}

TEST(Scheduler, RejectsRequestsThatCanNeverFit) {
  SchedulerConfig c = small_config(4);  // 16 slots
  c.max_model_len = 12;
  Scheduler s(c);
  const SeqId too_long = s.add_sequence(prompt_of(13), max_tokens(1));      // > max_model_len
  c.max_model_len = 64;
  Scheduler s2(c);
  const SeqId too_big = s2.add_sequence(prompt_of(17), max_tokens(1));      // > the whole pool
  const SeqId fine = s2.add_sequence(prompt_of(4), max_tokens(1));
  auto out = s.schedule();
  ASSERT_EQ(out->rejected.size(), 1u);
  EXPECT_EQ(out->rejected[0].id, too_long);
  EXPECT_EQ(out->rejected[0].reason, FinishReason::kRejected);
  EXPECT_FALSE(s.has_unfinished());
  out = s2.schedule();
  ASSERT_EQ(out->rejected.size(), 1u);
  EXPECT_EQ(out->rejected[0].id, too_big);
  EXPECT_EQ(out->seq_ids, std::vector<SeqId>{fine}) << "the queue moves on past the rejected head";
}

TEST(Scheduler, PreemptsMostRecentlyAdmittedFirstAndReadmitsInOrder) {
  SchedulerConfig c = small_config(6);
  Scheduler s(c);
  const SeqId a = s.add_sequence(prompt_of(4), max_tokens(40));
  const SeqId b = s.add_sequence(prompt_of(4, 200), max_tokens(40));
  const SeqId d = s.add_sequence(prompt_of(4, 300), max_tokens(40));
  step(s);  // three sequences, one full block each, next token needs a second block each
  EXPECT_EQ(s.pool().num_free(), 3);
  auto out = step(s);  // all three grow by a block
  EXPECT_EQ(out->num_seqs, 3);
  for (int i = 0; i < 3; ++i) step(s);  // fill the second blocks
  out = s.schedule();                   // a and b need third blocks; none left but d's
  EXPECT_EQ(out->preempted, std::vector<SeqId>{d});
  EXPECT_EQ(out->seq_ids, (std::vector<SeqId>{a, b}));
  s.update(std::vector<TokenId>(static_cast<size_t>(out->total_samples), 7));
  EXPECT_EQ(s.waiting_ids(), std::vector<SeqId>{d});
  EXPECT_EQ(s.stats().num_preemptions, 1);
  EXPECT_EQ(s.stats().num_preempted_tokens, 8);
  EXPECT_EQ(s.find(d)->num_generated(), 5) << "a victim keeps its tokens";
  s.abort(a);
  s.abort(b);
  out = step(s);
  ASSERT_EQ(out->seq_ids, std::vector<SeqId>{d});
  EXPECT_EQ(out->num_tokens, 9) << "prompt + generated tokens are recomputed";
}

TEST(Scheduler, VictimsAreReadmittedInAdmissionOrderBeforeLaterArrivals) {
  SchedulerConfig c = small_config(6);  // 24 slots
  Scheduler s(c);
  const SeqId a = s.add_sequence(prompt_of(8), max_tokens(40));
  const SeqId b = s.add_sequence(prompt_of(4, 200), max_tokens(40));
  const SeqId d = s.add_sequence(prompt_of(4, 300), max_tokens(40));
  step(s);  // a: 2 blocks, b: 1, d: 1 -> 2 free
  std::vector<SeqId> preempted;
  for (int i = 0; i < 8 && preempted.size() < 2; ++i) {
    auto out = s.schedule();
    preempted.insert(preempted.end(), out->preempted.begin(), out->preempted.end());
    s.update(std::vector<TokenId>(static_cast<size_t>(out->total_samples), 7));
  }
  ASSERT_EQ(preempted, (std::vector<SeqId>{d, b})) << "latest admitted first";
  const SeqId late = s.add_sequence(prompt_of(2, 400), max_tokens(1));
  EXPECT_EQ(s.waiting_ids(), (std::vector<SeqId>{b, d, late})) << "victims at the front, in admission order";
  s.abort(a);
  auto out = s.schedule();
  ASSERT_GE(out->num_seqs, 2);
  EXPECT_EQ(out->seq_ids[0], b);
  EXPECT_EQ(out->seq_ids[1], d);
}

TEST(Scheduler, LoneSequenceThatOutgrowsThePoolFinishesWithLength) {
  SchedulerConfig c = small_config(2);  // 8 slots
  Scheduler s(c);
  const SeqId id = s.add_sequence(prompt_of(6), max_tokens(100));
  UpdateResult r;
  for (int i = 0; i < 3 && s.has_unfinished(); ++i) step(s, &r);
  auto out = s.schedule();
  s.update(std::vector<TokenId>(static_cast<size_t>(out->total_samples), 7));
  EXPECT_FALSE(s.has_unfinished()) << "it must not stall the scheduler";
  EXPECT_EQ(s.pool().num_free(), 2);
  (void)id;
}

TEST(Scheduler, AbortWorksInEveryState) {
  SchedulerConfig c = small_config(16);
  c.max_num_seqs = 1;
  Scheduler s(c);
  const SeqId running = s.add_sequence(prompt_of(5), max_tokens(10));
  const SeqId waiting = s.add_sequence(prompt_of(5, 200), max_tokens(10));
  step(s);
  EXPECT_TRUE(s.abort(waiting));
  EXPECT_FALSE(s.abort(waiting)) << "already gone";
  auto out = s.schedule();  // running is in flight
  EXPECT_TRUE(s.abort(running));
  EXPECT_EQ(s.pool().num_free(), 16) << "blocks return at once";
  s.update(std::vector<TokenId>(static_cast<size_t>(out->total_samples), 7));  // its row is ignored
  EXPECT_FALSE(s.has_unfinished());
  EXPECT_FALSE(s.abort(12345));
  s.pool().check_invariants();
}

TEST(Scheduler, StopsOnEosStopTokensMaxTokensAndMaxModelLen) {
  SchedulerConfig c = small_config(32);
  c.max_model_len = 8;
  Scheduler s(c);
  StopParams stop;
  stop.max_tokens = 10;
  stop.stop_token_ids = {9};
  const SeqId eos = s.add_sequence(prompt_of(2), stop);
  const SeqId stop_id = s.add_sequence(prompt_of(2, 200), stop);
  s.add_sequence(prompt_of(2, 300), max_tokens(1));  // max_tokens
  s.add_sequence(prompt_of(7, 400), stop);  // reaches max_model_len
  auto out = s.schedule();
  std::vector<TokenId> sampled(4);
  for (int32_t r = 0; r < out->num_seqs; ++r) {
    const SeqId id = out->seq_ids[static_cast<size_t>(r)];
    sampled[static_cast<size_t>(r)] = id == eos ? 2 : id == stop_id ? 9 : 5;
  }
  UpdateResult result = s.update(sampled);
  ASSERT_EQ(result.finished.size(), 4u);
  for (const FinishedSeq& f : result.finished) {
    const FinishReason want = f.id == eos || f.id == stop_id ? FinishReason::kStop : FinishReason::kLength;
    EXPECT_EQ(f.reason, want) << "seq " << f.id;
    const TokenId want_token = f.id == eos ? 2 : f.id == stop_id ? 9 : -1;
    EXPECT_EQ(f.stop_token, want_token) << "seq " << f.id;
  }
  EXPECT_EQ(s.pool().num_free(), 32);
}

TEST(Scheduler, MinTokensAndIgnoreEosDelayStopping) {
  Scheduler s(small_config(32));
  StopParams p;
  p.max_tokens = 5;
  p.min_tokens = 2;
  const SeqId min_tok = s.add_sequence(prompt_of(2), p);
  StopParams q;
  q.max_tokens = 3;
  q.ignore_eos = true;
  const SeqId ignore = s.add_sequence(prompt_of(2, 200), q);
  UpdateResult r;
  step(s, &r, 2);  // EOS for both: ignored (min_tokens / ignore_eos)
  EXPECT_TRUE(r.finished.empty());
  step(s, &r, 2);  // min_tokens reached: EOS now stops the first
  ASSERT_EQ(r.finished.size(), 1u);
  EXPECT_EQ(r.finished[0].id, min_tok);
  step(s, &r, 2);
  ASSERT_EQ(r.finished.size(), 1u);
  EXPECT_EQ(r.finished[0].id, ignore);
  EXPECT_EQ(r.finished[0].reason, FinishReason::kLength);
}

TEST(Scheduler, FinishFromTheCallerForStopStrings) {
  Scheduler s(small_config(8));
  const SeqId id = s.add_sequence(prompt_of(3), max_tokens(10));
  step(s);
  EXPECT_TRUE(s.finish(id, FinishReason::kStop));
  EXPECT_FALSE(s.has_unfinished());
  EXPECT_EQ(s.pool().num_free(), 8);
}

TEST(Scheduler, ParallelSamplingForksAfterPrefillAndCopiesOnWrite) {
  Scheduler s(small_config(16));
  StopParams p;
  p.max_tokens = 3;
  p.n = 3;
  const SeqId parent = s.add_sequence(prompt_of(6), p);  // last block half full: shared after the fork
  auto out = s.schedule();
  ASSERT_EQ(out->num_samples, std::vector<int32_t>{3});
  ASSERT_EQ(out->total_samples, 3);
  UpdateResult r = s.update(std::vector<TokenId>{40, 41, 42});
  ASSERT_EQ(r.forks.size(), 2u);
  EXPECT_EQ(r.forks[0].parent, parent);
  EXPECT_EQ(r.forks[0].sample_index, 1);
  EXPECT_EQ(r.forks[1].sample_index, 2);
  EXPECT_EQ(s.find(parent)->tokens.back(), 40);
  EXPECT_EQ(s.find(r.forks[0].child)->tokens.back(), 41);
  EXPECT_EQ(s.find(r.forks[1].child)->tokens.back(), 42);
  EXPECT_EQ(s.pool().num_used(), 2) << "all three share the prompt's two blocks";
  EXPECT_EQ(s.stats().blocks_saved_by_sharing, 4);

  out = s.schedule();  // each writes position 6 into the shared partial block
  EXPECT_EQ(out->num_seqs, 3);
  EXPECT_EQ(out->total_samples, 3);
  EXPECT_EQ(out->block_copies.size(), 2u) << "two copy, the last holder writes in place";
  for (const BlockCopy& copy : out->block_copies) EXPECT_EQ(s.pool().refcount(copy.dst), 1);
  std::vector<int32_t> slots(out->slot_mapping.begin(), out->slot_mapping.end());
  std::sort(slots.begin(), slots.end());
  EXPECT_EQ(std::adjacent_find(slots.begin(), slots.end()), slots.end()) << "no two rows write one slot";
  s.update(std::vector<TokenId>{1, 1, 1});
  EXPECT_EQ(s.pool().num_used(), 4);
  s.pool().check_invariants();
}

TEST(Scheduler, PrefixCacheSharesBlocksOnlyWithinOneSalt) {
  Scheduler s(small_config(16));
  auto with_suffix = [](TokenId t) {
    auto p = prompt_of(12);
    p.push_back(t);
    return p;
  };
  s.add_sequence(with_suffix(1), max_tokens(1), true, /*cache_salt=*/1);
  step(s);
  s.add_sequence(with_suffix(2), max_tokens(1));  // salt 0: the salt-1 blocks are not its prefix
  EXPECT_EQ(step(s)->num_tokens, 13);
  s.add_sequence(with_suffix(3), max_tokens(1), true, 1);
  EXPECT_EQ(step(s)->num_tokens, 1) << "the same salt shares the 12 cached tokens";
  s.add_sequence(with_suffix(4), max_tokens(1));
  EXPECT_EQ(step(s)->num_tokens, 1) << "salt 0 shares the blocks salt 0 registered";
  EXPECT_EQ(s.pool().num_used(), 0);
}

TEST(Scheduler, PrefixCacheServesLaterRequestsAfterTheFirstFinished) {
  Scheduler s(small_config(16));
  const auto system_prompt = prompt_of(12);
  auto with_suffix = [&](TokenId t) {
    auto p = system_prompt;
    p.push_back(t);
    return p;
  };
  s.add_sequence(with_suffix(1), max_tokens(1));
  step(s);
  EXPECT_FALSE(s.has_unfinished());
  EXPECT_EQ(s.pool().num_evictable(), 3);
  s.add_sequence(with_suffix(2), max_tokens(1));
  auto out = step(s);
  EXPECT_EQ(out->num_tokens, 1) << "12 cached tokens, only the new one is computed";
  EXPECT_EQ(out->positions[0], 12);
  EXPECT_DOUBLE_EQ(s.stats().prefix_hit_rate, 3.0 / 6.0);

  SchedulerConfig off = small_config(16);
  off.enable_prefix_caching = false;
  Scheduler no_cache(off);
  no_cache.add_sequence(with_suffix(1), max_tokens(1));
  step(no_cache);
  no_cache.add_sequence(with_suffix(2), max_tokens(1));
  EXPECT_EQ(step(no_cache)->num_tokens, 13);
}

TEST(Scheduler, WatermarkHoldsBackAdmissionOnlyWhileSomethingRuns) {
  SchedulerConfig c = small_config(10);
  c.watermark = 0.2;  // 2 blocks
  Scheduler s(c);
  s.add_sequence(prompt_of(28), max_tokens(1));  // 7 blocks: fits an idle pool
  auto out = s.schedule();
  EXPECT_EQ(out->num_seqs, 1);
  s.update(std::vector<TokenId>{7});
  Scheduler busy(c);
  busy.add_sequence(prompt_of(3), max_tokens(50));  // decodes inside its first block
  step(busy);
  busy.add_sequence(prompt_of(28, 300), max_tokens(1));  // 7 more of 9 free would leave 2: allowed
  EXPECT_EQ(step(busy)->num_seqs, 2);
  Scheduler tight(c);
  tight.add_sequence(prompt_of(4), max_tokens(50));  // its decode takes a second block
  step(tight);
  tight.add_sequence(prompt_of(28, 300), max_tokens(1));  // 7 of 8 free would leave 1 < 2
  EXPECT_EQ(step(tight)->num_seqs, 1);
}

TEST(Scheduler, StatsReportFragmentationAndUtilization) {
  Scheduler s(small_config(8));
  s.add_sequence(prompt_of(5), max_tokens(10));
  step(s);  // 6 tokens in 2 blocks of 4
  const SchedulerStats st = s.stats();
  EXPECT_EQ(st.num_running, 1);
  EXPECT_EQ(st.num_used_blocks, 2);
  EXPECT_DOUBLE_EQ(st.pool_utilization, 0.25);
  EXPECT_EQ(st.internal_fragmentation_slots, 2);
  EXPECT_EQ(st.step_prefill_tokens, 5);
}

}  // namespace
}  // namespace pagedserve
