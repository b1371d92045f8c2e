// CUDA ops: the GPU side of every op in cpp/ops/ops.h, same arguments and
// semantics (that header is the reference), plus a trailing stream.
//
// Every tensor is a contiguous CUDA TensorView on one device; index tensors
// are int32; float tensors of one op share a dtype (float32, float16 or
// bfloat16) and arithmetic is float32. Each op checks its arguments with the
// contract it shares with its CPU twin (cpp/ops/op_contracts.h), then the
// kernels' own limits (launch_limits.h, dispatch.h). Bad arguments throw
// std::invalid_argument naming the op and the argument; a failed launch throws
// std::runtime_error naming the kernel.
//
// Every op only enqueues kernels on `stream`: no allocation, no host sync, no
// copies, so each is safe to capture in a CUDA graph. Per-step shapes that the
// kernels need (seq_lens, query_start_loc, block tables, slot mappings) are
// read from device memory; only launch shapes come from host integers.
//
// Index safety: writes through a slot mapping or a block copy outside the
// cache are skipped (a kernel cannot throw); reads trust the block tables.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "ops/attention_options.h"
#include "ops/qk_norm.h"
#include "ops/tensor_view.h"

namespace pagedserve::cuda {

using ops::TensorView;

// out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * weight.   x, out: [T, H]; weight: [H].
// A row is summed in the order torch's reduction would use for this many rows
// (bit-identical to transformers), which depends on T; fixed_order: in an
// order fixed by H alone, so a row's result does not depend on the batch
// (--batch-invariant).
void rms_norm(const TensorView& out, const TensorView& x, const TensorView& weight, float eps, bool fixed_order,
              cudaStream_t stream);

// In place, one kernel: residual += x; x = rms_norm(residual) * weight.
// The norm reads the updated residual as stored (rounded to the dtype).
void fused_add_rms_norm(const TensorView& x, const TensorView& residual, const TensorView& weight, float eps,
                        bool fixed_order, cudaStream_t stream);

// In place half rotation of the first R dims of every query and key head.
// positions: [T] int32; query: [T, Hq, D]; key: [T, Hkv, D]; cos_sin: [max_position, R] float32.
// Tokens whose position is outside [0, max_position) are left unchanged.
void rotary_embedding(const TensorView& positions, const TensorView& query, const TensorView& key,
                      const TensorView& cos_sin, cudaStream_t stream);

// out = silu(x[:, :I]) * x[:, I:].   x: [T, 2I]; out: [T, I].
void silu_and_mul(const TensorView& out, const TensorView& x, cudaStream_t stream);

// key, value: [T, Hkv, D]; key_cache, value_cache: [N, Hkv, B, D]; slot_mapping: [T] int32.
// Tokens with a negative slot (kPadSlot) or a slot past the cache are skipped.
void reshape_and_cache(const TensorView& key, const TensorView& value, const TensorView& key_cache,
                       const TensorView& value_cache, const TensorView& slot_mapping, cudaStream_t stream);

// kv_cache: [L, 2, N, Hkv, B, D]; block_copies: [C, 2] int32 (src, dst).
// The copies of one call run in parallel: no copy may read a block another writes.
void copy_blocks(const TensorView& kv_cache, const TensorView& block_copies, cudaStream_t stream);

// Paged attention over a mixed batch (semantics: ops::paged_attention).
//
// Rows [0, num_decodes) bring one query each and run the split-K decode
// kernel; the remaining rows run the prefill/extend kernel. The host bounds
// size the grids: max_query_len >= every prefill row's q_len and
// max_seq_len >= every seq_len (under CUDA graphs pass max_model_len).
// workspace: scratch of at least paged_attention_workspace_bytes(num_decodes,
// Hq, D, max_seq_len) bytes in any dtype a TensorView takes (float32 is
// natural; there is no uint8), 16-byte aligned; it may be empty (no data) when
// max_seq_len fits one partition. A larger workspace lets small batches split
// into finer partitions. Tokens past query_start_loc[S] are not written.
// decode_order: empty (no data: row order), or int32 [>= num_decodes] on the
// device, a permutation of [0, num_decodes) naming the decode rows in the
// order their CTAs launch. A batch of mixed contexts finishes sooner longest
// first (H200, 64 rows of 1000..2048 tokens: 84.5 -> 98.4 % of the copy
// bandwidth, kernel_bench.py), since the short rows then fill the last wave.
// A grid that fits the SMs at once (two CTAs each) does not read it; where
// one is read, entries out of range are skipped and a row the order omits is
// not computed. The decode kernel reads decode_order, seq_lens and
// query_start_loc before waiting on the kernel launched before it (PDL,
// dependent_launch.cuh): no dependent-launched kernel may write them.
// `options`: sliding window and soft-capping (cpp/ops/attention_options.h); a
// window also bounds the decode grid and workspace use by min(max_seq_len, W).
void paged_attention(const TensorView& out, const TensorView& query, const TensorView& key_cache,
                     const TensorView& value_cache, const TensorView& block_tables, const TensorView& query_start_loc,
                     const TensorView& seq_lens, float scale, int max_query_len, int max_seq_len, int num_decodes,
                     const TensorView& workspace, const TensorView& decode_order, const ops::AttentionOptions& options,
                     cudaStream_t stream);

// Which kernel paged_attention runs prefill rows of 16-bit dtypes and this
// head dim on, on the current device: "wgmma" (Hopper, sm_90a built; not with
// PAGEDSERVE_WGMMA=0) or "mma.sync".
const char* prefill_attention_kernel(int head_dim);

// Bytes of split-K scratch paged_attention needs for num_seqs decode rows:
// float32 partial outputs plus a running max and sum per (row, head, partition).
size_t paged_attention_workspace_bytes(int num_seqs, int num_heads, int head_dim, int max_seq_len);

// Mixture-of-experts products (semantics: ops::grouped_linear; layout:
// cpp/ops/grouped_linear.h). out: [R, N]; x: [R, K]; weight: [E, N, K];
// expert_offsets: [E + 1] int32 in device memory. float16 / bfloat16 run on
// tensor cores and need K % 8 == 0, 16-byte aligned x and weight, and
// ceil(R / 64) + E <= 65535; float32 runs a plain kernel. The offsets are
// trusted to be non-decreasing; rows past R are neither read nor written.
void grouped_linear(const TensorView& out, const TensorView& x, const TensorView& weight,
                    const TensorView& expert_offsets, cudaStream_t stream);

// The attention's input from the qkv projection in one kernel (semantics:
// ops::qkv_rope_cache): the rotated queries into query_out [T, Hq, D], the
// rotated keys and the values into their cache slots. Positions outside the
// table leave q and k unrotated; a negative slot or one past the cache skips
// the token's KV write. A QkNorm needs rope over whole heads, head_dim <= 128
// and 16-byte aligned tensors (it sums each head as rms_norm sums a row).
void qkv_rope_cache(const TensorView& query_out, const TensorView& qkv, const TensorView& positions,
                    const TensorView& cos_sin, const TensorView& key_cache, const TensorView& value_cache,
                    const TensorView& slot_mapping, const ops::QkNorm& norm, cudaStream_t stream);

// qkv_rope_cache of the product x W^T (+ bias) of 1..4 rows, in one kernel
// without storing the product (semantics: ops::qkv_linear_rope_cache); x and
// weight as small_batch_linear's.
void qkv_linear_rope_cache(const TensorView& query_out, const TensorView& x, const TensorView& weight,
                           const TensorView& bias, const TensorView& positions, const TensorView& cos_sin,
                           const TensorView& key_cache, const TensorView& value_cache,
                           const TensorView& slot_mapping, cudaStream_t stream);

// out = x W^T (+ bias) for a few rows (semantics: ops::small_batch_linear):
// one warp per output column, memory-bound, one launch. x: [M, K] with
// 1 <= M <= 8 (ops::kMaxSmallBatchRows); weight: [N, K]; bias: [N] or empty;
// out: [M, N]. gated: weight is [gate; up] ([2I, K], bias [2I]) and out
// [M, I] = silu(gate) * up. K % (16 / element size) == 0, x and weight 16-byte
// aligned.
void small_batch_linear(const TensorView& out, const TensorView& x, const TensorView& weight, const TensorView& bias,
                        bool gated, cudaStream_t stream);

// Gumbel-max sampling, one token per row; see cpp/ops/ops.h.
void sample_tokens(const TensorView& out, const TensorView& logits, const TensorView& inv_temperature,
                   const TensorView& allowed, uint64_t seed, cudaStream_t stream);

// Queues ops::wait_for_flag on the stream; flag: pinned host memory.
void wait_for_flag(const TensorView& flag, int64_t target, double timeout_seconds, cudaStream_t stream);

}  // namespace pagedserve::cuda
