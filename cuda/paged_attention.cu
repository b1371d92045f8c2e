// paged_attention: the kernels' launch limits (after the op's contract,
// cpp/ops/op_contracts.h), the decode split-K plan, and the one
// dispatch onto the kernels (decode_attention.cuh, prefill_attention.cuh,
// attention_f32.cuh).
//
// Split-K plan: one partition a row (the longest context rounded up to a power
// of two, 512..16384 tokens) while the decode grid (rows x kv heads x
// partitions) fills the GPU twice over: a large batch writes no partials and
// launches no reduce kernel (H200, Qwen3-0.6B shape, 256 rows of 100..2048
// tokens: +1-2 % tok/s; 64 rows x 4096 tokens 93 -> 101 % of the copy
// bandwidth; bench/results/h200/session32.md). Otherwise the partitions halve
// (down to 256 tokens: a shorter context stays one chain, as cuDNN computes
// it; decode_attention.cuh) as long as the caller's workspace holds the extra
// partials. Everything the plan reads is fixed for a captured
// CUDA graph: host bounds, the workspace size and the SM count. A sliding
// window W bounds each decode row's context by W, so the plan (and the grid)
// sizes from min(max_seq_len, W). options.fixed_split keeps 512-token
// partitions whatever the batch: a row's partials, and so its result, then
// depend on its own context alone (empty partitions weigh exactly 0).
#include <algorithm>
#include <bit>
#include <climits>
#include <type_traits>

#include "attention_f32.cuh"
#include "attention_params.h"
#include "cuda_check.h"
#include "cuda_ops.h"
#include "decode_attention.cuh"
#include "dispatch.h"
#include "launch_limits.h"
#include "ops/op_contracts.h"
#include "prefill_attention.cuh"

