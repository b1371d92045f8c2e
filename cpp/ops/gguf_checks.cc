#include "ops/gguf_checks.h"

#include "ops/gguf_interleaved.h"
#include "ops/op_contracts.h"

namespace pagedserve::ops::gguf {

std::string why_not_interleavable(int64_t rows) {
  if (rows % kInterleavedRows != 0) {
    return "the interleaved layout takes rows in groups of 8, got " + std::to_string(rows);
  }
  return "";
}

const BlockFormat& check_block_matrix(std::string_view op, const TensorView& blocks, int64_t type, int64_t k_size) {
  const BlockFormat& format = block_format(file_type_of(type), std::string(op).c_str());
  require_tensor_of(op, "blocks", blocks, Device::kCPU, 2, DType::kUInt8);
  if (is_interleaved_type(type)) {
    const std::string reason = why_not_interleavable(blocks.size(0));
    PS_REQUIRE(reason.empty(), op, "type " + std::to_string(type) + ": " + reason);
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
