#include "ops/op_contracts.h"

#include <cmath>
#include <string>

#include "ops/kv_cache_layout.h"
#include "ops/packed_weight_layout.h"
#include "ops/token_mask.h"

namespace pagedserve::ops {
namespace {

// One op's checks: binds its name and device, and holds its first tensor,
// which every later tensor must share a GPU with.
class Args {
 public:
  Args(std::string_view op, Device device) : op_(op), device_(device) {}

  void tensor(std::string_view arg, const TensorView& t, int ndim) {
    require_tensor(op_, arg, t, device_, ndim);
    if (first_ == nullptr) {
      first_ = &t;
    } else {
      require_same_device(op_, arg, t, *first_);
    }
  }
  void floats(std::string_view arg, const TensorView& t, int ndim) {
    tensor(arg, t, ndim);
    require_float(op_, arg, t);
  }
  void of(std::string_view arg, const TensorView& t, int ndim, DType dtype) {
    tensor(arg, t, ndim);
    require_dtype(op_, arg, t, dtype);
  }
  // The dims, dtype and shape of `ref`.
  void like(std::string_view arg, const TensorView& t, const TensorView& ref) {
    tensor(arg, t, ref.ndim);
    same_dtype(arg, t, ref);
    for (int dim = 0; dim < ref.ndim; ++dim) require_size(op_, arg, t, dim, ref.size(dim));
  }
  // A layer's caches: key_cache [N, Hkv, B, head_dim] of `ref`'s dtype (or, on
  // the CPU under float32 `ref`, bf16: a bf16 KV cache), value_cache like it.
  void kv_caches(const TensorView& key_cache, const TensorView& value_cache, const TensorView& ref,
                 int64_t head_dim) {
    floats("key_cache", key_cache, 4);
    const bool bf16_cache = ref.dtype == DType::kFloat32 && key_cache.dtype == DType::kBFloat16;
    PS_REQUIRE(key_cache.dtype == ref.dtype || (bf16_cache && device_ == Device::kCPU), op_,
               "key_cache must have the same dtype as the other inputs (" + std::string(dtype_name(ref.dtype)) +
                   (device_ == Device::kCPU && ref.dtype == DType::kFloat32 ? ") or be bfloat16" : ")") +
                   ", got " + key_cache.describe() +
                   (bf16_cache ? " (on CUDA the KV cache has the model's dtype: kv_cache_dtype auto)" : ""));
    size("key_cache", key_cache, 3, head_dim);
    like("value_cache", value_cache, key_cache);
  }
  void same_dtype(std::string_view arg, const TensorView& t, const TensorView& ref) const {
    require_same_dtype(op_, arg, t, ref);
  }
  void size(std::string_view arg, const TensorView& t, int dim, int64_t extent) const {
    require_size(op_, arg, t, dim, extent);
  }
  // Index tensors are readable here only on the CPU.
  bool reads_indices() const { return device_ == Device::kCPU; }
  std::string_view op() const { return op_; }

