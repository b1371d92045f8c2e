#include "block_hash.h"

#include "hash_mix.h"

namespace pagedserve {

BlockHash hash_block(const BlockHash& parent, std::span<const TokenId> tokens) {
  // Two independent lanes (different multipliers and feeds) give 128 bits.
  uint64_t hi = mix64(parent.hi ^ 0x9e3779b97f4a7c15ULL);
  uint64_t lo = mix64(parent.lo + 0xd6e8feb86659fd93ULL);
  for (TokenId token : tokens) {
    const uint64_t t = static_cast<uint32_t>(token);
    hi = mix64(hi ^ (t * 0xff51afd7ed558ccdULL + 1));
    lo = mix64(lo + (t ^ 0xc4ceb9fe1a85ec53ULL) * 0x2545f4914f6cdd1dULL);
  }
  const uint64_t len = tokens.size();
  return BlockHash{mix64(hi ^ len), mix64(lo + len)};
}

BlockHash salted_root_hash(uint64_t salt) {
  if (salt == 0) return kRootBlockHash;
  return BlockHash{mix64(kRootBlockHash.hi ^ salt), mix64(kRootBlockHash.lo + salt * 0x9e3779b97f4a7c15ULL)};
}

}  // namespace pagedserve
