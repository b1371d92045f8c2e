// The argument contract of every op that has a CPU and a CUDA kernel, one
// checker per op, parameterized by the device the caller runs it on.
//
// The CPU ops (ops.h) call check_<op>(Device::kCPU, ...) and the CUDA ops
// (cuda/cuda_ops.h) check_<op>(Device::kCUDA, ...) before any work, so both
// accept and reject the same tensors with the same messages:
// std::invalid_argument("<op>: <argument> ..."), a ValueError in Python.
//
// Every contract requires, of each tensor argument: the given device (on a
// GPU, the same one for all of an op's tensors), contiguity, the number of
// dims shown, and the dtype shown. "float" is float32, float16 or bfloat16,
// one dtype for all of an op's float tensors (float32 where one says so).
// Shapes: T tokens, H hidden, Hq query heads, Hkv kv heads, D head dim,
// R rotary dim, N blocks, B block size, S sequences, L layers, V vocabulary.
//
// What the device changes: index tensors (positions, slot_mapping,
// block_copies, block_tables, query_start_loc, seq_lens) live in host memory
// on the CPU, so there the contract also reads them and rejects out-of-range
// entries. On a GPU they cannot be read before the launch: the kernels skip
// writes through an out-of-range index and trust reads (cuda/cuda_ops.h).
// Limits of the CUDA kernels themselves (int32 launch shapes, alignment, the
// head dims and block sizes compiled) are checked by the CUDA ops after the
// contract; ops with only a CPU kernel (rope_cos_sin_cache,
// pack_linear_weight, packed_linear) check their arguments where they are
// defined, with the helpers below.
#pragma once

#include <optional>
#include <string_view>

#include "ops/attention_options.h"
#include "ops/qk_norm.h"
#include "ops/tensor_view.h"