 private:
  std::string_view op_;
  Device device_;
  const TensorView* first_ = nullptr;
};

void check_norm(Device device, std::string_view op, std::string_view out_name, const TensorView& out,
                const TensorView& x, const TensorView& weight) {
  Args a(op, device);
  a.floats("x", x, 2);
  a.like(out_name, out, x);
  a.floats("weight", weight, 1);
  a.same_dtype("weight", weight, x);
  a.size("weight", weight, 0, x.size(1));
  PS_REQUIRE(x.size(1) > 0, op, "x must have a non-empty last dim, got " + x.describe());
}

// Query ranges must tile a prefix of the tokens; each sequence's context must
// hold its queries, fit its block table and name existing blocks where the
// kernel reads them (from the first query's window on).
void check_attention_batch(std::string_view op, const TensorView& query, const TensorView& key_cache,
                           const TensorView& block_tables, const TensorView& query_start_loc,
                           const TensorView& seq_lens, const AttentionOptions& options) {
  const int32_t* starts = query_start_loc.ptr<int32_t>();
  const int32_t* lens = seq_lens.ptr<int32_t>();
  const int64_t num_seqs = seq_lens.size(0);
  const int64_t max_blocks = block_tables.size(1);
  const int64_t num_blocks = key_cache.size(0);
  const int64_t block_size = key_cache.size(2);
  PS_REQUIRE(starts[0] >= 0 && starts[num_seqs] <= query.size(0), op,
             "query_start_loc must lie within the " + std::to_string(query.size(0)) + " query tokens, got [" +
                 std::to_string(starts[0]) + ", " + std::to_string(starts[num_seqs]) + "]");
  for (int64_t s = 0; s < num_seqs; ++s) {
    const std::string row = "sequence " + std::to_string(s) + ": ";
    const int64_t q_len = int64_t{starts[s + 1]} - starts[s];
    PS_REQUIRE(q_len >= 0, op, row + "query_start_loc must be non-decreasing");
    if (q_len == 0) continue;
    PS_REQUIRE(lens[s] >= q_len, op,
               row + "seq_lens = " + std::to_string(lens[s]) + " is shorter than its " + std::to_string(q_len) +
                   " queries");
    const int64_t blocks_needed = (int64_t{lens[s]} + block_size - 1) / block_size;
    PS_REQUIRE(blocks_needed <= max_blocks, op,
               row + "seq_lens = " + std::to_string(lens[s]) + " needs " + std::to_string(blocks_needed) +
                   " blocks, the block table has " + std::to_string(max_blocks));
    const int32_t* table = block_tables.ptr<int32_t>() + s * max_blocks;
    const int64_t first_read = options.first_visible(lens[s] - q_len) / block_size;
    for (int64_t i = first_read; i < blocks_needed; ++i) {
      PS_REQUIRE(table[i] >= 0 && table[i] < num_blocks, op,
                 row + "block_tables[" + std::to_string(i) + "] = " + std::to_string(table[i]) +
                     " is not a block id in [0, " + std::to_string(num_blocks) + ")");
    }
  }
}

}  // namespace

void require_tensor(std::string_view op, std::string_view arg, const TensorView& t, Device device, int ndim) {
  require_device(op, arg, t, device);
  require_ndim(op, arg, t, ndim);
  require_contiguous(op, arg, t);
}

void require_float_tensor(std::string_view op, std::string_view arg, const TensorView& t, Device device, int ndim) {
  require_tensor(op, arg, t, device, ndim);
  require_float(op, arg, t);
}

void require_tensor_of(std::string_view op, std::string_view arg, const TensorView& t, Device device, int ndim,
                       DType dtype) {
  require_tensor(op, arg, t, device, ndim);
  require_dtype(op, arg, t, dtype);
}

void check_packed_linear_operands(std::string_view op, const TensorView& out, const TensorView& x,
                                  const TensorView& packed_weight, const std::optional<TensorView>& bias) {
  require_tensor(op, "x", x, Device::kCPU, 2);
  require_tensor(op, "out", out, Device::kCPU, 2);
  require_size(op, "out", out, 0, x.size(0));
  const int64_t out_features = out.size(1);
  require_tensor_of(op, "packed_weight", packed_weight, Device::kCPU, 3, DType::kBFloat16);
  require_size(op, "packed_weight", packed_weight, 0, packed_col_tiles(out_features));
  require_size(op, "packed_weight", packed_weight, 1, packed_k_pairs(x.size(1)));
  require_size(op, "packed_weight", packed_weight, 2, 2 * kPackedCols);
  if (bias) {
    require_tensor_of(op, "bias", *bias, Device::kCPU, 1, DType::kFloat32);
    require_size(op, "bias", *bias, 0, out_features);
  }
}

void require_same_device(std::string_view op, std::string_view arg, const TensorView& t, const TensorView& like) {
  if (t.device != Device::kCUDA || like.device != Device::kCUDA) return;
  PS_REQUIRE(t.device_index == like.device_index, op,
             std::string(arg) + " is on cuda:" + std::to_string(t.device_index) +
                 " but the other tensors are on cuda:" + std::to_string(like.device_index));
}

void check_rms_norm(Device device, const TensorView& out, const TensorView& x, const TensorView& weight) {
  check_norm(device, "rms_norm", "out", out, x, weight);
}

void check_fused_add_rms_norm(Device device, const TensorView& x, const TensorView& residual,
                              const TensorView& weight) {
  check_norm(device, "fused_add_rms_norm", "residual", residual, x, weight);
}

void check_rotary_embedding(Device device, const TensorView& positions, const TensorView& query, const TensorView& key,
                            const TensorView& cos_sin_cache) {
  Args a("rotary_embedding", device);
  a.of("positions", positions, 1, DType::kInt32);
  a.floats("query", query, 3);
  a.floats("key", key, 3);
  a.of("cos_sin_cache", cos_sin_cache, 2, DType::kFloat32);
  a.same_dtype("key", key, query);
  const int64_t tokens = positions.size(0);
  const int64_t head_dim = query.size(2);
  const int64_t rotary_dim = cos_sin_cache.size(1);
  a.size("query", query, 0, tokens);
  a.size("key", key, 0, tokens);
  a.size("key", key, 2, head_dim);
  PS_REQUIRE(rotary_dim > 0 && rotary_dim % 2 == 0 && rotary_dim <= head_dim, a.op(),
             "cos_sin_cache's rotary dim must be even and in (0, head_dim = " + std::to_string(head_dim) +
                 "], got " + cos_sin_cache.describe());
  if (!a.reads_indices()) return;
  const int64_t max_position = cos_sin_cache.size(0);
  const int32_t* pos = positions.ptr<int32_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    PS_REQUIRE(pos[t] >= 0 && pos[t] < max_position, a.op(),
               "positions[" + std::to_string(t) + "] = " + std::to_string(pos[t]) +
                   " is outside the cos_sin_cache [0, " + std::to_string(max_position) + ")");
  }
}

