// gguf_interleaved.h's byte permutation, both ways.
#include "ops/gguf_interleaved.h"

#include <cstring>

#include "ops/parallel.h"

namespace pagedserve::ops::gguf {
namespace {

// A block's parts (gguf_interleaved.h's geometry).
struct BlockParts {
  int header;         // float16 scales' bytes
  int codes;          // bytes moved 4 at a time
  int header_offset;  // where the file's layout keeps them
  int codes_offset;
  explicit BlockParts(BlockType type)
      : header(scale_bytes(type)), codes(code_bytes(type)), header_offset(file_scale_offset(type)),
        codes_offset(file_code_offset(type)) {}
  int64_t bytes() const { return header + codes; }
};

// Calls move(group_offset, row_offset, bytes) for every piece of row r's block in a group's block:
// each float16 (2 bytes) and each run of 4 code bytes. Offsets are within the block.
template <typename Move>
void for_each_piece(const BlockParts& parts, int r, Move move) {
  for (int half = 0; half < parts.header / 2; ++half) move(16 * half + 2 * r, parts.header_offset + 2 * half, 2);
  for (int chunk = 0; chunk < parts.codes / 4; ++chunk) {
    move(kInterleavedRows * parts.header + 32 * chunk + 4 * r, parts.codes_offset + 4 * chunk, 4);
  }
}

// Copies between the file's layout (rows) and the interleaved one (group) for groups [begin, end);
// to_group chooses the direction.
void permute(BlockType type, const uint8_t* src, uint8_t* dst, int64_t begin, int64_t end, int64_t row_bytes,
             bool to_group) {
  const BlockParts parts(type);
  const int64_t block_bytes = parts.bytes();
  const int64_t group_bytes = kInterleavedRows * row_bytes;
  for (int64_t g = begin; g < end; ++g) {
    for (int r = 0; r < kInterleavedRows; ++r) {
      for (int64_t b = 0; b < row_bytes / block_bytes; ++b) {
        const int64_t group_block = g * group_bytes + b * kInterleavedRows * block_bytes;
        const int64_t row_block = (kInterleavedRows * g + r) * row_bytes + b * block_bytes;
        for_each_piece(parts, r, [&](int64_t group_offset, int64_t row_offset, size_t bytes) {
          if (to_group) {
            std::memcpy(dst + group_block + group_offset, src + row_block + row_offset, bytes);
          } else {
            std::memcpy(dst + row_block + row_offset, src + group_block + group_offset, bytes);
          }
        });
      }
    }
  }
}

}  // namespace

void interleave_rows(BlockType type, const uint8_t* src, uint8_t* dst, int64_t rows, int64_t row_bytes) {
  parallel_for_range(rows / kInterleavedRows, kInterleavedRows * row_bytes, [&](int64_t begin, int64_t end) {
    permute(type, src, dst, begin, end, row_bytes, true);
  });
}

void deinterleave_groups(BlockType type, const uint8_t* src, uint8_t* dst, int64_t groups, int64_t row_bytes) {
  permute(type, src, dst, 0, groups, row_bytes, false);
}

void deinterleave_row(BlockType type, const uint8_t* src, int64_t n, uint8_t* dst, int64_t row_bytes) {
  const BlockParts parts(type);
  const int64_t block_bytes = parts.bytes();
  const int64_t group = n / kInterleavedRows;
  const int r = static_cast<int>(n % kInterleavedRows);
  for (int64_t b = 0; b < row_bytes / block_bytes; ++b) {
    const uint8_t* group_block = src + group * kInterleavedRows * row_bytes + b * kInterleavedRows * block_bytes;
    for_each_piece(parts, r, [&](int64_t group_offset, int64_t row_offset, size_t bytes) {
      std::memcpy(dst + b * block_bytes + row_offset, group_block + group_offset, bytes);
    });
  }
}

}  // namespace pagedserve::ops::gguf