namespace pagedserve::ops {

// rms_norm: x [T, H] float, H > 0; out [T, H]; weight [H].
void check_rms_norm(Device device, const TensorView& out, const TensorView& x, const TensorView& weight);

// fused_add_rms_norm: x [T, H] float, H > 0; residual [T, H]; weight [H].
void check_fused_add_rms_norm(Device device, const TensorView& x, const TensorView& residual, const TensorView& weight);

// rotary_embedding: positions [T] int32; query [T, Hq, D] float; key [T, Hkv, D] float;
// cos_sin_cache [max_position, R] float32 with R even and 0 < R <= D.
// CPU: every position lies in [0, max_position).
void check_rotary_embedding(Device device, const TensorView& positions, const TensorView& query, const TensorView& key,
                            const TensorView& cos_sin_cache);

// silu_and_mul: x [T, 2I] float; out [T, I] float.
void check_silu_and_mul(Device device, const TensorView& out, const TensorView& x);

// reshape_and_cache: key and value [T, Hkv, D] float; key_cache and value_cache
// [N, Hkv, B, D] float (CPU: bf16 also under float32 keys); slot_mapping [T] int32.
// CPU: every slot is kPadSlot (-1) or lies in [0, N * B).
void check_reshape_and_cache(Device device, const TensorView& key, const TensorView& value, const TensorView& key_cache,
                             const TensorView& value_cache, const TensorView& slot_mapping);

// copy_blocks: kv_cache [L, 2, N, Hkv, B, D] float; block_copies [C, 2] int32.
// CPU: every block id lies in [0, N).
void check_copy_blocks(Device device, const TensorView& kv_cache, const TensorView& block_copies);

// paged_attention: query and out [T, Hq, D] float; key_cache and value_cache
// [N, Hkv, B, D] float (CPU: bf16 also under float32 queries), Hq a multiple
// of Hkv, B > 0; block_tables
// [S, max_blocks], query_start_loc [S + 1] and seq_lens [S] int32.
// options: window >= 0; softcap >= 0 and finite.
// CPU: the query ranges are non-decreasing and lie within the T tokens; each
// sequence with queries holds at least q_len positions, fits its block table
// and names existing blocks where it will read them (with a window, entries
// wholly before the first query's window are not read and not checked).
void check_paged_attention(Device device, const TensorView& out, const TensorView& query, const TensorView& key_cache,
                           const TensorView& value_cache, const TensorView& block_tables,
                           const TensorView& query_start_loc, const TensorView& seq_lens,
                           const AttentionOptions& options = {});

// grouped_linear: x [T, K] float, K > 0; out [T, N]; weight [E, N, K];
// expert_offsets [E + 1] int32. CPU: the offsets are non-decreasing and lie in [0, T].
void check_grouped_linear(Device device, const TensorView& out, const TensorView& x, const TensorView& weight,
                          const TensorView& expert_offsets);

// qkv_rope_cache: qkv [T, (Hq + 2 Hkv) D] float (q, k, v columns); query_out [T, Hq, D];
// key_cache, value_cache [N, Hkv, B, D] of qkv's dtype; positions, slot_mapping [T] int32;
// cos_sin_cache [max_position, R] float32, R even, 0 < R <= D. CPU: positions in range,
// slots in the cache or kPadSlot. norm: none, or both weights [D] of qkv's dtype and eps >= 0.
void check_qkv_rope_cache(Device device, const TensorView& query_out, const TensorView& qkv,
                          const TensorView& positions, const TensorView& cos_sin, const TensorView& key_cache,
                          const TensorView& value_cache, const TensorView& slot_mapping, const QkNorm& norm = {});

// small_batch_linear: x [M, K] float, 1 <= M <= kMaxSmallBatchRows, K > 0; weight [N, K];
// bias [N] or empty (no data); out [M, N], or [M, N / 2] when gated (N even).
inline constexpr int kMaxSmallBatchRows = 8;
void check_small_batch_linear(Device device, const TensorView& out, const TensorView& x, const TensorView& weight,
                              const TensorView& bias, bool gated);

// qkv_linear_rope_cache: x, weight, bias as small_batch_linear's (not gated) but at most kMaxFusedQkvRows
// rows, weight [(Hq + 2 Hkv) D, K]; the rest as qkv_rope_cache's, with x's dtype and T = M.
inline constexpr int kMaxFusedQkvRows = 4;  // a decode step uses it at 1-2 rows; ptxas spilled at 6 (bf16)
void check_qkv_linear_rope_cache(Device device, const TensorView& query_out, const TensorView& x,
                                 const TensorView& weight, const TensorView& bias, const TensorView& positions,
                                 const TensorView& cos_sin, const TensorView& key_cache,
                                 const TensorView& value_cache, const TensorView& slot_mapping);

// sample_tokens: logits [R, V] float, V > 0; out [R] int32; inv_temperature [R] float32; allowed
// (when it has data) [R, ceil(V / 32)] int32.
void check_sample_tokens(Device device, const TensorView& out, const TensorView& logits,
                         const TensorView& inv_temperature, const TensorView& allowed);

// wait_for_flag: flag int64 [>= 2], contiguous, on the host (pinned memory for the CUDA op, which checks
// that itself) on either device; timeout_seconds > 0.
void check_wait_for_flag(const TensorView& flag, double timeout_seconds);

// ---------------------------------------------------------------------------
// The rules contracts are made of (beside tensor_view.h's require_*).

// A contiguous tensor with ndim dims on `device`.
void require_tensor(std::string_view op, std::string_view arg, const TensorView& t, Device device, int ndim);
// ... of a float dtype (float32, float16 or bfloat16).
void require_float_tensor(std::string_view op, std::string_view arg, const TensorView& t, Device device, int ndim);
// ... of dtype `dtype`.
void require_tensor_of(std::string_view op, std::string_view arg, const TensorView& t, Device device, int ndim,
                       DType dtype);
// The operands of a product by packed bf16 tiles (packed_weight_layout.h), beside the dtypes of x and
// out, which each op states: x [M, K] and out [M, N] on the CPU; packed_weight [ceil(N / 16), K_pad / 2, 32]
// bfloat16; bias [N] float32.
void check_packed_linear_operands(std::string_view op, const TensorView& out, const TensorView& x,
                                  const TensorView& packed_weight, const std::optional<TensorView>& bias);
// expert_offsets: [num_experts + 1] int32, non-decreasing within [0, rows]
// (the entries are read, so only on the CPU).
void require_expert_offsets(std::string_view op, const TensorView& offsets, int64_t num_experts, int64_t rows);
// On the same GPU as `like` (CPU tensors share the host).
void require_same_device(std::string_view op, std::string_view arg, const TensorView& t, const TensorView& like);

}  // namespace pagedserve::ops