void check_silu_and_mul(Device device, const TensorView& out, const TensorView& x) {
  Args a("silu_and_mul", device);
  a.floats("x", x, 2);
  a.floats("out", out, 2);
  a.same_dtype("out", out, x);
  PS_REQUIRE(x.size(1) % 2 == 0, a.op(), "x's last dim must be even (gate and up halves), got " + x.describe());
  a.size("out", out, 0, x.size(0));
  a.size("out", out, 1, x.size(1) / 2);
}

void check_reshape_and_cache(Device device, const TensorView& key, const TensorView& value, const TensorView& key_cache,
                             const TensorView& value_cache, const TensorView& slot_mapping) {
  Args a("reshape_and_cache", device);
  a.floats("key", key, 3);
  a.like("value", value, key);
  a.kv_caches(key_cache, value_cache, key, key.size(2));
  a.size("key_cache", key_cache, 1, key.size(1));
  a.of("slot_mapping", slot_mapping, 1, DType::kInt32);
  const int64_t tokens = key.size(0);
  a.size("slot_mapping", slot_mapping, 0, tokens);
  if (!a.reads_indices()) return;
  const int64_t num_slots = key_cache.size(0) * key_cache.size(2);
  const int32_t* slots = slot_mapping.ptr<int32_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    PS_REQUIRE(slots[t] == kPadSlot || (slots[t] >= 0 && slots[t] < num_slots), a.op(),
               "slot_mapping[" + std::to_string(t) + "] = " + std::to_string(slots[t]) +
                   " is outside the cache [0, " + std::to_string(num_slots) + ") and is not kPadSlot (-1)");
  }
}

