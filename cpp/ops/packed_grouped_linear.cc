// pack_grouped_weight / packed_grouped_linear: grouped_linear (layout:
// grouped_linear.h) with each expert's weight in packed_linear's bf16 tiles
// (packed_weight_layout.h), for float32 models on a CPU. An expert is one
// packed_linear over its rows, which streams its weights once per call with
// the column tiles split across threads: a decode step's few rows per expert
// cost about one read of the routed experts' weights.
#include <optional>

#include "ops/op_contracts.h"
#include "ops/ops.h"
#include "ops/packed_weight_layout.h"

namespace pagedserve::ops {
namespace {

// t[index] of a contiguous tensor: the same data, one dim less.
TensorView slice0(const TensorView& t, int64_t index) {
  TensorView v = t;
  v.ndim = t.ndim - 1;
  for (int d = 0; d < v.ndim; ++d) {
    v.shape[static_cast<size_t>(d)] = t.shape[static_cast<size_t>(d + 1)];
    v.strides[static_cast<size_t>(d)] = t.strides[static_cast<size_t>(d + 1)];
  }
  v.data = static_cast<char*>(t.data) + index * t.stride(0) * element_size(t.dtype);
  return v;
}

// Rows [begin, end) of a contiguous tensor.
TensorView rows_of(const TensorView& t, int64_t begin, int64_t end) {
  TensorView v = t;
  v.shape[0] = end - begin;
  v.data = static_cast<char*>(t.data) + begin * t.stride(0) * element_size(t.dtype);
  return v;
}

}  // namespace

void pack_grouped_weight(const TensorView& packed, const TensorView& weight) {
  constexpr std::string_view op = "pack_grouped_weight";
  require_float_tensor(op, "weight", weight, Device::kCPU, 3);
  require_tensor_of(op, "packed_weight", packed, Device::kCPU, 4, DType::kBFloat16);
  require_size(op, "packed_weight", packed, 0, weight.size(0));
  for (int64_t e = 0; e < weight.size(0); ++e) pack_linear_weight(slice0(packed, e), slice0(weight, e));
}

void packed_grouped_linear(const TensorView& out, const TensorView& x, const TensorView& packed_weight,
                           const TensorView& expert_offsets) {
  constexpr std::string_view op = "packed_grouped_linear";
  require_tensor_of(op, "x", x, Device::kCPU, 2, DType::kFloat32);
  require_tensor_of(op, "out", out, Device::kCPU, 2, DType::kFloat32);
  require_size(op, "out", out, 0, x.size(0));
  require_tensor_of(op, "packed_weight", packed_weight, Device::kCPU, 4, DType::kBFloat16);
  require_size(op, "packed_weight", packed_weight, 1, packed_col_tiles(out.size(1)));
  require_size(op, "packed_weight", packed_weight, 2, packed_k_pairs(x.size(1)));
  require_tensor_of(op, "expert_offsets", expert_offsets, Device::kCPU, 1, DType::kInt32);
  const int64_t experts = packed_weight.size(0);
  require_expert_offsets(op, expert_offsets, experts, x.size(0));
  const int32_t* offsets = expert_offsets.ptr<int32_t>();
  for (int64_t e = 0; e < experts; ++e) {
    if (offsets[e + 1] == offsets[e]) continue;  // no rows: its weights are not read
    packed_linear(rows_of(out, offsets[e], offsets[e + 1]), rows_of(x, offsets[e], offsets[e + 1]),
                  slice0(packed_weight, e), std::nullopt);
  }
}

}  // namespace pagedserve::ops
