// BlockPool: the metadata of every KV block, allocated once.
//
// The pool owns no tensor memory. The runner's KV tensors are indexed by the
// BlockIds handed out here; the pool only tracks who holds which block:
//
//   * a refcount per block (a block shared by forked sequences or by a prefix
//     cache hit has refcount > 1);
//   * a LIFO stack of free blocks whose content is worthless;
//   * with prefix caching on, an index from BlockHash to the block holding that
//     content, and an intrusive LRU list of cached blocks nobody holds
//     (refcount 0). Such blocks still count as free: allocate() evicts the
//     least recently released one when the free stack is empty, while a
//     prefix hit revives one in O(1).
//
// allocate / incref / decref / lookup are O(1). Exhaustion is reported with
// std::nullopt, never an exception; misuse (bad id, decref of a free block)
// throws std::logic_error.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include "block_hash.h"
#include "core_types.h"

namespace pagedserve {

// What a block is doing, for stats and the engine view.
enum class BlockState : uint8_t {
  kFree = 0,       // on the free stack, content worthless
  kInUse = 1,      // held by exactly one table
  kShared = 2,     // held by more than one table (fork or prefix hit)
  kEvictable = 3,  // held by nobody, content cached for prefix hits
};

struct PrefixCacheCounters {
  int64_t queried_blocks = 0;  // full blocks looked up at admission
  int64_t hit_blocks = 0;      // of those, found in the cache
  int64_t evictions = 0;       // cached blocks reclaimed by allocate()
};

class BlockPool {
 public:
  BlockPool(int32_t num_blocks, int32_t block_size, bool enable_prefix_caching);
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  // A block with refcount 1, or nullopt when every block is held.
  [[nodiscard]] std::optional<BlockId> allocate();
  void incref(BlockId block);
  // At refcount 0 a cached block becomes evictable, any other block free.
  void decref(BlockId block);

  // Keeps `block` from being handed out again until end_step(), even if its
  // refcount drops to 0: it is the source of a copy-on-write copy the runner
  // has not applied yet, and must not become another copy's destination.
  void pin_until_step_end(BlockId block);
  void end_step();

  int32_t refcount(BlockId block) const { return meta_.at(checked(block)).refcount; }
  int32_t num_blocks() const { return static_cast<int32_t>(meta_.size()); }
  int32_t block_size() const { return block_size_; }
  // Blocks allocate() can hand out now: free plus evictable.
  int32_t num_free() const { return static_cast<int32_t>(free_stack_.size()) + num_evictable_; }
  int32_t num_evictable() const { return num_evictable_; }
  int32_t num_used() const { return num_blocks() - num_free(); }
  // Sum of all refcounts; total_refs() - num_used() blocks are saved by sharing.
  int64_t total_refs() const { return total_refs_; }

  // --- prefix cache -------------------------------------------------------
  bool prefix_caching_enabled() const { return prefix_caching_; }
  // The cached block for `hash` if its stored tokens equal `tokens`.
  std::optional<BlockId> find_cached(const BlockHash& hash, std::span<const TokenId> tokens) const;
  // Makes a full, computed block findable by `hash`. Returns false (and
  // changes nothing) if caching is off or another block already holds it.
  bool register_block(BlockId block, const BlockHash& hash, std::span<const TokenId> tokens);
  bool is_cached(BlockId block) const { return meta_.at(checked(block)).cached; }
  void record_lookup(int32_t queried_blocks, int32_t hit_blocks);
  const PrefixCacheCounters& prefix_counters() const { return counters_; }

  BlockState state(BlockId block) const;
  std::vector<uint8_t> block_states() const;  // BlockState per block, for views
  // Throws std::logic_error describing the first broken invariant (tests).
  void check_invariants() const;

 private:
  static constexpr int32_t kNil = -1;  // end of an intrusive LRU link
  struct BlockMeta {
    int32_t refcount = 0;
    bool cached = false;
    bool pinned = false;
    int32_t lru_prev = kNil;
    int32_t lru_next = kNil;
    BlockHash hash{};
  };

  BlockId checked(BlockId block) const;
  void lru_push_back(BlockId block);
  void lru_remove(BlockId block);
  void uncache(BlockId block);
  void release_unheld(BlockId block);  // to the LRU list if cached, else the free stack

  int32_t block_size_;
  bool prefix_caching_;
  std::vector<BlockMeta> meta_;
  std::vector<BlockId> free_stack_;  // top = most recently freed
  std::vector<BlockId> pinned_;      // pinned this step
  int32_t lru_head_ = kNil;          // least recently released
  int32_t lru_tail_ = kNil;
  int32_t num_evictable_ = 0;
  int64_t total_refs_ = 0;
  std::unordered_map<BlockHash, BlockId, BlockHashHasher> index_;
  std::vector<TokenId> cached_tokens_;  // [num_blocks * block_size], verified on lookup
  PrefixCacheCounters counters_;
};

}  // namespace pagedserve
