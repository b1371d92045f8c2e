#include "ops/decoder_layer.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <initializer_list>
#include <new>
#include <string>
#include <string_view>

#include "ops/gguf_ops.h"
#include "ops/op_contracts.h"
#include "ops/ops.h"
#include "ops/packed_weight_layout.h"

namespace pagedserve::ops {
namespace {

constexpr std::string_view kOp = "DecoderStack";
constexpr size_t kAlign = 64;  // a cache line, as torch's CPU allocator aligns
constexpr size_t kShrinkFactor = 4;  // the scratch is reallocated for a step needing 1/4 of it or less
// The MLP runs over a long step's rows this many at a time: its gate_up and act rows are 60% of the scratch
// (SmolLM2-135M: 4,608 of 7,680 columns), so a 1,536-token prefill keeps 4.5 MiB of them instead of 27 MiB
// (float32). Every linear kernel already walks rows 128 at a time (kRowChunk) and each row's sums do not
// depend on the others (batch invariance), so the bits are the same.
constexpr int64_t kMlpRows = 256;

size_t round_up(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// A contiguous view of `shape` over memory the stack owns.
TensorView view_of(std::byte* data, DType dtype, std::initializer_list<int64_t> shape) {
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.ndim = static_cast<int>(shape.size());
  int d = 0;
  for (int64_t extent : shape) t.shape[static_cast<size_t>(d++)] = extent;
  int64_t stride = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    t.strides[static_cast<size_t>(i)] = stride;
    stride *= t.shape[static_cast<size_t>(i)];
  }
  return t;
}

// Rows [begin, begin + count) of a contiguous [T, W] tensor.
TensorView row_slice(const TensorView& t, int64_t begin, int64_t count) {
  auto* base = static_cast<std::byte*>(t.data) + static_cast<size_t>(begin * t.size(1) * element_size(t.dtype));
  return view_of(base, t.dtype, {count, t.size(1)});
}

// The same memory as `t` under another contiguous shape of as many elements.
TensorView reshaped(const TensorView& t, std::initializer_list<int64_t> shape) {
  return view_of(static_cast<std::byte*>(t.data), t.dtype, shape);
}

// kv_cache[layer, which]: one layer's key (0) or value (1) cache [N, Hkv, B, D].
TensorView layer_cache(const TensorView& kv_cache, int64_t layer, int64_t which) {
  const int64_t plane = kv_cache.size(2) * kv_cache.size(3) * kv_cache.size(4) * kv_cache.size(5);
  auto* base = static_cast<std::byte*>(kv_cache.data) + (layer * 2 + which) * plane * element_size(kv_cache.dtype);
  return view_of(base, kv_cache.dtype, {kv_cache.size(2), kv_cache.size(3), kv_cache.size(4), kv_cache.size(5)});
}

// Columns [begin, begin + width) of every row of src [T, src_width] into dst [T, width].
void copy_columns(const TensorView& dst, const TensorView& src, int64_t begin, int64_t width) {
  const int64_t rows = src.size(0);
  const auto bytes = static_cast<size_t>(element_size(src.dtype));
  const auto row_bytes = static_cast<size_t>(width) * bytes;
  const auto* from = static_cast<const std::byte*>(src.data) + static_cast<size_t>(begin) * bytes;
  auto* to = static_cast<std::byte*>(dst.data);
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(to + static_cast<size_t>(r) * row_bytes, from + static_cast<size_t>(r * src.size(1)) * bytes,
                row_bytes);
  }
}

// Every matrix product of the stack goes through here, the one place a weight format is looked at.
void linear(const TensorView& out, const TensorView& x, const LinearWeights& w) {
  switch (w.format) {
    case LinearFormat::kPackedBf16:
      packed_linear(out, x, w.packed, w.bias);
      return;
    case LinearFormat::kPackedBf16Activations:
      packed_linear_bf16(out, x, w.packed, w.bias);
      return;
    case LinearFormat::kGguf:
      gguf_linear(out, x, w.packed, w.ggml_type, w.bias);
      return;
    case LinearFormat::kPackedBf16Float64Sums:
      packed_linear_float64_sums(out, x, w.packed, w.bias);
      return;
    case LinearFormat::kInt8:
      int8_linear(out, x, w.packed, *w.scales, w.bias);
      return;
  }
  fail_argument(kOp, "unknown linear format " + std::to_string(static_cast<int>(w.format)));
}

void require_vector(std::string_view arg, const TensorView& t, int64_t size, DType dtype) {
  require_tensor_of(kOp, arg, t, Device::kCPU, 1, dtype);
  require_size(kOp, arg, t, 0, size);
}

void require_index(std::string_view arg, const TensorView& t, int64_t size) {
  require_vector(arg, t, size, DType::kInt32);
}

}  // namespace

