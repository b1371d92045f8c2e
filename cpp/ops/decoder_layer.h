// DecoderStack: every layer of a standard pre-norm decoder, one call per step.
//
// The layer is Llama's (also Mistral, Qwen2, Qwen3, SmolLM2/3, Phi-3):
//
//   x = add_rms_norm(x, residual)            input norm (the first layer: rms_norm of the embeddings)
//   q, k, v = split(x Wqkv^T + b)            optional per-head (or whole) q/k RMSNorm, then rope
//   write k, v into the paged cache; a = paged_attention(q, cache)
//   x = add_rms_norm(a Wo^T + b, residual)   post-attention norm
//   x = (silu(x Wg^T) * x Wu^T) Wd^T         the gated MLP
//
// and the stack ends with the final add_rms_norm. The Python decoder
// (python/pagedserve/models/decoder.py) runs the same layer as about eleven op
// calls; a step of a 30-layer model makes some 330 crossings into C++, each
// with its DLPack conversions, which cost a small model's decode step on a CPU
// 15-20% of its time. Here each step is one crossing: the stack calls the same
// ops (ops.h) in the same order on the same values, so its hidden states are
// bit-identical to the per-op path's (tests_py/test_fused_layers.py).
//
// Weights are borrowed views (the caller keeps the tensors alive, see
// bindings/bind_decoder_stack.cc). Linear weights are in packed_linear's bf16
// tiles, a GGUF file's blocks (gguf_ops.h) or int8_linear's int8 channels;
// `linear` in decoder_layer.cc is
// the one place a product is computed. Activations take the final norm's
// dtype; the KV cache is passed to the cache and attention ops as it is,
// whatever its dtype.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "ops/attention_options.h"
#include "ops/tensor_view.h"

namespace pagedserve::ops {

// How a linear's weight is stored and multiplied: one value per Python LinearKernel class the stack
// runs (python/pagedserve/models/linear_kernels.py); `linear` in decoder_layer.cc dispatches on it.
enum class LinearFormat : uint8_t {
  kPackedBf16,  // packed_linear: bf16 tiles, float32 activations (PackedBf16)
  kPackedBf16Activations,  // packed_linear_bf16: the same tiles, bf16-rounded activations (PackedBf16Activations)
  kGguf,  // gguf_linear: a GGUF file's blocks of one ggml type, float32 activations (GgufLinear)
  kPackedBf16Float64Sums,  // packed_linear_float64_sums: bf16 tiles, float32 activations, float64 sums
                           // (PackedBf16 on a product tensor parallelism splits over its input: Linear.float64_sums)
  kInt8,  // int8_linear: int8 channels and their scales, float32 activations quantized per 64-block (Int8Linear)
};

// One Linear: y = x W^T (+ bias), W [out_features, in_features] in `format`.
struct LinearWeights {
  LinearFormat format = LinearFormat::kPackedBf16;
  TensorView packed;  // the tiles, kGguf's blocks [out_features, row bytes] uint8, or kInt8's int32 tiles
  int64_t ggml_type = -1;  // kGguf: the blocks' ggml type number (gguf_ops.h)
  std::optional<TensorView> scales;  // kInt8: [out_features] float32, one per channel
  std::optional<TensorView> bias;  // [out_features]
  int64_t in_features = 0;
  int64_t out_features = 0;
};

struct NormWeights {
  TensorView weight;
  float eps = 0.0f;
};

struct DecoderLayerWeights {
  NormWeights input_norm;           // [H]
  LinearWeights qkv;                // H -> Hq * D + 2 * Hkv * D
  std::optional<NormWeights> q_norm;  // [D] per head, or [Hq * D] (qk_norm_per_head false)
  std::optional<NormWeights> k_norm;  // [D] per head, or [Hkv * D]
  std::optional<TensorView> cos_sin;  // the rope table [positions, R]; none: a layer without rope (SmolLM3)
  float attention_scale = 1.0f;
  AttentionOptions attention;
  LinearWeights o;                  // Hq * D -> H
  NormWeights post_attention_norm;  // [H]
  LinearWeights gate_up;            // H -> 2 I
  LinearWeights down;               // I -> H
};

struct DecoderShape {
  int64_t hidden_size = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t intermediate_size = 0;
  bool qk_norm_per_head = true;
};

// One step's tokens and where they go in the paged cache (AttentionMetadata's tensors, int32).
struct DecoderStep {
  TensorView input_ids;        // [T]
  TensorView rope_positions;   // [T] rows of the cos/sin tables (positions, or longrope's long rows)
  TensorView slot_mapping;     // [T]
  TensorView block_tables;     // [S, max_blocks]
  TensorView query_start_loc;  // [S + 1]
  TensorView seq_lens;         // [S]
};

class DecoderStack {
 public:
  // embedding [V, H]: the token table; final_norm [H], whose dtype is the activations' (the table's, or
  // bf16 under float32 activations: a bf16 checkpoint's table kept narrow, widened exactly on lookup).
  // Under float32 activations the table may also be a tied LM head's bf16 tiles (packed_weight_layout.h:
  // [ceil(V / 16), K_pad / 2, 32]), so a bf16 checkpoint's table is held once, not twice; its rows are
  // gathered from the tiles, the same values. vocab_size: V, required for tiles (their rows are padded).
  // embedding_ggml_type >= 0: the table is a GGUF file's blocks [V, row bytes] uint8 of that type, its
  // rows decoded on lookup (gguf_dequantize_rows), under float32 activations.
  DecoderStack(const DecoderShape& shape, const TensorView& embedding, const NormWeights& final_norm,
               int64_t vocab_size = -1, int64_t embedding_ggml_type = -1);

  // Appends the next layer; throws std::invalid_argument naming the weight when a shape or dtype
  // disagrees with the stack's.
  void add_layer(const DecoderLayerWeights& layer);

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // out [T, H]: the final normalised hidden states of the step's tokens (what the model's forward
  // returns). kv_cache [L, 2, N, Hkv, B, D], written at slot_mapping. Calls from several threads
  // take turns (the scratch buffers are the stack's).
  void forward(const TensorView& out, const DecoderStep& step, const TensorView& kv_cache);

 private:
  struct Scratch;

  void check_forward(const TensorView& out, const DecoderStep& step, const TensorView& kv_cache) const;
  void run_layer(size_t index, const TensorView& hidden, const Scratch& s, const DecoderStep& step,
                 const TensorView& kv_cache) const;
  void embed(const TensorView& residual, const TensorView& input_ids) const;

  DecoderShape shape_;
  TensorView embedding_;
  bool packed_embedding_ = false;  // embedding_ holds bf16 tiles, not a [V, H] table
  int64_t embedding_ggml_type_ = -1;  // >= 0: embedding_ holds GGUF blocks of this type
  int64_t vocab_size_ = 0;
  NormWeights final_norm_;
  DType dtype_;  // the activations'
  std::vector<DecoderLayerWeights> layers_;
  bool has_qk_norm_ = false;

  std::mutex mutex_;  // guards the scratch buffers during forward
  struct AlignedFree {
    void operator()(std::byte* p) const;
  };
  std::unique_ptr<std::byte[], AlignedFree> buffer_;
  size_t buffer_bytes_ = 0;
};

}  // namespace pagedserve::ops