void check_copy_blocks(Device device, const TensorView& kv_cache, const TensorView& block_copies) {
  Args a("copy_blocks", device);
  a.floats("kv_cache", kv_cache, 6);
  a.of("block_copies", block_copies, 2, DType::kInt32);
  a.size("kv_cache", kv_cache, 1, 2);
  a.size("block_copies", block_copies, 1, 2);
  if (!a.reads_indices()) return;
  const int64_t num_blocks = kv_cache.size(2);
  const int32_t* ids = block_copies.ptr<int32_t>();
  for (int64_t i = 0; i < 2 * block_copies.size(0); ++i) {
    PS_REQUIRE(ids[i] >= 0 && ids[i] < num_blocks, a.op(),
               "block_copies[" + std::to_string(i / 2) + "][" + std::to_string(i % 2) + "] = " +
                   std::to_string(ids[i]) + " is not a block id in [0, " + std::to_string(num_blocks) + ")");
  }
}

void check_paged_attention(Device device, const TensorView& out, const TensorView& query, const TensorView& key_cache,
                           const TensorView& value_cache, const TensorView& block_tables,
                           const TensorView& query_start_loc, const TensorView& seq_lens,
                           const AttentionOptions& options) {
  Args a("paged_attention", device);
  PS_REQUIRE(options.window >= 0, a.op(), "window must be >= 0 (0: off), got " + std::to_string(options.window));
  PS_REQUIRE(options.softcap >= 0.0f && std::isfinite(options.softcap), a.op(),
             "softcap must be finite and >= 0 (0: off), got " + std::to_string(options.softcap));
  a.floats("query", query, 3);
  a.like("out", out, query);
  a.kv_caches(key_cache, value_cache, query, query.size(2));
  a.of("block_tables", block_tables, 2, DType::kInt32);
  a.of("query_start_loc", query_start_loc, 1, DType::kInt32);
  a.of("seq_lens", seq_lens, 1, DType::kInt32);
  const int64_t kv_heads = key_cache.size(1);
  PS_REQUIRE(kv_heads > 0 && query.size(1) % kv_heads == 0, a.op(),
             "query heads (" + std::to_string(query.size(1)) + ") must be a multiple of kv heads (" +
                 std::to_string(kv_heads) + ")");
  PS_REQUIRE(key_cache.size(2) > 0, a.op(), "block size must be > 0, got key_cache " + key_cache.describe());
  const int64_t num_seqs = seq_lens.size(0);
  a.size("query_start_loc", query_start_loc, 0, num_seqs + 1);
  a.size("block_tables", block_tables, 0, num_seqs);
  if (a.reads_indices()) check_attention_batch(a.op(), query, key_cache, block_tables, query_start_loc, seq_lens,
                                                  options);
}

void check_grouped_linear(Device device, const TensorView& out, const TensorView& x, const TensorView& weight,
                          const TensorView& expert_offsets) {
  Args a("grouped_linear", device);
  a.floats("x", x, 2);
  a.floats("weight", weight, 3);
  a.same_dtype("weight", weight, x);
  a.size("weight", weight, 2, x.size(1));
  a.floats("out", out, 2);
  a.same_dtype("out", out, x);
  a.size("out", out, 0, x.size(0));
  a.size("out", out, 1, weight.size(1));
  a.of("expert_offsets", expert_offsets, 1, DType::kInt32);
  PS_REQUIRE(x.size(1) > 0, a.op(), "x must have a non-empty last dim, got " + x.describe());
  if (a.reads_indices()) {
    require_expert_offsets(a.op(), expert_offsets, weight.size(0), x.size(0));
  } else {
    a.size("expert_offsets", expert_offsets, 0, weight.size(0) + 1);
  }
}

