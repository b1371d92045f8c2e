// qkv_rope_cache on the CPU: the reference of the fused CUDA kernel
// (cuda/qkv_rope_cache.cu), built from the unfused ops it replaces so the two
// paths agree by construction: the q / k / v column slices copied out,
// rms_norm of each q and k head (with a QkNorm), rotary_embedding on q and k,
// reshape_and_cache for k and v. And
// qkv_linear_rope_cache's (cuda/qkv_linear_rope_cache.cu): small_batch_linear
// into a qkv buffer, then qkv_rope_cache.
#include <cstring>
#include <vector>

#include "ops/op_contracts.h"
#include "ops/ops.h"

namespace pagedserve::ops {
namespace {

// A contiguous CPU view of `bytes` laid out as dtype [d0, d1, d2].
TensorView view3(std::vector<unsigned char>& bytes, DType dtype, int64_t d0, int64_t d1, int64_t d2) {
  TensorView v;
  v.data = bytes.data();
  v.dtype = dtype;
  v.ndim = 3;
  v.shape = {d0, d1, d2};
  v.strides = {d1 * d2, d2, 1};
  return v;
}

// A contiguous tensor seen as [d0, d1].
TensorView view2_of(const TensorView& t, int64_t d0, int64_t d1) {
  TensorView v = t;
  v.ndim = 2;
  v.shape = {d0, d1};
  v.strides = {d1, 1};
  return v;
}

TensorView view2(std::vector<unsigned char>& bytes, DType dtype, int64_t d0, int64_t d1) {
  TensorView v = view3(bytes, dtype, d0, d1, 1);
  v.ndim = 2;
  v.shape = {d0, d1};
  v.strides = {d1, 1};
  return v;
}

}  // namespace

void qkv_rope_cache(const TensorView& query_out, const TensorView& qkv, const TensorView& positions,
                    const TensorView& cos_sin, const TensorView& key_cache, const TensorView& value_cache,
                    const TensorView& slot_mapping, const QkNorm& norm) {
  check_qkv_rope_cache(Device::kCPU, query_out, qkv, positions, cos_sin, key_cache, value_cache, slot_mapping, norm);
  const int64_t tokens = qkv.size(0), q_heads = query_out.size(1), kv_heads = key_cache.size(1);
  const int64_t d = query_out.size(2), elem = element_size(qkv.dtype);
  const int64_t q_bytes = q_heads * d * elem, kv_bytes = kv_heads * d * elem, row_bytes = q_bytes + 2 * kv_bytes;
  std::vector<unsigned char> key(static_cast<size_t>(tokens * kv_bytes)), value(key.size());
  const auto* rows = static_cast<const unsigned char*>(qkv.data);
  for (int64_t t = 0; t < tokens; ++t) {
    const unsigned char* row = rows + t * row_bytes;
    std::memcpy(static_cast<unsigned char*>(query_out.data) + t * q_bytes, row, static_cast<size_t>(q_bytes));
    std::memcpy(key.data() + t * kv_bytes, row + q_bytes, static_cast<size_t>(kv_bytes));
    std::memcpy(value.data() + t * kv_bytes, row + q_bytes + kv_bytes, static_cast<size_t>(kv_bytes));
  }
  const TensorView key_view = view3(key, qkv.dtype, tokens, kv_heads, d);
  const TensorView value_view = view3(value, qkv.dtype, tokens, kv_heads, d);
  if (norm.applies()) {  // each head a row of D: rms_norm in place (it reads a row before writing it)
    const TensorView query_rows = view2_of(query_out, tokens * q_heads, d);
    const TensorView key_rows = view2_of(key_view, tokens * kv_heads, d);
    rms_norm(query_rows, query_rows, norm.q_weight, norm.eps);
    rms_norm(key_rows, key_rows, norm.k_weight, norm.eps);
  }
  rotary_embedding(positions, query_out, key_view, cos_sin);
  reshape_and_cache(key_view, value_view, key_cache, value_cache, slot_mapping);
}

void qkv_linear_rope_cache(const TensorView& query_out, const TensorView& x, const TensorView& weight,
                           const TensorView& bias, const TensorView& positions, const TensorView& cos_sin,
                           const TensorView& key_cache, const TensorView& value_cache,
                           const TensorView& slot_mapping) {
  check_qkv_linear_rope_cache(Device::kCPU, query_out, x, weight, bias, positions, cos_sin, key_cache, value_cache,
                              slot_mapping);
  std::vector<unsigned char> bytes(static_cast<size_t>(x.size(0) * weight.size(0) * element_size(x.dtype)));
  const TensorView qkv = view2(bytes, x.dtype, x.size(0), weight.size(0));
  small_batch_linear(qkv, x, weight, bias, false);
  qkv_rope_cache(query_out, qkv, positions, cos_sin, key_cache, value_cache, slot_mapping);
}

}  // namespace pagedserve::ops
