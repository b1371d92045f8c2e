// The int8 weight layout of int8_linear, the one place it is defined.
//
// Why: int8 per-output-channel weights read a quarter of float32's bytes (half
// of bf16's) per decode step, and AVX512-VNNI's `vpdpbusd` multiplies 4 u8 x
// s8 pairs into each of 16 int32 lanes per instruction: 64 multiply-adds, 4x
// a float32 FMA's. It wants, for 16 output columns, one 32-bit word per column
// holding 4 consecutive K values; AMX's int8 B tile is the same rows stacked.
//
// W [N, K] is quantized per output row n: scale[n] = max_k |W[n, k]| / 127,
// q[n, k] = round_half_even(W[n, k] / scale[n]) in [-127, 127], stored as the
// unsigned byte q + 128 (vpdpbusd's unsigned operand; the activations, with a
// scale per 64-block of K, are the signed one). It is cut into column tiles
// of kInt8Cols = 16 and K is padded to a multiple of kInt8KChunk = 64 (one
// AMX tile row of bytes, and one activation block):
//
//     packed: [ceil(N / 16), K_pad / 4, 16] int32,  K_pad = round_up(K, 64)
//     byte j of packed[t, g, c] = q[16t + c, 4g + j] + 128     (128 past N or K)
//
// sum_k x[k] (q[k] + 128) = sum_k x[k] q[k] + 128 sum_k x[k]: the offset is
// taken back per activation block, from the activations alone.
#pragma once

#include <cstdint>

namespace pagedserve {

inline constexpr int64_t kInt8Cols = 16;
inline constexpr int64_t kInt8KChunk = 64;
inline constexpr int32_t kInt8WeightOffset = 128;

inline int64_t int8_col_tiles(int64_t out_features) { return (out_features + kInt8Cols - 1) / kInt8Cols; }
inline int64_t int8_k_groups(int64_t in_features) {
  return (in_features + kInt8KChunk - 1) / kInt8KChunk * (kInt8KChunk / 4);
}

}  // namespace pagedserve
