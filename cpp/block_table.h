// BlockTable: the blocks holding one sequence's KV cache, in token order.
//
// Token position p lives in block blocks()[p / block_size] at offset
// p % block_size; its cache slot is block * block_size + offset.
//
// A table holds one reference on each of its blocks and gives them back when
// it is destroyed or released (RAII); it is move-only. fork() makes a second
// table sharing every block. Blocks written by the next forward pass must be
// exclusively owned, so prepare_write() copies a shared block before the
// write (copy-on-write), in the safe order: record the (src, dst) copy the
// runner applies before the forward, decref src, swap dst in. src is pinned
// until BlockPool::end_step(), so even if every other holder lets go of it
// within the step it cannot become another pending copy's destination.
//
// Sliding windows: drop_blocks_before() gives back the blocks a windowed
// model will never read again. Their entries stay in place as kDroppedBlock
// (-1), so positions keep their block index and the step's block tables show
// -1 there (paged attention with a window never reads them; see
// cpp/ops/attention_options.h). Dropped blocks are always a prefix of the
// table; their prefix hashes are kept, so later blocks still chain and a
// dropped block that was registered stays in the prefix cache (evictable).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "block_hash.h"
#include "block_pool.h"
#include "core_types.h"

namespace pagedserve {

// The longest run of cached full blocks matching a token prefix.
// The entry of a block given back by drop_blocks_before().
inline constexpr BlockId kDroppedBlock = -1;

struct PrefixMatch {
  std::vector<BlockId> blocks;
  std::vector<BlockHash> hashes;
  int32_t num_evictable = 0;   // of `blocks`, those held by nobody (they leave the free count when adopted)
  int32_t queried_blocks = 0;  // full blocks looked up
  int32_t num_tokens(int32_t block_size) const { return static_cast<int32_t>(blocks.size()) * block_size; }
};

class BlockTable {
 public:
  explicit BlockTable(BlockPool& pool) : pool_(&pool) {}
  ~BlockTable() { release(); }
  BlockTable(BlockTable&& other) noexcept;
  BlockTable& operator=(BlockTable&& other) noexcept;
  BlockTable(const BlockTable&) = delete;
  BlockTable& operator=(const BlockTable&) = delete;

  std::span<const BlockId> blocks() const { return blocks_; }  // dropped entries are kDroppedBlock
  int32_t num_blocks() const { return static_cast<int32_t>(blocks_.size()); }
  int32_t num_dropped() const { return num_dropped_; }
  int32_t num_live_blocks() const { return num_blocks() - num_dropped_; }
  int32_t capacity() const { return num_blocks() * pool_->block_size(); }
  int32_t slot(int32_t pos) const {
    const int32_t bs = pool_->block_size();
    return blocks_[static_cast<size_t>(pos / bs)] * bs + pos % bs;
  }

  // Cached blocks for the longest full-block prefix of `tokens`, leaving at
  // least one token uncomputed (the forward must produce its logits).
  // Changes nothing in the pool.
  // `root`: the chain's first parent (salted_root_hash of the sequence's salt).
  static PrefixMatch find_prefix(const BlockPool& pool, std::span<const TokenId> tokens,
                                 const BlockHash& root = kRootBlockHash);
  // The root the table's full blocks are registered under; set before any is.
  void set_root_hash(const BlockHash& root) { root_ = root; }
  const BlockHash& root_hash() const { return root_; }
  // Takes a reference on each matched block and counts the lookup in the
  // pool's prefix-cache counters. The table must be empty.
  void adopt_prefix(const PrefixMatch& match);

  // Blocks prepare_write(begin, end) must allocate: new blocks past the end,
  // plus a copy for each shared block in [begin, end).
  int32_t blocks_needed(int32_t begin, int32_t end) const;
  // Makes positions [begin, end) writable. All or nothing: returns false and
  // changes nothing if the pool lacks free blocks.
  [[nodiscard]] bool prepare_write(int32_t begin, int32_t end, std::vector<BlockCopy>& copies);

  // Gives back every block wholly before `position` (all of whose positions
  // are < position), leaving kDroppedBlock entries. Never re-grows them.
  void drop_blocks_before(int32_t position);

  // A second table sharing every block (parallel sampling).
  BlockTable fork() const;

  // Hashes and registers with the prefix cache each block whose tokens are all
  // computed (positions < num_computed). Cheap when nothing new is full.
  void register_full_blocks(std::span<const TokenId> tokens, int32_t num_computed);

  // Gives every block back, last block first so that a prefix's head blocks
  // are the last to be evicted.
  void release();

 private:
  BlockPool* pool_;
  std::vector<BlockId> blocks_;
  std::vector<BlockHash> hashes_;  // hashes_[i] of full block i, for i < hashes_.size()
  int32_t num_dropped_ = 0;        // blocks_[0, num_dropped_) are kDroppedBlock
  BlockHash root_ = kRootBlockHash;
};

}  // namespace pagedserve
