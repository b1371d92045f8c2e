#include "block_pool.h"

#include <algorithm>

#include "check.h"

namespace pagedserve {

BlockPool::BlockPool(int32_t num_blocks, int32_t block_size, bool enable_prefix_caching)
    : block_size_(block_size), prefix_caching_(enable_prefix_caching) {
  PS_CHECK(num_blocks > 0, "BlockPool needs at least one block, got ", num_blocks);
  PS_CHECK(block_size > 0, "block_size must be positive, got ", block_size);
  meta_.resize(static_cast<size_t>(num_blocks));
  free_stack_.reserve(static_cast<size_t>(num_blocks));
  // Push in reverse so that block 0 is handed out first.
  for (BlockId b = num_blocks - 1; b >= 0; --b) free_stack_.push_back(b);
  if (prefix_caching_) {
    index_.reserve(static_cast<size_t>(num_blocks));
    cached_tokens_.resize(static_cast<size_t>(num_blocks) * static_cast<size_t>(block_size));
  }
}

BlockId BlockPool::checked(BlockId block) const {
  PS_CHECK(block >= 0 && block < num_blocks(), "block id ", block, " out of range [0, ", num_blocks(), ")");
  return block;
}

std::optional<BlockId> BlockPool::allocate() {
  BlockId block;
  if (!free_stack_.empty()) {
    block = free_stack_.back();
    free_stack_.pop_back();
  } else if (lru_head_ != kNil) {
    block = lru_head_;
    lru_remove(block);
    uncache(block);
    ++counters_.evictions;
  } else {
    return std::nullopt;
  }
  meta_[block].refcount = 1;
  ++total_refs_;
  return block;
}

void BlockPool::incref(BlockId block) {
  BlockMeta& m = meta_[checked(block)];
  if (m.refcount == 0) {
    PS_CHECK(m.cached, "incref of free block ", block);
    lru_remove(block);  // a prefix hit revives an evictable block
  }
  ++m.refcount;
  ++total_refs_;
}

void BlockPool::decref(BlockId block) {
  BlockMeta& m = meta_[checked(block)];
  PS_CHECK(m.refcount > 0, "decref of unheld block ", block);
  --total_refs_;
  if (--m.refcount > 0 || m.pinned) return;
  release_unheld(block);
}

void BlockPool::release_unheld(BlockId block) {
  if (meta_[block].cached) {
    lru_push_back(block);
  } else {
    free_stack_.push_back(block);
  }
}

void BlockPool::pin_until_step_end(BlockId block) {
  BlockMeta& m = meta_[checked(block)];
  PS_CHECK(m.refcount > 0, "pinning unheld block ", block);
  if (m.pinned) return;
  m.pinned = true;
  pinned_.push_back(block);
}

void BlockPool::end_step() {
  for (BlockId block : pinned_) {
    meta_[block].pinned = false;
    if (meta_[block].refcount == 0) release_unheld(block);
  }
  pinned_.clear();
}

std::optional<BlockId> BlockPool::find_cached(const BlockHash& hash, std::span<const TokenId> tokens) const {
  if (!prefix_caching_) return std::nullopt;
  auto it = index_.find(hash);
  if (it == index_.end()) return std::nullopt;
  const auto offset = static_cast<size_t>(it->second) * static_cast<size_t>(block_size_);
  if (tokens.size() != static_cast<size_t>(block_size_) ||
      !std::equal(tokens.begin(), tokens.end(), cached_tokens_.begin() + static_cast<std::ptrdiff_t>(offset))) {
    return std::nullopt;  // a hash collision: treat as a miss
  }
  return it->second;
}

bool BlockPool::register_block(BlockId block, const BlockHash& hash, std::span<const TokenId> tokens) {
  BlockMeta& m = meta_[checked(block)];
  if (!prefix_caching_ || m.cached) return m.cached;
  PS_CHECK(m.refcount > 0, "registering unheld block ", block);
  PS_CHECK(tokens.size() == static_cast<size_t>(block_size_), "a cached block needs exactly block_size tokens");
  if (!index_.emplace(hash, block).second) return false;  // same content already cached elsewhere
  m.cached = true;
  m.hash = hash;
  std::copy(tokens.begin(), tokens.end(),
            cached_tokens_.begin() + static_cast<std::ptrdiff_t>(block) * block_size_);
  return true;
}

void BlockPool::record_lookup(int32_t queried_blocks, int32_t hit_blocks) {
  counters_.queried_blocks += queried_blocks;
  counters_.hit_blocks += hit_blocks;
}

void BlockPool::uncache(BlockId block) {
  BlockMeta& m = meta_[block];
  index_.erase(m.hash);
  m.cached = false;
}

void BlockPool::lru_push_back(BlockId block) {
  BlockMeta& m = meta_[block];
  m.lru_prev = lru_tail_;
  m.lru_next = kNil;
  if (lru_tail_ != kNil) {
    meta_[lru_tail_].lru_next = block;
  } else {
    lru_head_ = block;
  }
  lru_tail_ = block;
  ++num_evictable_;
}

void BlockPool::lru_remove(BlockId block) {
  BlockMeta& m = meta_[block];
  if (m.lru_prev != kNil) {
    meta_[m.lru_prev].lru_next = m.lru_next;
  } else {
    lru_head_ = m.lru_next;
  }
  if (m.lru_next != kNil) {
    meta_[m.lru_next].lru_prev = m.lru_prev;
  } else {
    lru_tail_ = m.lru_prev;
  }
  m.lru_prev = m.lru_next = kNil;
  --num_evictable_;
}

BlockState BlockPool::state(BlockId block) const {
  const BlockMeta& m = meta_[checked(block)];
  if (m.refcount > 1) return BlockState::kShared;
  if (m.refcount == 1) return BlockState::kInUse;
  return m.cached ? BlockState::kEvictable : BlockState::kFree;
}

std::vector<uint8_t> BlockPool::block_states() const {
  std::vector<uint8_t> states(meta_.size());
  for (BlockId b = 0; b < num_blocks(); ++b) states[static_cast<size_t>(b)] = static_cast<uint8_t>(state(b));
  return states;
}

void BlockPool::check_invariants() const {
  std::vector<uint8_t> seen(meta_.size(), 0);
  for (BlockId b : free_stack_) {
    PS_CHECK(!seen[static_cast<size_t>(b)], "block ", b, " twice on the free stack");
    seen[static_cast<size_t>(b)] = 1;
    PS_CHECK(meta_[b].refcount == 0 && !meta_[b].cached, "free block ", b, " is held or cached");
  }
  int32_t lru_count = 0;
  for (int32_t b = lru_head_, prev = kNil; b != kNil; prev = b, b = meta_[b].lru_next) {
    PS_CHECK(!seen[static_cast<size_t>(b)], "block ", b, " both free and evictable, or an LRU cycle");
    seen[static_cast<size_t>(b)] = 1;
    PS_CHECK(meta_[b].lru_prev == prev, "broken LRU back link at block ", b);
    PS_CHECK(meta_[b].refcount == 0 && meta_[b].cached, "evictable block ", b, " is held or uncached");
    ++lru_count;
  }
  PS_CHECK(pinned_.empty(), pinned_.size(), " blocks still pinned: end_step() was not called");
  PS_CHECK(lru_count == num_evictable_, "LRU holds ", lru_count, " blocks, counter says ", num_evictable_);
  int64_t refs = 0;
  size_t cached = 0;
  for (BlockId b = 0; b < num_blocks(); ++b) {
    const BlockMeta& m = meta_[b];
    PS_CHECK(m.refcount >= 0, "negative refcount on block ", b);
    PS_CHECK((m.refcount == 0) == (seen[static_cast<size_t>(b)] == 1), "block ", b, " refcount ", m.refcount,
             " disagrees with free/evictable membership");
    refs += m.refcount;
    if (m.cached) {
      ++cached;
      auto it = index_.find(m.hash);
      PS_CHECK(it != index_.end() && it->second == b, "cached block ", b, " missing from the hash index");
    }
  }
  PS_CHECK(refs == total_refs_, "refcounts sum to ", refs, ", counter says ", total_refs_);
  PS_CHECK(cached == index_.size(), "hash index has ", index_.size(), " entries for ", cached, " cached blocks");
}

}  // namespace pagedserve
