// GGUF blocks of eight weight rows interleaved, made once at load
// (gguf_interleave) for the int8-activation kernels (gguf_int8.h).
//
// Why: in the file's layout a decode step (M = 1) multiplies one row's block
// at a time, and each block's 32 products end in 8 int32 lanes that need a
// conversion, two multiply-adds and, at the end, a horizontal sum: ~22
// instructions per 20-byte Q4_1 block, which bounds the default model's
// decode by instructions, not memory (Zen 3, one thread: ~5.3 cycles a block;
// the 2-core Intel host: 72 tok/s). Interleaved, the same block of eight rows
// lies side by side so that int32 lane r of one register is row r: a
// broadcast of 4 activation bytes meets 4 weights of each of the 8 rows in
// one vpdpbusd, the 8 rows' scales convert in one instruction, and no lane
// sum remains (~6 instructions a row-block on AVX2). The same layout serves
// every M (prefill too), so results stay batch invariant. Measured at M = 1,
// weights in cache, 2 cores of an Intel (AMX) host, file layout ->
// interleaved: Q4_1 gate/up 3072 x 576 16.4 -> 50.9 GB/s; the default
// model's decode at batch 1 70 -> 114 tok/s on that instance, 85 -> 143 on
// another (bench/results/intel_amx/session26.md).
//
// Layout: the rows of a matrix [N, row_bytes] (N a multiple of 8) in groups
// of 8; group g (rows 8g .. 8g + 7) takes the same bytes as those rows did,
// at g * 8 * row_bytes, block b of the group at b * 8 * block_bytes:
//
//   Q4_0  d[8] (float16, row r at 2r), then 4 chunks of 32 code bytes
//   Q4_1  d[8], m[8], then 4 chunks of 32 code bytes
//   Q8_0  d[8], then 8 chunks of 32 code bytes
//   Q4_K  d[8], dmin[8], then 3 chunks of the 12 scale bytes, then 32 chunks
//         of the 128 code bytes (a 256-weight super-block)
//   Q5_K  as Q4_K, with the 8 chunks of qh[32] between the scales and codes
//   Q6_K  d[8] (the file's last 2 bytes of a block), then 52 chunks of its
//         first 208: ql (32 chunks), qh (16), the 16 int8 scales (4)
//
// Chunk c's byte 4r + i is row r's byte 4c + i of the block after its float16
// scales: Q4's byte j holds weights j (low nibble) and j + 16 (high), so
// chunk c's low nibbles are weights 4c .. 4c + 3 of each row and its high
// nibbles weights 16 + 4c ..; Q8_0's chunk c holds weights 4c .. 4c + 3.
// Q4_K's code byte 32 p + j holds weight j of sub-block 2 p (low nibble) and
// of 2 p + 1 (high), so code chunk 8 p + c serves weights 4c .. 4c + 3 of
// both; its scale chunk c holds scale bytes 4c .. 4c + 3, row r in int32
// lane r, which is what its kernel unpacks 8 rows at a time (Q6_K's scales
// alike). Nothing is decoded or rounded: the bytes are permuted, and
// deinterleave_groups undoes it exactly.
//
// Type numbers: an interleaved matrix carries its format's ggml type number
// plus kInterleavedTypeFlag (Q4_1: 3 + 256), so the ops (gguf_ops.h) know
// which layout they read.
#pragma once

#include <cstdint>

#include "ops/gguf_blocks.h"

namespace pagedserve::ops::gguf {

inline constexpr int kInterleavedRows = 8;
inline constexpr int64_t kInterleavedTypeFlag = 256;

// Every format's block geometry, the one place the kernels and the permutation take it from: the float16
// scales (Q4_1: d and m; Q4_K: d and dmin; first in a block, Q6_K's d last), and the bytes moved 4 at
// a time (the K-quants' scale bytes too), first in the interleaved block and then the rest.
constexpr int scale_bytes(BlockType t) {
  return t == BlockType::kQ4_1 || t == BlockType::kQ4_K || t == BlockType::kQ5_K ? 4 : 2;
}
constexpr int code_bytes(BlockType t) {
  switch (t) {
    case BlockType::kQ8_0: return 32;
    case BlockType::kQ4_K: return 12 + 128;
    case BlockType::kQ5_K: return 12 + 32 + 128;
    case BlockType::kQ6_K: return 208;
    default: return 16;
  }
}
// Where a block of the file's layout keeps them: the scales' offset and the chunks'.
constexpr int file_scale_offset(BlockType t) { return t == BlockType::kQ6_K ? code_bytes(t) : 0; }
constexpr int file_code_offset(BlockType t) { return t == BlockType::kQ6_K ? 0 : scale_bytes(t); }
constexpr int block_bytes(BlockType t) { return scale_bytes(t) + code_bytes(t); }

// Type numbers: negative ones are no type, and stay as they are (block_format rejects them).
inline bool is_interleaved_type(int64_t type) { return type >= 0 && (type & kInterleavedTypeFlag) != 0; }
inline int64_t file_type_of(int64_t type) { return is_interleaved_type(type) ? type & ~kInterleavedTypeFlag : type; }

// src [rows, row_bytes] in the file's layout -> dst in the interleaved one (rows a multiple of 8).
void interleave_rows(BlockType type, const uint8_t* src, uint8_t* dst, int64_t rows, int64_t row_bytes);

// The inverse: `groups` groups of 8 interleaved rows -> 8 * groups rows in the file's layout.
void deinterleave_groups(BlockType type, const uint8_t* src, uint8_t* dst, int64_t groups, int64_t row_bytes);

// Row n of an interleaved matrix, in the file's layout (row_bytes bytes at dst).
void deinterleave_row(BlockType type, const uint8_t* src, int64_t n, uint8_t* dst, int64_t row_bytes);

}  // namespace pagedserve::ops::gguf
