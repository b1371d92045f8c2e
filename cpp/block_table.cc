#include "block_table.h"

#include <algorithm>
#include <utility>

#include "check.h"

namespace pagedserve {

BlockTable::BlockTable(BlockTable&& other) noexcept
    : pool_(other.pool_), blocks_(std::move(other.blocks_)), hashes_(std::move(other.hashes_)) {
  other.blocks_.clear();
  other.hashes_.clear();
}

BlockTable& BlockTable::operator=(BlockTable&& other) noexcept {
  if (this != &other) {
    release();
    pool_ = other.pool_;
    blocks_ = std::move(other.blocks_);
    hashes_ = std::move(other.hashes_);
    other.blocks_.clear();
    other.hashes_.clear();
  }
  return *this;
}

PrefixMatch BlockTable::find_prefix(const BlockPool& pool, std::span<const TokenId> tokens) {
  PrefixMatch match;
  if (!pool.prefix_caching_enabled() || tokens.empty()) return match;
  const auto bs = static_cast<size_t>(pool.block_size());
  const size_t max_blocks = (tokens.size() - 1) / bs;
  BlockHash parent = kRootBlockHash;
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

BlockTable BlockTable::fork() const {
  BlockTable child(*pool_);
  for (BlockId b : blocks_) pool_->incref(b);
  child.blocks_ = blocks_;
  child.hashes_ = hashes_;
  return child;
}

void BlockTable::register_full_blocks(std::span<const TokenId> tokens, int32_t num_computed) {
  if (!pool_->prefix_caching_enabled()) return;
  const auto bs = static_cast<size_t>(pool_->block_size());
  const size_t full = std::min(static_cast<size_t>(num_computed) / bs, blocks_.size());
  for (size_t i = hashes_.size(); i < full; ++i) {
    auto block_tokens = tokens.subspan(i * bs, bs);
    const BlockHash parent = i == 0 ? kRootBlockHash : hashes_[i - 1];
    hashes_.push_back(hash_block(parent, block_tokens));
    pool_->register_block(blocks_[i], hashes_.back(), block_tokens);
  }
}

void BlockTable::release() {
  for (auto it = blocks_.rbegin(); it != blocks_.rend(); ++it) pool_->decref(*it);
  blocks_.clear();
  hashes_.clear();
}

}  // namespace pagedserve
