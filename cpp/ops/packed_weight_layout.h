// The packed weight layout of packed_linear, the one place it is defined.
//
// Why: on a CPU a decode step's matrix products stream every weight once, and
// torch's float32 GEMM also repacks the weight on every call. For a bf16
// checkpoint run in float32 the weights are exactly bf16 values, so storing
// them as bf16 halves the bytes each step reads and changes no weight; the
// arithmetic stays float32-exact (see packed_linear.cc), so outputs match a
// float32 GEMM up to summation order.
//
// A weight W [N, K] (y = x W^T) is cut into column tiles of kPackedCols = 16
// output features, and K is zero-padded to a multiple of kPackedKChunk = 32:
//
//     packed: [ceil(N / 16), K_pad / 2, 32] bfloat16,  K_pad = round_up(K, 32)
//     packed[t, p, 2c + i] = W[16t + c, 2p + i]        (zero past N or K)
//
// i.e. each 64-byte row p of a tile holds the pairs (W[n, 2p], W[n, 2p + 1])
// of its 16 columns. This is the pair ("VNNI") layout AMX's bf16 dot product
// reads as its B operand, 16 rows (one 32-deep K chunk) = one 1 KiB tile
// register, and it serves AVX-512 too: read as 16 little-endian 32-bit words,
// a row widens to the float32 vectors W[16t.., 2p] (shift left 16) and
// W[16t.., 2p + 1] (mask the high half) with no shuffles.
#pragma once

#include <cstdint>

namespace pagedserve {

inline constexpr int64_t kPackedCols = 16;
inline constexpr int64_t kPackedKChunk = 32;

inline int64_t packed_col_tiles(int64_t out_features) { return (out_features + kPackedCols - 1) / kPackedCols; }
inline int64_t packed_k_pairs(int64_t in_features) {
  return (in_features + kPackedKChunk - 1) / kPackedKChunk * (kPackedKChunk / 2);
}

// Element offset of W[n, k] inside the packed tensor.
inline int64_t packed_weight_offset(int64_t n, int64_t k, int64_t in_features) {
  const int64_t tile = n / kPackedCols;
  const int64_t col = n % kPackedCols;
  return (tile * packed_k_pairs(in_features) + k / 2) * (2 * kPackedCols) + 2 * col + k % 2;
}

}  // namespace pagedserve