namespace {

// What the attention-input ops write: query_out [T, Hq, D]; the caches, of
// `source`'s dtype, [N, Hkv, B, D]; positions, slot_mapping [T]; cos_sin
// [max_position, R]. CPU: positions in the table, slots in the cache or kPadSlot.
void rope_cache_targets(Args& a, const TensorView& source, const TensorView& query_out, const TensorView& positions,
                        const TensorView& cos_sin, const TensorView& key_cache, const TensorView& value_cache,
                        const TensorView& slot_mapping) {
  const int64_t tokens = source.size(0);
  a.floats("query_out", query_out, 3);
  a.same_dtype("query_out", query_out, source);
  a.size("query_out", query_out, 0, tokens);
  a.floats("key_cache", key_cache, 4);
  a.same_dtype("key_cache", key_cache, source);
  a.size("key_cache", key_cache, 3, query_out.size(2));
  a.like("value_cache", value_cache, key_cache);
  a.of("positions", positions, 1, DType::kInt32);
  a.size("positions", positions, 0, tokens);
  a.of("slot_mapping", slot_mapping, 1, DType::kInt32);
  a.size("slot_mapping", slot_mapping, 0, tokens);
  a.of("cos_sin_cache", cos_sin, 2, DType::kFloat32);
  const int64_t rotary = cos_sin.size(1);
  PS_REQUIRE(rotary > 0 && rotary % 2 == 0 && rotary <= query_out.size(2), a.op(),
             "cos_sin_cache's rotary dim must be even and within the head dim, got " + cos_sin.describe());
  if (!a.reads_indices()) return;
  const int64_t num_slots = key_cache.size(0) * key_cache.size(2);
  for (int64_t t = 0; t < tokens; ++t) {
    const int32_t pos = positions.ptr<int32_t>()[t], slot = slot_mapping.ptr<int32_t>()[t];
    PS_REQUIRE(pos >= 0 && pos < cos_sin.size(0), a.op(),
               "positions[" + std::to_string(t) + "] = " + std::to_string(pos) + " is outside the cos/sin table");
    PS_REQUIRE(slot == kPadSlot || (slot >= 0 && slot < num_slots), a.op(),
               "slot_mapping[" + std::to_string(t) + "] = " + std::to_string(slot) + " is outside the cache");
  }
}

// The qkv width the attention-input ops expect: (Hq + 2 Hkv) D.
int64_t qkv_width(const TensorView& query_out, const TensorView& key_cache) {
  return (query_out.size(1) + 2 * key_cache.size(1)) * query_out.size(2);
}

// small_batch_linear's operands: x [M, K], 1 <= M <= kMaxSmallBatchRows; weight [N, K] (N even when
// gated); bias [N] or empty.
void small_batch_operands(Args& a, const TensorView& x, const TensorView& weight, const TensorView& bias,
                          bool gated) {
  a.floats("x", x, 2);
  a.floats("weight", weight, 2);
  a.same_dtype("weight", weight, x);
  a.size("weight", weight, 1, x.size(1));
  PS_REQUIRE(x.size(0) >= 1 && x.size(0) <= kMaxSmallBatchRows && x.size(1) > 0, a.op(),
             "x must have 1.." + std::to_string(kMaxSmallBatchRows) + " rows and K > 0, got " + x.describe());
  PS_REQUIRE(!gated || weight.size(0) % 2 == 0, a.op(),
             "a gated product needs [gate; up] rows (an even count), got " + weight.describe());
  if (bias.data != nullptr) {
    a.floats("bias", bias, 1);
    a.same_dtype("bias", bias, x);
    a.size("bias", bias, 0, weight.size(0));
  }
}

}  // namespace

void check_qkv_rope_cache(Device device, const TensorView& query_out, const TensorView& qkv,
                          const TensorView& positions, const TensorView& cos_sin, const TensorView& key_cache,
                          const TensorView& value_cache, const TensorView& slot_mapping, const QkNorm& norm) {
  Args a("qkv_rope_cache", device);
  a.floats("qkv", qkv, 2);
  rope_cache_targets(a, qkv, query_out, positions, cos_sin, key_cache, value_cache, slot_mapping);
  a.size("qkv", qkv, 1, qkv_width(query_out, key_cache));
  if (!norm.applies()) return;
  for (const auto& [name, weight] : {std::pair<std::string_view, const TensorView&>{"q_norm", norm.q_weight},
                                     {"k_norm", norm.k_weight}}) {
    PS_REQUIRE(weight.data != nullptr, a.op(), "q_norm and k_norm come together: " + std::string(name) + " is missing");
    a.floats(name, weight, 1);
    a.same_dtype(name, weight, qkv);
    a.size(name, weight, 0, query_out.size(2));
  }
  PS_REQUIRE(norm.eps >= 0.0f, a.op(), "the q/k norm's eps must be >= 0, got " + std::to_string(norm.eps));
}