namespace pagedserve::cuda {
namespace {

constexpr const char* kOp = "paged_attention";
constexpr int kMaxGridYZ = 65535;

// Workspace bytes for `partitions` partials per (row, head): O / l, max, sum.
size_t split_bytes(int64_t rows, int64_t heads, int64_t head_dim, int64_t partitions) {
  return static_cast<size_t>(rows * heads * partitions * (head_dim + 2)) * sizeof(float);
}

int multiprocessor_count(int device) {
  int count = 0;
  check_cuda(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  return count;
}

// The longest context one decode row reads: its window or the host bound.
int max_decode_context(const PagedAttentionParams& p) { return std::min(p.max_seq_len, p.window_span); }

// The decode grid's CTAs for each partition of the rows' contexts: rows x kv heads x head chunks.
int64_t decode_ctas_per_partition(const PagedAttentionParams& p) {
  return static_cast<int64_t>(p.num_decodes) * p.num_kv_heads * decode::head_chunks(p);
}

// The decode CTAs the card holds at once.
int64_t resident_decode_ctas(int device) {
  return decode::kCtasPerSm * static_cast<int64_t>(multiprocessor_count(device));
}

int plan_partition_tokens(const PagedAttentionParams& p, int head_dim, size_t workspace_bytes, int device) {
  const int context = max_decode_context(p);
  const int64_t ctas_per_partition = decode_ctas_per_partition(p);
  const int64_t target_ctas = resident_decode_ctas(device);
  if (p.fixed_split) return decode::kFixedPartitionTokens;
  // One partition a row where that fills the card: no partial results and no reduce kernel (a
  // large batch's case), else halved as below.
  int partition_tokens = std::clamp(static_cast<int>(std::bit_ceil(static_cast<unsigned>(std::max(context, 1)))),
                                    decode::kFixedPartitionTokens, decode::kLongestPartitionTokens);
  while (partition_tokens > decode::kMinPartitionTokens) {
    if (ctas_per_partition * ceil_div(context, partition_tokens) >= target_ctas) break;
    const int finer = ceil_div(context, partition_tokens / 2);
    if (finer > 1 && split_bytes(p.num_decodes, p.num_heads, head_dim, finer) > workspace_bytes) break;
    partition_tokens /= 2;
  }
  return partition_tokens;
}

DecodeSplit plan_decode_split(const PagedAttentionParams& p, int head_dim, const TensorView& workspace, int device) {
  const size_t available =  // a view without data (None from Python) is no workspace
      workspace.data == nullptr ? 0 : static_cast<size_t>(workspace.numel()) * ops::element_size(workspace.dtype);
  DecodeSplit split{};
  split.partition_tokens = plan_partition_tokens(p, head_dim, available, device);
  split.num_partitions = std::max(1, ceil_div(max_decode_context(p), split.partition_tokens));
  if (split.num_partitions == 1) return split;  // rows finish in the partition kernel

  const size_t needed = split_bytes(p.num_decodes, p.num_heads, head_dim, split.num_partitions);
  PS_REQUIRE(available >= needed, kOp,
               "workspace holds " + std::to_string(available) + " bytes but " + std::to_string(needed) +
                   " are needed; size it with paged_attention_workspace_bytes(num_seqs, num_heads, head_dim, "
                   "max_seq_len)");
  ops::require_tensor(kOp, "workspace", workspace, ops::Device::kCUDA, workspace.ndim);
  PS_REQUIRE(workspace.device_index == device, kOp, "workspace must be on the device of the other tensors");
  PS_REQUIRE(is_aligned16(workspace.data), kOp, "workspace must be 16-byte aligned");
  const int64_t slots = static_cast<int64_t>(p.num_decodes) * p.num_heads * split.num_partitions;
  split.partial_out = static_cast<float*>(workspace.data);
  split.partial_max = split.partial_out + slots * head_dim;
  split.partial_sum = split.partial_max + slots;
  return split;
}

// The decode rows' launch order matters only where CTAs queue for the SMs' slots: a grid that fits them at
// once reads none (H200, TinyLlama shape, 64 rows x 4 kv heads in one partition, contexts up to 256 tokens:
// reading it cost ~2 % tok/s).
const int32_t* launch_order(const PagedAttentionParams& p, const DecodeSplit& split, int device) {
  const int64_t ctas = decode_ctas_per_partition(p) * split.num_partitions;
  return ctas > resident_decode_ctas(device) ? p.decode_order : nullptr;
}

struct AttentionShape {
  int num_tokens;
  int num_heads;
  int num_kv_heads;
  int head_dim;
  int block_size;
  int num_seqs;
};

// The op's contract, then the kernels' own limits.
AttentionShape checked_attention_shape(const TensorView& out, const TensorView& query, const TensorView& key_cache,
                                       const TensorView& value_cache, const TensorView& block_tables,
                                       const TensorView& query_start_loc, const TensorView& seq_lens,
                                const ops::AttentionOptions& options) {
  ops::check_paged_attention(ops::Device::kCUDA, out, query, key_cache, value_cache, block_tables, query_start_loc,
                             seq_lens, options);
  const AttentionShape shape{checked_int(kOp, "num_tokens", query.size(0)),
                             checked_int(kOp, "num_heads", query.size(1)),
                             checked_int(kOp, "num_kv_heads", key_cache.size(1)),
                             checked_int(kOp, "head_dim", query.size(2)),
                             checked_int(kOp, "block_size", key_cache.size(2)),
                             checked_int(kOp, "num_seqs", seq_lens.size(0))};
  PS_REQUIRE(shape.num_heads <= kMaxGridYZ, kOp, "at most 65535 query heads");
  for (const auto& [name, t] : {std::pair<const char*, const TensorView*>{"out", &out},
                                {"query", &query},
                                {"key_cache", &key_cache},
                                {"value_cache", &value_cache}}) {
    PS_REQUIRE(is_aligned16(t->data), kOp, std::string(name) + " must be 16-byte aligned");
  }
  return shape;
}

// The launch order of the decode rows, or null (row order) when none is given.
const int32_t* checked_decode_order(const TensorView& order, int num_decodes, int device) {
  if (order.data == nullptr) return nullptr;
  ops::require_tensor_of(kOp, "decode_order", order, ops::Device::kCUDA, 1, ops::DType::kInt32);
  PS_REQUIRE(order.device_index == device, kOp, "decode_order must be on the device of the other tensors");
  PS_REQUIRE(order.size(0) >= num_decodes, kOp,
             "decode_order holds " + std::to_string(order.size(0)) + " rows but num_decodes is " +
                 std::to_string(num_decodes));
  return order.ptr<const int32_t>();
}

}  // namespace

const char* prefill_attention_kernel(int head_dim) {
  return prefill_wgmma::takes(head_dim) ? "wgmma" : "mma.sync";
}

size_t paged_attention_workspace_bytes(int num_seqs, int num_heads, int head_dim, int max_seq_len) {
  PS_REQUIRE(num_seqs >= 0 && num_heads >= 0 && head_dim >= 0, "paged_attention_workspace_bytes",
               "num_seqs, num_heads and head_dim must be >= 0");
  if (max_seq_len <= 0) return 0;
  return split_bytes(num_seqs, num_heads, head_dim, ceil_div(max_seq_len, decode::kFixedPartitionTokens));
}

void paged_attention(const TensorView& out, const TensorView& query, const TensorView& key_cache,
                     const TensorView& value_cache, const TensorView& block_tables, const TensorView& query_start_loc,
                     const TensorView& seq_lens, float scale, int max_query_len, int max_seq_len, int num_decodes,
                     const TensorView& workspace, const TensorView& decode_order, const ops::AttentionOptions& options,
                     cudaStream_t stream) {
  const AttentionShape shape =
      checked_attention_shape(out, query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, options);
  const int num_prefills = shape.num_seqs - num_decodes;
  PS_REQUIRE(num_decodes >= 0 && num_prefills >= 0, kOp,
               "num_decodes = " + std::to_string(num_decodes) + " must be in [0, num_seqs = " +
                   std::to_string(shape.num_seqs) + "]");
  PS_REQUIRE(num_decodes <= shape.num_tokens, kOp, "num_decodes exceeds the number of query tokens");
  PS_REQUIRE(num_decodes <= kMaxGridYZ && num_prefills <= kMaxGridYZ, kOp,
               "at most 65535 decode rows and 65535 prefill rows per call");
  PS_REQUIRE(max_seq_len >= 0 && max_query_len >= 0, kOp, "max_query_len and max_seq_len must be >= 0");
  PS_REQUIRE(num_prefills == 0 || max_query_len >= 1, kOp, "prefill rows need max_query_len >= 1");
  if (shape.num_tokens == 0 || shape.num_seqs == 0) return;

  PagedAttentionParams params{};
  params.out = out.data;
  params.query = query.data;
  params.key_cache = key_cache.data;
  params.value_cache = value_cache.data;
  params.block_tables = block_tables.ptr<const int32_t>();
  params.query_start_loc = query_start_loc.ptr<const int32_t>();
  params.seq_lens = seq_lens.ptr<const int32_t>();
  params.decode_order = checked_decode_order(decode_order, num_decodes, query.device_index);
  params.scale = scale;
  params.num_seqs = shape.num_seqs;
  params.num_tokens = shape.num_tokens;
  params.num_heads = shape.num_heads;
  params.num_kv_heads = shape.num_kv_heads;
  params.max_blocks_per_seq = checked_int(kOp, "max_blocks_per_seq", block_tables.size(1));
  params.max_query_len = max_query_len;
  params.max_seq_len = max_seq_len;
  params.num_decodes = num_decodes;
  params.window_span = options.window > 0 ? options.window : INT_MAX;
  params.softcap = options.softcap;
  params.fixed_split = options.fixed_split;

  DeviceGuard guard(query.device_index);
  dispatch_attention(query.dtype, shape.head_dim, shape.block_size, kOp,
                     [&]<typename T, int kHeadDim, int kBlockSize>() {
                       if constexpr (std::is_same_v<T, float>) {
                         launch_attention_f32<kHeadDim, kBlockSize>(params, stream);
                       } else {
                         if (num_decodes > 0) {
                           const DecodeSplit split = plan_decode_split(params, kHeadDim, workspace, query.device_index);
                           params.decode_order = launch_order(params, split, query.device_index);  // decode only
                           launch_decode_attention<T, kHeadDim, kBlockSize>(params, split, stream);
                         }
                         if (num_prefills > 0) launch_prefill_attention<T, kHeadDim, kBlockSize>(params, stream);
                       }
                     });
}

}  // namespace pagedserve::cuda
