#include "block_pool.h"

#include <gtest/gtest.h>

#include <set>
#include <vector>

namespace pagedserve {
namespace {

std::vector<TokenId> tokens_of(TokenId first, int32_t count) {
  std::vector<TokenId> t(static_cast<size_t>(count));
  for (int32_t i = 0; i < count; ++i) t[static_cast<size_t>(i)] = first + i;
  return t;
}

TEST(BlockPool, AllocatesEveryBlockOnceThenReportsExhaustion) {
  BlockPool pool(8, 16, false);
  std::set<BlockId> seen;
  for (int i = 0; i < 8; ++i) {
    auto b = pool.allocate();
    ASSERT_TRUE(b.has_value());
    EXPECT_TRUE(seen.insert(*b).second) << "block " << *b << " handed out twice";
    EXPECT_EQ(pool.refcount(*b), 1);
  }
  EXPECT_EQ(pool.num_free(), 0);
  EXPECT_FALSE(pool.allocate().has_value());  // a sentinel, not an exception
  pool.check_invariants();
}

TEST(BlockPool, FreeListIsLifo) {
  BlockPool pool(4, 16, false);
  const BlockId a = *pool.allocate();
  const BlockId b = *pool.allocate();
  pool.decref(a);
  pool.decref(b);
  EXPECT_EQ(*pool.allocate(), b);  // most recently freed first
  EXPECT_EQ(*pool.allocate(), a);
}

TEST(BlockPool, RefcountsCountHoldersAndFreeAtZero) {
  BlockPool pool(2, 16, false);
  const BlockId b = *pool.allocate();
  pool.incref(b);
  pool.incref(b);
  EXPECT_EQ(pool.refcount(b), 3);
  EXPECT_EQ(pool.total_refs(), 3);
  EXPECT_EQ(pool.state(b), BlockState::kShared);
  pool.decref(b);
  pool.decref(b);
  EXPECT_EQ(pool.state(b), BlockState::kInUse);
  EXPECT_EQ(pool.num_free(), 1);
  pool.decref(b);
  EXPECT_EQ(pool.num_free(), 2);
  EXPECT_EQ(pool.state(b), BlockState::kFree);
  pool.check_invariants();
}

TEST(BlockPool, MisuseThrows) {
  BlockPool pool(2, 16, false);
  EXPECT_THROW(pool.decref(0), std::logic_error);  // double free
  EXPECT_THROW(pool.incref(1), std::logic_error);  // reviving a block nobody holds or caches
  EXPECT_THROW(pool.refcount(2), std::logic_error);
  EXPECT_THROW(pool.decref(-1), std::logic_error);
  EXPECT_THROW(BlockPool(0, 16, false), std::logic_error);
  pool.check_invariants();
}

TEST(BlockPool, CachedBlockBecomesEvictableAndCanBeRevived) {
  BlockPool pool(2, 4, true);
  const BlockId b = *pool.allocate();
  const auto toks = tokens_of(10, 4);
  const BlockHash h = hash_block(kRootBlockHash, toks);
  ASSERT_TRUE(pool.register_block(b, h, toks));
  pool.decref(b);
  EXPECT_EQ(pool.state(b), BlockState::kEvictable);
  EXPECT_EQ(pool.num_free(), 2);  // evictable blocks count as free
  EXPECT_EQ(pool.num_evictable(), 1);
  ASSERT_EQ(pool.find_cached(h, toks), b);
  pool.incref(b);  // a prefix hit takes it off the LRU list
  EXPECT_EQ(pool.state(b), BlockState::kInUse);
  EXPECT_EQ(pool.num_evictable(), 0);
  pool.check_invariants();
}

TEST(BlockPool, LookupVerifiesTokensNotJustTheHash) {
  BlockPool pool(2, 4, true);
  const BlockId b = *pool.allocate();
  const auto toks = tokens_of(10, 4);
  const BlockHash h = hash_block(kRootBlockHash, toks);
  ASSERT_TRUE(pool.register_block(b, h, toks));
  EXPECT_FALSE(pool.find_cached(h, tokens_of(11, 4)).has_value());  // forged collision: same hash, other tokens
}

TEST(BlockPool, AllocatePrefersFreeBlocksThenEvictsLeastRecentlyReleased) {
  BlockPool pool(3, 4, true);
  const BlockId a = *pool.allocate();
  const BlockId b = *pool.allocate();
  const BlockId c = *pool.allocate();
  const auto ta = tokens_of(0, 4), tb = tokens_of(100, 4);
  const BlockHash ha = hash_block(kRootBlockHash, ta), hb = hash_block(kRootBlockHash, tb);
  ASSERT_TRUE(pool.register_block(a, ha, ta));
  ASSERT_TRUE(pool.register_block(b, hb, tb));
  pool.decref(a);  // released first: evicted first
  pool.decref(b);
  pool.decref(c);  // uncached: plain free
  EXPECT_EQ(*pool.allocate(), c);
  EXPECT_EQ(pool.prefix_counters().evictions, 0);
  EXPECT_EQ(*pool.allocate(), a);
  EXPECT_EQ(pool.prefix_counters().evictions, 1);
  EXPECT_FALSE(pool.find_cached(ha, ta).has_value()) << "an evicted block must leave the index";
  EXPECT_EQ(pool.find_cached(hb, tb), b);
  pool.check_invariants();
}

TEST(BlockPool, RegisteringKnownContentTwiceKeepsTheFirstBlock) {
  BlockPool pool(2, 4, true);
  const BlockId a = *pool.allocate();
  const BlockId b = *pool.allocate();
  const auto t = tokens_of(7, 4);
  const BlockHash h = hash_block(kRootBlockHash, t);
  EXPECT_TRUE(pool.register_block(a, h, t));
  EXPECT_FALSE(pool.register_block(b, h, t));
  EXPECT_FALSE(pool.is_cached(b));
  pool.decref(b);
  EXPECT_EQ(pool.state(b), BlockState::kFree);  // the duplicate is not kept for prefix hits
  pool.check_invariants();
}

TEST(BlockPool, CachingOffRegistersNothing) {
  BlockPool pool(1, 4, false);
  const BlockId a = *pool.allocate();
  const auto t = tokens_of(7, 4);
  EXPECT_FALSE(pool.register_block(a, hash_block(kRootBlockHash, t), t));
  pool.decref(a);
  EXPECT_EQ(pool.state(a), BlockState::kFree);
}

TEST(BlockHash, ChainsOverTheWholePrefix) {
  const auto t1 = tokens_of(1, 4), t2 = tokens_of(5, 4);
  const BlockHash h1 = hash_block(kRootBlockHash, t1);
  EXPECT_EQ(h1, hash_block(kRootBlockHash, t1));
  EXPECT_NE(hash_block(h1, t2), hash_block(kRootBlockHash, t2)) << "same block, different parent";
  EXPECT_NE(hash_block(kRootBlockHash, tokens_of(2, 4)), h1);
  EXPECT_NE(hash_block(kRootBlockHash, std::vector<TokenId>{1, 2}), hash_block(kRootBlockHash, std::vector<TokenId>{2, 1}));
}

}  // namespace
}  // namespace pagedserve
