// int8_linear's activations: each row of x quantized to int8 on the fly, with
// a scale per 64-block of K (int8_linear.cc says why and how the kernels use
// the blocks).
#pragma once

#include <cstdint>
#include <vector>

#include "ops/int8_weight_layout.h"
#include "ops/tensor_view.h"

namespace pagedserve::ops {

inline constexpr int64_t kInt8BlockGroups = kInt8KChunk / 4;  // K groups of 4 per activation block
inline constexpr int64_t kInt8RowPad = 16;                    // rows padded for AMX's 16-row tiles

// For block b = K [64b, 64b + 64) of row m: amax = max |x[m, k]|, q[m, k] =
// round_half_even(x[m, k] * (127 / amax)) in [-127, 127] (0 where amax is 0),
// scale[m, b] = amax / 127, offset[m, b] = 128 sum_{k in b} q[m, k] (what the
// u8 weights' +128 adds to the block's dot products).
struct Int8Rows {
  std::vector<int8_t> values;   // [round_up(M, 16), K_pad], 0 in the padding
  std::vector<float> scale;     // [M, K_pad / 64]
  std::vector<int32_t> offset;  // [M, K_pad / 64]
};

// x: [M, K] float32 or bfloat16; k_groups = int8_k_groups(K). Reuses out's storage.
void quantize_int8_rows(const TensorView& x, int64_t k_groups, Int8Rows& out);

}  // namespace pagedserve::ops
