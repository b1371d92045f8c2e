// CPU ops over GGUF quantized weights kept as the file's raw blocks
// (formats in gguf_blocks.h): a matrix product that decodes the weights tile
// by tile as it goes, a row lookup for quantized embedding tables, and the
// interleaved layout the product runs fastest (gguf_interleaved.h).
//
// blocks: [N, row_bytes] uint8, row n = output feature n (one embedding row),
// its K / block_elems blocks along K; type: the ggml type number (2 Q4_0,
// 3 Q4_1, 8 Q8_0, 12 Q4_K, 13 Q5_K, 14 Q6_K), plus 256 for blocks that
// gguf_interleave rearranged (N a multiple of 8).
// Arithmetic is float32 below the AVX2 level; at AVX2 and above (every
// format) x is first rounded to int8 per 32-element block and multiplied in
// integers (gguf_int8.h). Bad arguments (an unsupported type, a row_bytes
// that does not match K) throw std::invalid_argument.
#pragma once

#include <cstdint>
#include <optional>

#include "ops/tensor_view.h"

namespace pagedserve::ops {

// out = x W^T (+ bias), W as GGUF blocks.
// x: [M, K] float32, contiguous; out: [M, N] float32 with contiguous rows (its
// row stride may exceed N: a column slice of a wider output); bias: [N] float32.
void gguf_linear(const TensorView& out, const TensorView& x, const TensorView& blocks, int64_t type,
                 const std::optional<TensorView>& bias);

// out[r] = row ids[r] of W, decoded.  out: [R, K] float32; ids: [R] int32 or int64,
// each in [0, N).
void gguf_dequantize_rows(const TensorView& out, const TensorView& blocks, int64_t type, const TensorView& ids);

// The type number of `type`'s interleaved layout where this process's gguf_linear has a kernel for it
// (`rows` a multiple of 8, at the AVX2 level and above), else -1.
int64_t gguf_interleaved_type(int64_t type, int64_t rows);

// out = blocks of file type `type` (N a multiple of 8) in the interleaved layout
// (same shape, uint8; not in place): gguf_linear's and gguf_dequantize_rows' blocks of type
// type + 256 at any ISA level (below AVX2 they run through the file's layout again, so loading
// interleaves only where gguf_interleaved_type says it pays).
void gguf_interleave(const TensorView& out, const TensorView& blocks, int64_t type);

}  // namespace pagedserve::ops
