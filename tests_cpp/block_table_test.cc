#include "block_table.h"

#include <gtest/gtest.h>

#include <memory>
#include <numeric>
#include <vector>

namespace pagedserve {
namespace {

std::vector<TokenId> iota_tokens(int32_t count, TokenId first = 0) {
  std::vector<TokenId> t(static_cast<size_t>(count));
  std::iota(t.begin(), t.end(), first);
  return t;
}

TEST(BlockTable, GrowsOnDemandAndMapsSlots) {
  BlockPool pool(8, 4, false);
  BlockTable table(pool);
  std::vector<BlockCopy> copies;
  ASSERT_TRUE(table.prepare_write(0, 5, copies));
  EXPECT_EQ(table.num_blocks(), 2);
  EXPECT_TRUE(copies.empty());
  for (int32_t pos = 0; pos < 5; ++pos) {
    EXPECT_EQ(table.slot(pos), table.blocks()[static_cast<size_t>(pos / 4)] * 4 + pos % 4);
  }
  ASSERT_TRUE(table.prepare_write(5, 8, copies));
  EXPECT_EQ(table.num_blocks(), 2);  // still fits
  ASSERT_TRUE(table.prepare_write(8, 9, copies));
  EXPECT_EQ(table.num_blocks(), 3);
  EXPECT_EQ(pool.num_used(), 3);
}

TEST(BlockTable, DropBlocksBeforeAWindowKeepsCachedBlocksAndChains) {
  BlockPool pool(8, 4, true);
  const std::vector<TokenId> tokens = iota_tokens(20, 3);
  BlockTable table(pool);
  std::vector<BlockCopy> copies;
  ASSERT_TRUE(table.prepare_write(0, 10, copies));
  table.register_full_blocks(tokens, 10);  // blocks 0 and 1 cached
  const BlockId first = table.blocks()[0];
  table.drop_blocks_before(9);  // positions 0..7: blocks 0 and 1 wholly before
  EXPECT_EQ(table.num_dropped(), 2);
  EXPECT_EQ(table.blocks()[0], kDroppedBlock);
  EXPECT_EQ(table.blocks()[1], kDroppedBlock);
  EXPECT_EQ(pool.state(first), BlockState::kEvictable);  // given back, still cached
  table.drop_blocks_before(3);                            // never re-grows
  EXPECT_EQ(table.num_dropped(), 2);
  BlockTable child = table.fork();
  EXPECT_EQ(pool.refcount(table.blocks()[2]), 2);
  ASSERT_TRUE(table.prepare_write(10, 13, copies));  // copy-on-write of the shared block 2
  EXPECT_EQ(copies.size(), 1u);
  pool.end_step();  // the copy's source stays pinned until then
  table.register_full_blocks(tokens, 13);  // block 2's hash chains through the dropped ones
  const PrefixMatch match = BlockTable::find_prefix(pool, tokens);
  EXPECT_EQ(match.blocks.size(), 3u);  // blocks 0, 1 (evictable) and 2
  child.release();
  table.release();
  EXPECT_EQ(pool.num_free(), 8);
  pool.check_invariants();
}

TEST(BlockTable, ReleasesEverythingWhenDestroyed) {
  BlockPool pool(4, 4, false);
  {
    BlockTable table(pool);
    std::vector<BlockCopy> copies;
    ASSERT_TRUE(table.prepare_write(0, 16, copies));
    EXPECT_EQ(pool.num_free(), 0);
  }
  EXPECT_EQ(pool.num_free(), 4);
  pool.check_invariants();
}

TEST(BlockTable, MoveTransfersOwnershipOnce) {
  BlockPool pool(4, 4, false);
  BlockTable a(pool);
  std::vector<BlockCopy> copies;
  ASSERT_TRUE(a.prepare_write(0, 8, copies));
  BlockTable b(std::move(a));
  EXPECT_EQ(b.num_blocks(), 2);
  EXPECT_EQ(a.num_blocks(), 0);  // NOLINT(bugprone-use-after-move): moved-from is empty by contract
  BlockTable c(pool);
  c = std::move(b);
  EXPECT_EQ(pool.num_used(), 2);
  c.release();
  EXPECT_EQ(pool.num_free(), 4);
  pool.check_invariants();
}

TEST(BlockTable, PrepareWriteIsAllOrNothing) {
  BlockPool pool(3, 4, false);
  BlockTable table(pool);
  std::vector<BlockCopy> copies;
  EXPECT_FALSE(table.prepare_write(0, 13, copies));  // needs 4 blocks of 3
  EXPECT_EQ(table.num_blocks(), 0);
  EXPECT_EQ(pool.num_free(), 3);
  EXPECT_TRUE(table.prepare_write(0, 12, copies));
}

TEST(BlockTable, ForkSharesEveryBlock) {
  BlockPool pool(8, 4, false);
  BlockTable parent(pool);
  std::vector<BlockCopy> copies;
  ASSERT_TRUE(parent.prepare_write(0, 6, copies));
  BlockTable child = parent.fork();
  ASSERT_EQ(child.num_blocks(), 2);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(child.blocks()[i], parent.blocks()[i]);
    EXPECT_EQ(pool.refcount(parent.blocks()[i]), 2);
  }
  EXPECT_EQ(pool.num_used(), 2);
  EXPECT_EQ(pool.total_refs(), 4);
}

TEST(BlockTable, FirstWriteIntoSharedBlockCopiesInSafeOrder) {
  BlockPool pool(8, 4, false);
  BlockTable parent(pool);
  std::vector<BlockCopy> copies;
  ASSERT_TRUE(parent.prepare_write(0, 6, copies));  // block 1 holds positions 4, 5
  BlockTable child = parent.fork();
  const BlockId shared_full = parent.blocks()[0];
  const BlockId shared_partial = parent.blocks()[1];

  ASSERT_TRUE(child.prepare_write(6, 7, copies));  // writes position 6 into the shared partial block
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0].src, shared_partial);
  EXPECT_NE(copies[0].dst, shared_partial);
  EXPECT_EQ(child.blocks()[1], copies[0].dst);                 // swapped in
  EXPECT_EQ(child.blocks()[0], shared_full);                   // untouched full block stays shared
  EXPECT_EQ(pool.refcount(copies[0].dst), 1);
  EXPECT_EQ(pool.refcount(shared_partial), 1);  // copy -> decref -> swap
  pool.end_step();

  // The parent is now the only holder: it writes in place, no copy.
  copies.clear();
  ASSERT_TRUE(parent.prepare_write(6, 7, copies));
  EXPECT_TRUE(copies.empty());
  EXPECT_EQ(parent.blocks()[1], shared_partial);
  pool.check_invariants();
}