void check_small_batch_linear(Device device, const TensorView& out, const TensorView& x, const TensorView& weight,
                              const TensorView& bias, bool gated) {
  Args a("small_batch_linear", device);
  small_batch_operands(a, x, weight, bias, gated);
  a.floats("out", out, 2);
  a.same_dtype("out", out, x);
  a.size("out", out, 0, x.size(0));
  a.size("out", out, 1, gated ? weight.size(0) / 2 : weight.size(0));
}

void check_qkv_linear_rope_cache(Device device, const TensorView& query_out, const TensorView& x,
                                 const TensorView& weight, const TensorView& bias, const TensorView& positions,
                                 const TensorView& cos_sin, const TensorView& key_cache,
                                 const TensorView& value_cache, const TensorView& slot_mapping) {
  Args a("qkv_linear_rope_cache", device);
  small_batch_operands(a, x, weight, bias, false);
  PS_REQUIRE(x.size(0) <= kMaxFusedQkvRows, a.op(),
             "x must have 1.." + std::to_string(kMaxFusedQkvRows) + " rows, got " + x.describe());
  rope_cache_targets(a, x, query_out, positions, cos_sin, key_cache, value_cache, slot_mapping);
  a.size("weight", weight, 0, qkv_width(query_out, key_cache));
}

void require_expert_offsets(std::string_view op, const TensorView& offsets, int64_t num_experts, int64_t rows) {
  require_size(op, "expert_offsets", offsets, 0, num_experts + 1);
  const int32_t* bounds = offsets.ptr<int32_t>();
  for (int64_t e = 0; e <= num_experts; ++e) {
    const int64_t previous = e == 0 ? 0 : bounds[e - 1];
    PS_REQUIRE(bounds[e] >= previous && bounds[e] <= rows, op,
               "expert_offsets must be non-decreasing within [0, " + std::to_string(rows) + "], got [" +
                   std::to_string(e) + "] = " + std::to_string(bounds[e]));
  }
}

void check_sample_tokens(Device device, const TensorView& out, const TensorView& logits,
                         const TensorView& inv_temperature, const TensorView& allowed) {
  Args a("sample_tokens", device);
  a.floats("logits", logits, 2);
  a.of("out", out, 1, DType::kInt32);
  a.of("inv_temperature", inv_temperature, 1, DType::kFloat32);
  const int64_t rows = logits.size(0);
  a.size("out", out, 0, rows);
  a.size("inv_temperature", inv_temperature, 0, rows);
  PS_REQUIRE(logits.size(1) > 0, a.op(), "logits must have at least one column");
  if (allowed.data == nullptr) return;
  a.of("allowed", allowed, 2, DType::kInt32);
  a.size("allowed", allowed, 0, rows);
  a.size("allowed", allowed, 1, token_mask_words(logits.size(1)));
}

void check_wait_for_flag(const TensorView& flag, double timeout_seconds) {
  Args a("wait_for_flag", Device::kCPU);  // the flag is host memory for the CUDA op too
  a.of("flag", flag, 1, DType::kInt64);
  PS_REQUIRE(flag.size(0) >= 2 && flag.is_contiguous(), a.op(),
             "flag must be a contiguous int64 tensor of at least 2 elements, got " + flag.describe());
  PS_REQUIRE(timeout_seconds > 0, a.op(), "timeout_seconds must be positive, got " + std::to_string(timeout_seconds));
}

}  // namespace pagedserve::ops
