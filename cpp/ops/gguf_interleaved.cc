// gguf_interleaved.h's byte permutation, both ways.
#include "ops/gguf_interleaved.h"

#include <cstring>
#include <string>

#include "ops/op_contracts.h"
#include "ops/parallel.h"

namespace pagedserve::ops::gguf {
namespace {

// A block's parts: float16 scales first (Q4_1: d and m), then code bytes.
struct BlockParts {
  int header;
  int codes;
  explicit BlockParts(BlockType type)
      : header(type == BlockType::kQ4_1 ? 4 : 2),
        codes(block_format(static_cast<int64_t>(type), "gguf interleave").bytes - header) {}
  int64_t bytes() const { return header + codes; }
};

// Calls move(group_offset, row_offset, bytes) for every piece of row r's block in a group's block:
// each float16 (2 bytes) and each run of 4 code bytes. Offsets are within the block.
template <typename Move>
void for_each_piece(const BlockParts& parts, int r, Move move) {
  for (int half = 0; half < parts.header / 2; ++half) move(16 * half + 2 * r, 2 * half, 2);
  for (int chunk = 0; chunk < parts.codes / 4; ++chunk) {
    move(kInterleavedRows * parts.header + 32 * chunk + 4 * r, parts.header + 4 * chunk, 4);
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

const BlockFormat& check_block_matrix(std::string_view op, const TensorView& blocks, int64_t type, int64_t k_size) {
  const BlockFormat& format = block_format(file_type_of(type), std::string(op).c_str());
  require_tensor_of(op, "blocks", blocks, Device::kCPU, 2, DType::kUInt8);
  if (is_interleaved_type(type)) {
    PS_REQUIRE(has_interleaved_layout(format.type), op,
               std::string(format.name) + " has no interleaved layout (type " + std::to_string(type) + ")");
    PS_REQUIRE(blocks.size(0) % kInterleavedRows == 0, op,
               "interleaved blocks come in groups of 8 rows, got " + std::to_string(blocks.size(0)));
  }
  PS_REQUIRE(k_size % format.elems == 0, op,
             "K = " + std::to_string(k_size) + " is not a multiple of " + format.name + "'s " +
                 std::to_string(format.elems) + "-weight blocks");
  PS_REQUIRE(blocks.size(1) == k_size / format.elems * format.bytes, op,
             "blocks has " + std::to_string(blocks.size(1)) + " bytes per row; " + format.name + " rows of K = " +
                 std::to_string(k_size) + " take " + std::to_string(k_size / format.elems * format.bytes));
  return format;
}

}  // namespace pagedserve::ops::gguf
