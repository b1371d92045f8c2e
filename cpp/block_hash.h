// Content hash of one full KV block, chained from its parent block's hash.
//
// Two blocks get the same hash only if their whole token prefix (every token
// from position 0 to the end of the block) is the same. The hash is 128 bits
// wide and the pool verifies the block's own tokens on every lookup, so a
// false prefix-cache hit needs a 128-bit collision of the chain.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "core_types.h"

namespace pagedserve {

struct BlockHash {
  uint64_t hi = 0;
  uint64_t lo = 0;
  friend bool operator==(const BlockHash&, const BlockHash&) = default;
};

// Hash of the (empty) prefix before the first block.
inline constexpr BlockHash kRootBlockHash{0x243f6a8885a308d3ULL, 0x13198a2e03707344ULL};

BlockHash hash_block(const BlockHash& parent, std::span<const TokenId> tokens);

// The root of a salted chain: sequences whose equal tokens must not share KV
// (e.g. longrope prompts on either side of the original context, whose keys
// are rotated differently) hash from different roots. Salt 0 is kRootBlockHash.
BlockHash salted_root_hash(uint64_t salt);

struct BlockHashHasher {
  size_t operator()(const BlockHash& h) const noexcept { return static_cast<size_t>(h.lo ^ (h.hi >> 1)); }
};

}  // namespace pagedserve
