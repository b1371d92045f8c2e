#include "block_table.h"

#include <algorithm>
#include <utility>

#include "check.h"

namespace pagedserve {

BlockTable::BlockTable(BlockTable&& other) noexcept
    : pool_(other.pool_),
      blocks_(std::move(other.blocks_)),
      hashes_(std::move(other.hashes_)),
      num_dropped_(other.num_dropped_),
      root_(other.root_) {
  other.blocks_.clear();
  other.hashes_.clear();
  other.num_dropped_ = 0;
}

BlockTable& BlockTable::operator=(BlockTable&& other) noexcept {
  if (this != &other) {
    release();
    pool_ = other.pool_;
    blocks_ = std::move(other.blocks_);
    hashes_ = std::move(other.hashes_);
    num_dropped_ = other.num_dropped_;
    root_ = other.root_;
    other.blocks_.clear();
    other.hashes_.clear();
    other.num_dropped_ = 0;
  }
  return *this;
}

PrefixMatch BlockTable::find_prefix(const BlockPool& pool, std::span<const TokenId> tokens, const BlockHash& root) {
  PrefixMatch match;
  if (!pool.prefix_caching_enabled() || tokens.empty()) return match;
  const auto bs = static_cast<size_t>(pool.block_size());
  const size_t max_blocks = (tokens.size() - 1) / bs;
  BlockHash parent = root;
  for (size_t i = 0; i < max_blocks; ++i) {
    auto block_tokens = tokens.subspan(i * bs, bs);
    const BlockHash hash = hash_block(parent, block_tokens);
    auto block = pool.find_cached(hash, block_tokens);
    if (!block) break;
    match.blocks.push_back(*block);
    match.hashes.push_back(hash);
    if (pool.refcount(*block) == 0) ++match.num_evictable;
    parent = hash;
  }
  match.queried_blocks = static_cast<int32_t>(max_blocks);
  return match;
}

void BlockTable::adopt_prefix(const PrefixMatch& match) {
  PS_CHECK(blocks_.empty(), "adopt_prefix on a table that already holds ", blocks_.size(), " blocks");
  for (BlockId b : match.blocks) pool_->incref(b);
  pool_->record_lookup(match.queried_blocks, static_cast<int32_t>(match.blocks.size()));
  blocks_ = match.blocks;
  hashes_ = match.hashes;
}

int32_t BlockTable::blocks_needed(int32_t begin, int32_t end) const {
  if (end <= begin) return 0;
  const int32_t bs = pool_->block_size();
  const int32_t last_block = (end - 1) / bs;
  int32_t needed = std::max(0, last_block + 1 - num_blocks());
  PS_CHECK(begin / bs >= num_dropped_, "write range [", begin, ", ", end, ") starts in a dropped block");
  for (int32_t i = begin / bs; i < std::min(last_block + 1, num_blocks()); ++i) {
    if (pool_->refcount(blocks_[static_cast<size_t>(i)]) > 1) ++needed;
  }
  return needed;
}

bool BlockTable::prepare_write(int32_t begin, int32_t end, std::vector<BlockCopy>& copies) {
  PS_CHECK(begin >= 0 && begin <= end, "bad write range [", begin, ", ", end, ")");
  if (blocks_needed(begin, end) > pool_->num_free()) return false;
  if (end == begin) return true;
  const int32_t bs = pool_->block_size();
  const int32_t last_block = (end - 1) / bs;
  for (int32_t i = begin / bs; i < std::min(last_block + 1, num_blocks()); ++i) {
    BlockId& block = blocks_[static_cast<size_t>(i)];
    if (pool_->refcount(block) == 1) continue;
    const BlockId fresh = *pool_->allocate();  // counted by blocks_needed
    copies.push_back({block, fresh});
    pool_->pin_until_step_end(block);
    pool_->decref(block);
    block = fresh;
  }
  while (num_blocks() <= last_block) blocks_.push_back(*pool_->allocate());
  return true;
}

void BlockTable::drop_blocks_before(int32_t position) {
  const int32_t end = std::min(num_blocks(), std::max(0, position) / pool_->block_size());
  // Last block first, as release() does: the head of a cached prefix is evicted last.
  for (int32_t i = end - 1; i >= num_dropped_; --i) {
    pool_->decref(blocks_[static_cast<size_t>(i)]);
    blocks_[static_cast<size_t>(i)] = kDroppedBlock;
  }
  num_dropped_ = std::max(num_dropped_, end);
}

BlockTable BlockTable::fork() const {
  BlockTable child(*pool_);
  for (int32_t i = num_dropped_; i < num_blocks(); ++i) pool_->incref(blocks_[static_cast<size_t>(i)]);
  child.blocks_ = blocks_;
  child.hashes_ = hashes_;
  child.num_dropped_ = num_dropped_;
  child.root_ = root_;
  return child;
}

void BlockTable::register_full_blocks(std::span<const TokenId> tokens, int32_t num_computed) {
  if (!pool_->prefix_caching_enabled()) return;
  const auto bs = static_cast<size_t>(pool_->block_size());
  const size_t full = std::min(static_cast<size_t>(num_computed) / bs, blocks_.size());
  for (size_t i = hashes_.size(); i < full; ++i) {
    auto block_tokens = tokens.subspan(i * bs, bs);
    const BlockHash parent = i == 0 ? root_ : hashes_[i - 1];
    hashes_.push_back(hash_block(parent, block_tokens));
    if (blocks_[i] != kDroppedBlock) pool_->register_block(blocks_[i], hashes_.back(), block_tokens);
  }
}

void BlockTable::release() {
  for (auto it = blocks_.rbegin(); it != blocks_.rend(); ++it) {
    if (*it != kDroppedBlock) pool_->decref(*it);
  }
  blocks_.clear();
  hashes_.clear();
  num_dropped_ = 0;
}

}  // namespace pagedserve
