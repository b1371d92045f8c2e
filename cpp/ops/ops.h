// CPU reference ops. They are the engine's kernels on a CPU-only machine and
// the oracle the CUDA kernels (cuda/cuda_ops.h, same arguments plus a stream)
// are tested against.
//
// Shapes: T tokens in the step, Hq query heads, Hkv kv heads, D head dim,
// N blocks, B block size, S sequences. Float tensors are float32, float16 or
// bfloat16 (all of one op's float arguments share a dtype unless noted);
// arithmetic is float32. Index tensors are int32. All tensors are contiguous
// and on the CPU. Bad arguments throw std::invalid_argument; each op's
// argument contract, shared with its CUDA kernel, is in op_contracts.h.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include "attention_options.h"
#include "qk_norm.h"
#include "tensor_view.h"

namespace pagedserve::ops {

// out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * weight.   x, out: [T, H]; weight: [H].
// Also used per head for Qwen3's q/k norm with x viewed as [T * heads, D].
void rms_norm(const TensorView& out, const TensorView& x, const TensorView& weight, float eps);

// In place, as one fused pass: residual += x; x = rms_norm(residual) * weight.
// x, residual: [T, H]; weight: [H].
void fused_add_rms_norm(const TensorView& x, const TensorView& residual, const TensorView& weight, float eps);

// Llama-3 style frequency scaling; factor <= 0 means none ("default" rope).
struct RopeScaling {
  double factor = 0.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position = 8192;
};

// Fills the float32 table cos_sin[pos] = [cos(pos * f_0..f_{R/2-1}), sin(pos * f_0..f_{R/2-1})],
// f_i = theta^(-2i / R) (scaled per RopeScaling). cos_sin: [max_position, R], R = rotary dim.
void rope_cos_sin_cache(const TensorView& cos_sin, double theta, const RopeScaling& scaling);

// In place, half-rotation (NeoX / Llama / Qwen style): for each head, with
// x1 = x[:R/2], x2 = x[R/2:R]: x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin.
// positions: [T] int32; query: [T, Hq, D]; key: [T, Hkv, D]; cos_sin: [max_position, R] float32, R <= D.
void rotary_embedding(const TensorView& positions, const TensorView& query, const TensorView& key,
                      const TensorView& cos_sin);

// out = silu(x[:, :I]) * x[:, I:].   x: [T, 2I]; out: [T, I].
void silu_and_mul(const TensorView& out, const TensorView& x);

// Writes each token's key and value into its cache slot (kv_cache_layout.h).
// key, value: [T, Hkv, D]; key_cache, value_cache: [N, Hkv, B, D]; slot_mapping: [T]
// int32, kPadSlot entries skipped. The caches have the keys' dtype, or are bf16
// under float32 keys (a bf16 KV cache: rounded to nearest even).
void reshape_and_cache(const TensorView& key, const TensorView& value, const TensorView& key_cache,
                       const TensorView& value_cache, const TensorView& slot_mapping);

// Applies copy-on-write copies to every layer's keys and values, in order.
// kv_cache: [L, 2, N, Hkv, B, D]; block_copies: [C, 2] int32 (src, dst).
void copy_blocks(const TensorView& kv_cache, const TensorView& block_copies);

// Paged attention over a mixed varlen batch. Sequence s brings the queries
// query[query_start_loc[s] : query_start_loc[s + 1]] (q_len of them) for
// positions [seq_lens[s] - q_len, seq_lens[s]); query i attends causally to
// positions [0, seq_lens[s] - q_len + i] read through block_tables[s].
// GQA: query head h reads kv head h / (Hq / Hkv). Softmax in float32 with
// `scale`; out is written for every token of every sequence. options: a
// sliding window (which narrows "positions [0, ...]" above to the window) and
// logit soft-capping, both off by default (attention_options.h).
// A row's result depends on its query and its visible keys and values only,
// never on the rest of the batch (batch invariance: bit-identical alone, in
// any batch, however its prompt was chunked).
// out, query: [T, Hq, D]; key_cache, value_cache: [N, Hkv, B, D] of the
// query's dtype, or bf16 under float32 queries (widened to float32 as read);
// block_tables: [S, max_blocks] int32; query_start_loc: [S + 1] int32; seq_lens: [S] int32.
void paged_attention(const TensorView& out, const TensorView& query, const TensorView& key_cache,
                     const TensorView& value_cache, const TensorView& block_tables,
                     const TensorView& query_start_loc, const TensorView& seq_lens, float scale,
                     const AttentionOptions& options = {});

// Packs a linear layer's weight [N, K] (float32 / float16 / bfloat16, rounded
// to bf16) into packed: [ceil(N / 16), round_up(K, 32) / 2, 32] bfloat16
// (packed_weight_layout.h).
void pack_linear_weight(const TensorView& packed, const TensorView& weight);

// out = x W^T (+ bias) in float32 with W packed by pack_linear_weight.
// x: [M, K] float32; out: [M, N] float32; bias: [N] float32.
void packed_linear(const TensorView& out, const TensorView& x, const TensorView& packed_weight,
                   const std::optional<TensorView>& bias);

// out = x W^T with every sum in float64 (packed_linear_float64.cc), W packed by
// pack_linear_weight: the products tensor parallelism splits over their input,
// in float32, so that TP = N rounds the same sums as TP = 1. x: [M, K] float32;
// out: [M, N] float32 (float32(sum) + bias) or float64 (the sums; no bias);
// bias: [N] float32.
void packed_linear_float64_sums(const TensorView& out, const TensorView& x, const TensorView& packed_weight,
                                const std::optional<TensorView>& bias);

// out = bf16(x) W^T (+ bias) with bf16 activations (packed_linear_bf16.cc):
// x float32 (rounded to bf16, nearest-even) or bfloat16; every product of
// two bf16 values is exact, the sums are float32, out is float32 or bfloat16
// (rounded once). Twice the multiply-adds per instruction of packed_linear
// on AVX512_BF16 (vdpbf16ps) and a third of its AMX tile products.
// x: [M, K]; out: [M, N]; packed_weight from pack_linear_weight; bias: [N] float32.
void packed_linear_bf16(const TensorView& out, const TensorView& x, const TensorView& packed_weight,
                        const std::optional<TensorView>& bias);
// The kernel packed_linear_bf16 runs at the current cpu_isa(): "amx_bf16",
// "avx512_bf16", or "<level>_widened" (weights widened to float32 FMAs).
std::string_view packed_linear_bf16_kernel();

// out = x W^T (+ bias) with W as int8 channels (int8_weight_layout.h:
// packed [ceil(N / 16), round_up(K, 64) / 4, 16] int32 of 4 bytes q + 128
// each, scales [N] float32) and x quantized on the fly to int8 with a scale
// per 64-block of each row (int8_linear.cc); each block's integer dot
// products are exact, the result float32. x: [M, K] float32 or bfloat16;
// out: [M, N] float32; bias: [N] float32.
void int8_linear(const TensorView& out, const TensorView& x, const TensorView& packed_weight,
                 const TensorView& scales, const std::optional<TensorView>& bias);
// The kernel int8_linear runs now: "amx_int8", "avx512_vnni" or "<level>_int32".
std::string_view int8_linear_kernel();

// The attention's input from the qkv projection in one op: query_out = the
// rotated q columns; the rotated k columns and the v columns written into
// their cache slots; the same results as rotary_embedding then
// reshape_and_cache on the column slices (with `norm`, rms_norm of every q
// and k head first: qk_norm.h). qkv: [T, (Hq + 2 Hkv) D];
// query_out: [T, Hq, D]; key_cache, value_cache: [N, Hkv, B, D] (qkv's dtype);
// positions, slot_mapping: [T] int32 (kPadSlot: no KV write); cos_sin: [max_position, R].
void qkv_rope_cache(const TensorView& query_out, const TensorView& qkv, const TensorView& positions,
                    const TensorView& cos_sin, const TensorView& key_cache, const TensorView& value_cache,
                    const TensorView& slot_mapping, const QkNorm& norm = {});

// qkv_rope_cache applied to the product x W^T (+ bias) of a decode step's
// rows, without storing it: the reference of the CUDA kernel that fuses the
// qkv projection, rope and the cache write (cuda/qkv_linear_rope_cache.cu).
// x: [M, K], 1 <= M <= kMaxFusedQkvRows; weight: [(Hq + 2 Hkv) D, K];
// bias: [(Hq + 2 Hkv) D] or empty; the rest as qkv_rope_cache with T = M.
void qkv_linear_rope_cache(const TensorView& query_out, const TensorView& x, const TensorView& weight,
                           const TensorView& bias, const TensorView& positions, const TensorView& cos_sin,
                           const TensorView& key_cache, const TensorView& value_cache,
                           const TensorView& slot_mapping);

// out = x W^T (+ bias) for 1..kMaxSmallBatchRows rows: the reference of the
// CUDA decode-step product (cuda/small_batch_linear.cu). x: [M, K];
// weight: [N, K]; bias: [N] or empty; out: [M, N]. gated: weight is [gate; up]
// and out [M, N / 2] = silu(gate) * up, gate and up rounded to the dtype first.
void small_batch_linear(const TensorView& out, const TensorView& x, const TensorView& weight, const TensorView& bias,
                        bool gated);

// Mixture-of-experts expert products, rows grouped by expert
// (grouped_linear.h has the layout): for each expert e, rows
// [expert_offsets[e], expert_offsets[e + 1]) of x times weight[e]^T:
//   out[r] = x[r] W_e^T,   out[r, n] = sum_k x[r, k] weight[e, n, k].
// Float32 accumulation, one rounding to the dtype. Rows outside
// [expert_offsets[0], expert_offsets[E]) are not written.
// out: [T, N]; x: [T, K]; weight: [E, N, K]; expert_offsets: [E + 1] int32.
void grouped_linear(const TensorView& out, const TensorView& x, const TensorView& weight,
                    const TensorView& expert_offsets);

// The CPU's bf16 variant of grouped_linear for float32 models with bf16
// checkpoints: each expert's weight packed as pack_linear_weight packs one,
// packed: [E, ceil(N / 16), round_up(K, 32) / 2, 32] bfloat16, and each
// expert's rows run through packed_linear (AMX / AVX-512 kernels).
// weight: [E, N, K] float; x: [R, K] float32; out: [R, N] float32.
void pack_grouped_weight(const TensorView& packed, const TensorView& weight);
void packed_grouped_linear(const TensorView& out, const TensorView& x, const TensorView& packed_weight,
                           const TensorView& expert_offsets);

// Samples one token per row in one pass over the logits:
//   out[r] = argmax_v (logits[r, v] * inv_temperature[r] + gumbel(key_r, v))
// with key_r = gumbel_row_key(seed, r) and Gumbel noise from gumbel_noise.h:
// a draw from softmax(logits[r] / T) (the Gumbel-max trick). Rows with
// inv_temperature <= 0 are greedy: the plain argmax. Ties go to the lowest id.
// `allowed` (optional: no data = every token): an int32 [R, ceil(V / 32)]
// bitmask, token v of row r eligible when bit v % 32 of word v / 32 is set (the
// structured-output grammar's mask); the result is that of the logits with the
// other tokens at -inf. A row with nothing eligible (or only -inf) gives 0.
// out: [R] int32; logits: [R, V] float; inv_temperature: [R] float32.
void sample_tokens(const TensorView& out, const TensorView& logits, const TensorView& inv_temperature,
                   const TensorView& allowed, uint64_t seed);

// Waits until flag[0] >= target: a host thread's signal that data it writes
// into pinned memory (the grammar thread's token masks) is complete, so what
// the caller queues next may read it. flag: int64 [2] on the host; flag[0] only
// ever grows. After timeout_seconds without it, sets flag[1] = 1 and returns
// (the caller reports the failure; a GPU stream must not hang on a dead thread).
// The CUDA op queues the same wait on the caller's stream (one thread polls the
// pinned flag), so the device, not the host, waits.
void wait_for_flag(const TensorView& flag, int64_t target, double timeout_seconds);

// Threads the ops may use (default: hardware concurrency). Small problems run inline.
void set_num_threads(int num_threads);
int num_threads();

}  // namespace pagedserve::ops