// The step's activations, carved from one buffer grown to the largest step seen.
struct DecoderStack::Scratch {
  TensorView residual;  // [T, H]
  TensorView qkv;       // [T, Hq D + 2 Hkv D]
  TensorView q, k, v;   // [T, Hq, D], [T, Hkv, D], [T, Hkv, D]: qkv's column blocks, contiguous
  TensorView q_normed;  // [T, Hq, D] (q/k norm models)
  TensorView k_normed;  // [T, Hkv, D]
  TensorView attn;      // [T, Hq, D]
  TensorView gate_up;   // [min(T, kMlpRows), 2 I]
  TensorView act;       // [min(T, kMlpRows), I]
};

void DecoderStack::AlignedFree::operator()(std::byte* p) const { ::operator delete[](p, std::align_val_t{kAlign}); }

DecoderStack::DecoderStack(const DecoderShape& shape, const TensorView& embedding, const NormWeights& final_norm,
                           int64_t vocab_size, int64_t embedding_ggml_type)
    : shape_(shape),
      embedding_(embedding),
      packed_embedding_(embedding.ndim == 3),
      embedding_ggml_type_(embedding_ggml_type),
      vocab_size_(embedding.ndim == 3 ? vocab_size : embedding.size(0)),
      final_norm_(final_norm),
      dtype_(final_norm.weight.dtype) {
  PS_REQUIRE(shape.hidden_size > 0 && shape.num_heads > 0 && shape.num_kv_heads > 0 && shape.head_dim > 0 &&
                 shape.intermediate_size > 0,
             kOp, "every size of the shape must be > 0");
  PS_REQUIRE(shape.num_heads % shape.num_kv_heads == 0, kOp, "num_heads must be a multiple of num_kv_heads");
  require_float_tensor(kOp, "final_norm", final_norm.weight, Device::kCPU, 1);
  require_vector("final_norm", final_norm.weight, shape.hidden_size, dtype_);
  if (packed_embedding_) {
    require_tensor_of(kOp, "embedding", embedding, Device::kCPU, 3, DType::kBFloat16);
    PS_REQUIRE(dtype_ == DType::kFloat32, kOp, "an embedding in bf16 tiles needs float32 activations");
    PS_REQUIRE(vocab_size > 0 && embedding.size(0) == packed_col_tiles(vocab_size) &&
                   embedding.size(1) == packed_k_pairs(shape.hidden_size) && embedding.size(2) == 2 * kPackedCols,
               kOp, "an embedding in bf16 tiles must be pack_linear_weight's layout of [vocab_size, hidden_size]");
    return;
  }
  if (embedding_ggml_type_ >= 0) {  // the row size is checked by gguf_dequantize_rows, on every lookup
    require_tensor_of(kOp, "embedding", embedding, Device::kCPU, 2, DType::kUInt8);
    PS_REQUIRE(dtype_ == DType::kFloat32, kOp, "an embedding in GGUF blocks needs float32 activations");
    return;
  }
  require_float_tensor(kOp, "embedding", embedding, Device::kCPU, 2);
  require_size(kOp, "embedding", embedding, 1, shape.hidden_size);
  // A float32 model may keep a bf16 checkpoint's table as bf16 (layers.Embedding.keep_bf16_if_exact).
  PS_REQUIRE(embedding.dtype == dtype_ || (embedding.dtype == DType::kBFloat16 && dtype_ == DType::kFloat32), kOp,
             "embedding must be in the activations' dtype (the final norm's), or bf16 under float32");
}

