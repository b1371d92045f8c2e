// The argument rules the GGUF ops (gguf_ops.h) share, each written once.
// Violations throw std::invalid_argument("<op>: ..."), a ValueError in Python.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "ops/gguf_blocks.h"
#include "ops/tensor_view.h"

namespace pagedserve::ops::gguf {

// `blocks` as a matrix [N, row_bytes] uint8 of ggml type `type`, in the file's layout or interleaved
// (type + 256, gguf_interleaved.h), for rows of k_size weights; returns the format.
const BlockFormat& check_block_matrix(std::string_view op, const TensorView& blocks, int64_t type, int64_t k_size);

// Why `rows` rows cannot take the interleaved layout (every format has one), or "" where they can.
std::string why_not_interleavable(int64_t rows);

}  // namespace pagedserve::ops::gguf
