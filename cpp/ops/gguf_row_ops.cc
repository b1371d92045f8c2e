// The GGUF ops on rows rather than products (gguf_ops.h): the embedding
// lookup, and the load-time change of layout that gguf_linear runs fastest
// (gguf_interleaved.h).
#include <string>
#include <vector>

#include "ops/cpu_isa.h"
#include "ops/gguf_blocks.h"
#include "ops/gguf_checks.h"
#include "ops/gguf_int8.h"
#include "ops/gguf_interleaved.h"
#include "ops/gguf_ops.h"
#include "ops/op_contracts.h"

namespace pagedserve::ops {

using gguf::BlockFormat;
using gguf::BlockType;

void gguf_dequantize_rows(const TensorView& out, const TensorView& blocks, int64_t type, const TensorView& ids) {
  constexpr std::string_view op = "gguf_dequantize_rows";
  require_tensor_of(op, "out", out, Device::kCPU, 2, DType::kFloat32);
  require_tensor(op, "ids", ids, Device::kCPU, 1);
  PS_REQUIRE(ids.dtype == DType::kInt32 || ids.dtype == DType::kInt64, op,
             "ids must be int32 or int64, got " + std::string(dtype_name(ids.dtype)));
  const int64_t k_size = out.size(1);
  const BlockFormat& format = gguf::check_block_matrix(op, blocks, type, k_size);
  require_size(op, "out", out, 0, ids.size(0));
  const int64_t n_size = blocks.size(0);
  auto id_at = [&](int64_t r) {
    return ids.dtype == DType::kInt32 ? int64_t{ids.ptr<int32_t>()[r]} : ids.ptr<int64_t>()[r];
  };
  for (int64_t r = 0; r < ids.size(0); ++r) {
    const int64_t id = id_at(r);
    PS_REQUIRE(id >= 0 && id < n_size, op,
               "ids[" + std::to_string(r) + "] = " + std::to_string(id) + " is outside [0, " +
                   std::to_string(n_size) + ")");
  }
  const uint8_t* data = blocks.ptr<uint8_t>();
  float* dst = out.ptr<float>();
  const int64_t row_bytes = blocks.size(1);
  std::vector<uint8_t> row;  // an interleaved matrix's row, back in the file's layout
  if (gguf::is_interleaved_type(type)) row.resize(static_cast<size_t>(row_bytes));
  const auto row_at = [&](int64_t id) {
    if (row.empty()) return data + id * row_bytes;
    gguf::deinterleave_row(format.type, data, id, row.data(), row_bytes);
    return static_cast<const uint8_t*>(row.data());
  };
  gguf::dispatch_block_type(format.type, [&]<BlockType kType>() {
    with_cpu_isa([&]() PS_INLINE_BODY {
      for (int64_t r = 0; r < ids.size(0); ++r) {
        gguf::decode_blocks<kType>(row_at(id_at(r)), k_size / format.elems, dst + r * k_size);
      }
    });
  });
}

int64_t gguf_interleaved_type(int64_t type, int64_t rows) {
  const BlockFormat& format = gguf::block_format(type, "gguf_interleaved_type");
  const bool applies = gguf::why_not_interleavable(rows).empty() && gguf::int8_activations_apply(format.type);
  return applies ? type | gguf::kInterleavedTypeFlag : -1;
}

void gguf_interleave(const TensorView& out, const TensorView& blocks, int64_t type) {
  constexpr std::string_view op = "gguf_interleave";
  const BlockFormat& format = gguf::block_format(type, std::string(op).c_str());
  require_tensor_of(op, "blocks", blocks, Device::kCPU, 2, DType::kUInt8);
  const std::string reason = gguf::why_not_interleavable(blocks.size(0));
  PS_REQUIRE(reason.empty(), op, reason);
  PS_REQUIRE(blocks.size(1) % format.bytes == 0, op,
             std::to_string(blocks.size(1)) + " bytes per row is not a whole number of " + format.name + " blocks");
  require_tensor_of(op, "out", out, Device::kCPU, 2, DType::kUInt8);
  require_size(op, "out", out, 0, blocks.size(0));
  require_size(op, "out", out, 1, blocks.size(1));
  PS_REQUIRE(out.ptr<uint8_t>() != blocks.ptr<uint8_t>(), op, "out must be another tensor than blocks (not in place)");
  gguf::interleave_rows(format.type, blocks.ptr<uint8_t>(), out.ptr<uint8_t>(), blocks.size(0), blocks.size(1));
}

}  // namespace pagedserve::ops