void DecoderStack::add_layer(const DecoderLayerWeights& layer) {
  const DecoderShape& s = shape_;
  const DType dtype = dtype_;
  const int64_t q_size = s.num_heads * s.head_dim;
  const int64_t kv_size = s.num_kv_heads * s.head_dim;
  const auto check_linear = [&](std::string_view name, const LinearWeights& w, int64_t in, int64_t out) {
    PS_REQUIRE(w.in_features == in && w.out_features == out, kOp,
               std::string(name) + " must map " + std::to_string(in) + " to " + std::to_string(out) +
                   " features, got " + std::to_string(w.in_features) + " to " + std::to_string(w.out_features));
    if (w.format == LinearFormat::kGguf) {  // [out, row bytes] blocks; gguf_linear checks the bytes per row
      require_tensor_of(kOp, name, w.packed, Device::kCPU, 2, DType::kUInt8);
      require_size(kOp, name, w.packed, 0, out);
      PS_REQUIRE(dtype == DType::kFloat32, kOp, std::string(name) + ": GGUF blocks need float32 activations");
    } else if (w.format == LinearFormat::kInt8) {  // int8_linear checks the tiles against K and N
      require_tensor_of(kOp, name, w.packed, Device::kCPU, 3, DType::kInt32);
      PS_REQUIRE(w.scales.has_value(), kOp, std::string(name) + ": int8 channels need their scales");
      require_vector(std::string(name) + " scales", *w.scales, out, DType::kFloat32);
      PS_REQUIRE(dtype == DType::kFloat32, kOp, std::string(name) + ": int8 channels need float32 activations");
    } else {
      require_tensor(kOp, name, w.packed, Device::kCPU, 3);
    }
    if (w.bias) require_vector(std::string(name) + " bias", *w.bias, out, dtype);
  };
  check_linear("qkv", layer.qkv, s.hidden_size, q_size + 2 * kv_size);
  check_linear("o", layer.o, q_size, s.hidden_size);
  check_linear("gate_up", layer.gate_up, s.hidden_size, 2 * s.intermediate_size);
  check_linear("down", layer.down, s.intermediate_size, s.hidden_size);
  require_vector("input_norm", layer.input_norm.weight, s.hidden_size, dtype);
  require_vector("post_attention_norm", layer.post_attention_norm.weight, s.hidden_size, dtype);
  PS_REQUIRE(layer.q_norm.has_value() == layer.k_norm.has_value(), kOp, "q_norm and k_norm come together");
  if (layer.q_norm) {
    require_vector("q_norm", layer.q_norm->weight, s.qk_norm_per_head ? s.head_dim : q_size, dtype);
    require_vector("k_norm", layer.k_norm->weight, s.qk_norm_per_head ? s.head_dim : kv_size, dtype);
  }
  if (layer.cos_sin) require_tensor_of(kOp, "cos_sin", *layer.cos_sin, Device::kCPU, 2, DType::kFloat32);
  has_qk_norm_ = has_qk_norm_ || layer.q_norm.has_value();
  layers_.push_back(layer);
}

void DecoderStack::check_forward(const TensorView& out, const DecoderStep& step, const TensorView& kv_cache) const {
  PS_REQUIRE(!layers_.empty(), kOp, "the stack has no layers");
  const int64_t tokens = step.input_ids.ndim == 1 ? step.input_ids.size(0) : -1;
  require_index("input_ids", step.input_ids, tokens);
  require_index("rope_positions", step.rope_positions, tokens);
  require_tensor_of(kOp, "out", out, Device::kCPU, 2, dtype_);
  require_size(kOp, "out", out, 0, tokens);
  require_size(kOp, "out", out, 1, shape_.hidden_size);
  require_float_tensor(kOp, "kv_cache", kv_cache, Device::kCPU, 6);
  require_size(kOp, "kv_cache", kv_cache, 0, num_layers());
  require_size(kOp, "kv_cache", kv_cache, 1, 2);
  require_size(kOp, "kv_cache", kv_cache, 3, shape_.num_kv_heads);
  require_size(kOp, "kv_cache", kv_cache, 5, shape_.head_dim);
  const int32_t* ids = step.input_ids.ptr<int32_t>();
  const int64_t vocab = vocab_size_;
  for (int64_t t = 0; t < tokens; ++t) {
    PS_REQUIRE(ids[t] >= 0 && ids[t] < vocab, kOp,
               "input_ids[" + std::to_string(t) + "] = " + std::to_string(ids[t]) + " is not a token id in [0, " +
                   std::to_string(vocab) + ")");
  }
}