TEST(BlockTable, CopySourceIsNotReusedWithinTheStep) {
  BlockPool pool(3, 4, false);
  std::vector<BlockCopy> copies;
  auto parent = std::make_unique<BlockTable>(pool);
  ASSERT_TRUE(parent->prepare_write(0, 2, copies));
  BlockTable child = parent->fork();
  ASSERT_TRUE(child.prepare_write(2, 3, copies));  // copy src -> dst
  ASSERT_EQ(copies.size(), 1u);
  const BlockId src = copies[0].src;
  parent.reset();  // the last holder of src leaves in the same step (a preemption, say)
  EXPECT_EQ(pool.refcount(src), 0);
  EXPECT_EQ(pool.num_free(), 1) << "src is held back until end_step()";
  const auto other = pool.allocate();
  ASSERT_TRUE(other.has_value());
  EXPECT_NE(*other, src);
  EXPECT_FALSE(pool.allocate().has_value());
  pool.end_step();
  EXPECT_EQ(pool.num_free(), 1);
  EXPECT_EQ(pool.allocate(), src);
}

TEST(BlockTable, CopyOnWriteCountsAgainstFreeBlocks) {
  BlockPool pool(2, 4, false);
  BlockTable parent(pool);
  std::vector<BlockCopy> copies;
  ASSERT_TRUE(parent.prepare_write(0, 6, copies));
  BlockTable child = parent.fork();
  EXPECT_EQ(child.blocks_needed(6, 7), 1);
  EXPECT_FALSE(child.prepare_write(6, 7, copies));  // no free block for the copy
  EXPECT_TRUE(copies.empty());
  EXPECT_EQ(child.blocks()[1], parent.blocks()[1]);
}