// The embedding rows of the step's tokens: F.embedding, a copy (bf16 rows widened exactly to float32).
void DecoderStack::embed(const TensorView& residual, const TensorView& input_ids) const {
  const int64_t hidden = shape_.hidden_size;
  const int32_t* ids = input_ids.ptr<int32_t>();
  const auto widen = [](uint16_t bf16) { return std::bit_cast<float>(static_cast<uint32_t>(bf16) << 16); };
  if (packed_embedding_) {  // row ids[t] of the tiles: element k at packed_weight_offset (strided pairs)
    const auto* tiles = static_cast<const uint16_t*>(embedding_.data);
    auto* rows = static_cast<float*>(residual.data);
    for (int64_t t = 0; t < input_ids.size(0); ++t) {
      float* dst = rows + t * hidden;
      for (int64_t h = 0; h < hidden; ++h) dst[h] = widen(tiles[packed_weight_offset(ids[t], h, hidden)]);
    }
    return;
  }
  if (embedding_ggml_type_ >= 0) {
    gguf_dequantize_rows(residual, embedding_, embedding_ggml_type_, input_ids);
    return;
  }
  if (embedding_.dtype != dtype_) {
    const auto* table = static_cast<const uint16_t*>(embedding_.data);
    auto* rows = static_cast<float*>(residual.data);
    for (int64_t t = 0; t < input_ids.size(0); ++t) {
      const uint16_t* src = table + static_cast<size_t>(ids[t]) * static_cast<size_t>(hidden);
      float* dst = rows + t * hidden;
      for (int64_t h = 0; h < hidden; ++h) dst[h] = widen(src[h]);
    }
    return;
  }
  const auto row_bytes = static_cast<size_t>(hidden * element_size(dtype_));
  const auto* table = static_cast<const std::byte*>(embedding_.data);
  auto* rows = static_cast<std::byte*>(residual.data);
  for (int64_t t = 0; t < input_ids.size(0); ++t) {
    std::memcpy(rows + static_cast<size_t>(t) * row_bytes, table + static_cast<size_t>(ids[t]) * row_bytes,
                row_bytes);
  }
}

// decoder.py's DecoderLayer.forward (placement "pre") and Attention.forward, op for op.
void DecoderStack::run_layer(size_t index, const TensorView& hidden, const Scratch& s, const DecoderStep& step,
                             const TensorView& kv_cache) const {
  const DecoderLayerWeights& w = layers_[index];
  const DecoderShape& shape = shape_;
  const int64_t tokens = hidden.size(0);
  const int64_t q_size = shape.num_heads * shape.head_dim;
  const int64_t kv_size = shape.num_kv_heads * shape.head_dim;

  if (index == 0) {  // the embeddings are the residual
    rms_norm(hidden, s.residual, w.input_norm.weight, w.input_norm.eps);
  } else {
    fused_add_rms_norm(hidden, s.residual, w.input_norm.weight, w.input_norm.eps);
  }
  linear(s.qkv, hidden, w.qkv);
  copy_columns(s.q, s.qkv, 0, q_size);
  copy_columns(s.k, s.qkv, q_size, kv_size);
  copy_columns(s.v, s.qkv, q_size + kv_size, kv_size);
  TensorView query = s.q;
  TensorView key = s.k;
  if (w.q_norm) {
    const auto rows = [&](const TensorView& t, int64_t heads) {
      return shape.qk_norm_per_head ? reshaped(t, {tokens * heads, shape.head_dim})
                                    : reshaped(t, {tokens, heads * shape.head_dim});
    };
    rms_norm(rows(s.q_normed, shape.num_heads), rows(s.q, shape.num_heads), w.q_norm->weight, w.q_norm->eps);
    rms_norm(rows(s.k_normed, shape.num_kv_heads), rows(s.k, shape.num_kv_heads), w.k_norm->weight, w.k_norm->eps);
    query = s.q_normed;
    key = s.k_normed;
  }
  if (w.cos_sin) rotary_embedding(step.rope_positions, query, key, *w.cos_sin);
  const TensorView key_cache = layer_cache(kv_cache, static_cast<int64_t>(index), 0);
  const TensorView value_cache = layer_cache(kv_cache, static_cast<int64_t>(index), 1);
  reshape_and_cache(key, s.v, key_cache, value_cache, step.slot_mapping);
  paged_attention(s.attn, query, key_cache, value_cache, step.block_tables, step.query_start_loc, step.seq_lens,
                  w.attention_scale, w.attention);
  linear(hidden, reshaped(s.attn, {tokens, q_size}), w.o);
  fused_add_rms_norm(hidden, s.residual, w.post_attention_norm.weight, w.post_attention_norm.eps);
  for (int64_t begin = 0; begin < tokens; begin += kMlpRows) {  // in place: a chunk's rows are read, then written
    const int64_t count = std::min(kMlpRows, tokens - begin);
    const TensorView rows = row_slice(hidden, begin, count);
    const TensorView gate_up = reshaped(s.gate_up, {count, 2 * shape.intermediate_size});
    const TensorView act = reshaped(s.act, {count, shape.intermediate_size});
    linear(gate_up, rows, w.gate_up);
    silu_and_mul(act, gate_up);
    linear(rows, act, w.down);
  }
}

void DecoderStack::forward(const TensorView& out, const DecoderStep& step, const TensorView& kv_cache) {
  check_forward(out, step, kv_cache);
  const std::lock_guard<std::mutex> lock(mutex_);
  const DecoderShape& shape = shape_;
  const DType dtype = dtype_;
  const int64_t tokens = out.size(0);
  const int64_t q_size = shape.num_heads * shape.head_dim;
  const int64_t kv_size = shape.num_kv_heads * shape.head_dim;
  const int64_t normed = has_qk_norm_ ? 1 : 0;  // the q/k norm outputs exist only where a layer has them
  const int64_t mlp_rows = std::min(tokens, kMlpRows);
  const int64_t widths[] = {shape.hidden_size, q_size + 2 * kv_size, q_size, kv_size, kv_size, normed * q_size,
                            normed * kv_size, q_size};
  size_t needed = 0;
  for (int64_t width : widths) needed += round_up(static_cast<size_t>(tokens * width * element_size(dtype)));
  for (int64_t width : {2 * shape.intermediate_size, shape.intermediate_size}) {
    needed += round_up(static_cast<size_t>(mlp_rows * width * element_size(dtype)));
  }
  // Grown for a larger step; given back for one that needs a quarter of it or less, so the decode steps
  // after a long prefill do not keep its activations resident (SmolLM2-135M, 1536 tokens: 22.5 MiB in float32).
  if (needed > buffer_bytes_ || (needed > 0 && needed * kShrinkFactor <= buffer_bytes_)) {
    buffer_.reset();  // freed first: never both at once
    buffer_.reset(static_cast<std::byte*>(::operator new[](needed, std::align_val_t{kAlign})));
    buffer_bytes_ = needed;
  }
  std::byte* next = buffer_.get();
  const auto carve = [&](std::initializer_list<int64_t> dims) {
    const TensorView t = view_of(next, dtype, dims);
    next += round_up(static_cast<size_t>(t.numel() * element_size(dtype)));
    return t;
  };
  const int64_t heads = shape.num_heads, kv_heads = shape.num_kv_heads, d = shape.head_dim;
  Scratch s;
  s.residual = carve({tokens, shape.hidden_size});
  s.qkv = carve({tokens, q_size + 2 * kv_size});
  s.q = carve({tokens, heads, d});
  s.k = carve({tokens, kv_heads, d});
  s.v = carve({tokens, kv_heads, d});
  s.q_normed = carve({normed * tokens, heads, d});
  s.k_normed = carve({normed * tokens, kv_heads, d});
  s.attn = carve({tokens, heads, d});
  s.gate_up = carve({mlp_rows, 2 * shape.intermediate_size});
  s.act = carve({mlp_rows, shape.intermediate_size});

  embed(s.residual, step.input_ids);
  for (size_t layer = 0; layer < layers_.size(); ++layer) run_layer(layer, out, s, step, kv_cache);
  fused_add_rms_norm(out, s.residual, final_norm_.weight, final_norm_.eps);
}

}  // namespace pagedserve::ops