TEST(BlockTable, PrefixHitAfterTheOwnerIsGone) {
  BlockPool pool(8, 4, true);
  const auto prompt = iota_tokens(10);
  {
    BlockTable first(pool);
    std::vector<BlockCopy> copies;
    ASSERT_TRUE(first.prepare_write(0, 10, copies));
    first.register_full_blocks(prompt, 10);  // blocks 0 and 1 are full
    EXPECT_TRUE(pool.is_cached(first.blocks()[0]));
    EXPECT_TRUE(pool.is_cached(first.blocks()[1]));
    EXPECT_FALSE(pool.is_cached(first.blocks()[2]));
  }
  EXPECT_EQ(pool.num_evictable(), 2);
  const PrefixMatch match = BlockTable::find_prefix(pool, prompt);
  EXPECT_EQ(match.blocks.size(), 2u);
  EXPECT_EQ(match.num_evictable, 2);
  EXPECT_EQ(match.queried_blocks, 2);
  BlockTable second(pool);
  second.adopt_prefix(match);
  EXPECT_EQ(pool.num_evictable(), 0);
  EXPECT_EQ(pool.prefix_counters().hit_blocks, 2);
  pool.check_invariants();
}

TEST(BlockTable, PrefixMatchLeavesOneTokenToCompute) {
  BlockPool pool(8, 4, true);
  const auto prompt = iota_tokens(8);  // exactly two full blocks
  BlockTable first(pool);
  std::vector<BlockCopy> copies;
  ASSERT_TRUE(first.prepare_write(0, 8, copies));
  first.register_full_blocks(prompt, 8);
  const PrefixMatch match = BlockTable::find_prefix(pool, prompt);
  EXPECT_EQ(match.blocks.size(), 1u) << "the last block is recomputed so the forward yields logits";
}

TEST(BlockTable, PrefixMissAfterEvictionAndOnDifferentTokens) {
  BlockPool pool(2, 4, true);
  const auto prompt = iota_tokens(5);
  {
    BlockTable t(pool);
    std::vector<BlockCopy> copies;
    ASSERT_TRUE(t.prepare_write(0, 5, copies));
    t.register_full_blocks(prompt, 5);
  }
  EXPECT_EQ(BlockTable::find_prefix(pool, iota_tokens(5, 1)).blocks.size(), 0u);
  {
    BlockTable hog(pool);  // takes both blocks: the cached one is evicted
    std::vector<BlockCopy> copies;
    ASSERT_TRUE(hog.prepare_write(0, 8, copies));
  }
  EXPECT_EQ(pool.prefix_counters().evictions, 1);
  EXPECT_EQ(BlockTable::find_prefix(pool, prompt).blocks.size(), 0u);
  pool.check_invariants();
}

TEST(BlockTable, RegisteringOnlyCoversComputedFullBlocks) {
  BlockPool pool(8, 4, true);
  const auto prompt = iota_tokens(12);
  BlockTable t(pool);
  std::vector<BlockCopy> copies;
  ASSERT_TRUE(t.prepare_write(0, 12, copies));
  t.register_full_blocks(prompt, 7);  // chunked prefill: only block 0 is complete
  EXPECT_TRUE(pool.is_cached(t.blocks()[0]));
  EXPECT_FALSE(pool.is_cached(t.blocks()[1]));
  t.register_full_blocks(prompt, 12);
  EXPECT_TRUE(pool.is_cached(t.blocks()[1]));
  EXPECT_TRUE(pool.is_cached(t.blocks()[2]));
}

}  // namespace
}  // namespace pagedserve
