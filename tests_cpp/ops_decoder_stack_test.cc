// DecoderStack (ops/decoder_layer.h) against a float64 decoder written out
// loop by loop: a prompt's prefill and then a decode step that reads the
// prompt's keys and values back from the paged cache. The bit-identity with
// the Python per-op path is tests_py/test_fused_layers.py; here the stack's
// arithmetic meets an independent oracle, and its argument checks are named.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <optional>
#include <random>
#include <stdexcept>
#include <vector>

#include "ops/decoder_layer.h"
#include "ops/ops.h"
#include "ops_test_util.h"

namespace pagedserve::testing {
namespace {

using ops::DecoderLayerWeights;
using ops::DecoderShape;
using ops::DecoderStack;
using ops::DecoderStep;
using ops::LinearWeights;
using ops::NormWeights;

constexpr int64_t kHidden = 32, kHeads = 4, kKvHeads = 2, kHeadDim = 8, kInter = 40, kVocab = 20, kLayers = 2;
constexpr int64_t kQ = kHeads * kHeadDim, kKv = kKvHeads * kHeadDim;
constexpr int64_t kBlock = 4, kBlocks = 4, kMaxPosition = 16;
constexpr float kEps = 1e-5f;

float bf16_exact(float v) { return ops::bf16_to_float(ops::float_to_bf16(v)); }

HostTensor<float> random_tensor(std::vector<int64_t> shape, std::mt19937& rng, float scale, float offset = 0.0f) {
  HostTensor<float> t(std::move(shape));
  std::normal_distribution<float> normal(0.0f, scale);
  for (float& v : t.data) v = bf16_exact(offset + normal(rng));
  return t;
}

struct Linear {
  HostTensor<float> weight, bias, packed_storage;
  HostTensor<BFloat16> packed;

  Linear(int64_t in, int64_t out, std::mt19937& rng)
      : weight(random_tensor({out, in}, rng, 0.2f)), bias(random_tensor({out}, rng, 0.1f)),
        packed({(out + 15) / 16, (in + 31) / 32 * 16, 32}) {
    ops::pack_linear_weight(packed.view(), weight.view());
  }
  LinearWeights view() const {
    LinearWeights w;
    w.packed = packed.view();
    w.bias = bias.view();
    w.in_features = weight.shape[1];
    w.out_features = weight.shape[0];
    return w;
  }
};

struct Layer {
  HostTensor<float> input_norm, post_norm, q_norm, k_norm;
  Linear qkv, o, gate_up, down;

  explicit Layer(std::mt19937& rng)
      : input_norm(random_tensor({kHidden}, rng, 0.2f, 1.0f)), post_norm(random_tensor({kHidden}, rng, 0.2f, 1.0f)),
        q_norm(random_tensor({kHeadDim}, rng, 0.2f, 1.0f)), k_norm(random_tensor({kHeadDim}, rng, 0.2f, 1.0f)),
        qkv(kHidden, kQ + 2 * kKv, rng), o(kQ, kHidden, rng), gate_up(kHidden, 2 * kInter, rng),
        down(kInter, kHidden, rng) {}
};

struct Model {
  std::mt19937 rng{11};
  HostTensor<float> embedding = random_tensor({kVocab, kHidden}, rng, 1.0f);
  HostTensor<BFloat16> embedding_tiles{{(kVocab + 15) / 16, (kHidden + 31) / 32 * 16, 32}};  // a tied head's
  HostTensor<float> final_norm = random_tensor({kHidden}, rng, 0.2f, 1.0f);
  HostTensor<float> cos_sin{{kMaxPosition, kHeadDim}};
  std::vector<Layer> layers;

  Model() {
    ops::pack_linear_weight(embedding_tiles.view(), embedding.view());
    ops::rope_cos_sin_cache(cos_sin.view(), 10000.0, {});
    for (int64_t l = 0; l < kLayers; ++l) layers.emplace_back(rng);
  }

  // tiles: the embedding rows read from embedding_tiles (a tied LM head's), not the table.
  std::unique_ptr<DecoderStack> stack(bool tiles = false) const {
    auto stack = std::make_unique<DecoderStack>(DecoderShape{kHidden, kHeads, kKvHeads, kHeadDim, kInter, true},
                                                tiles ? embedding_tiles.view() : embedding.view(),
                                                NormWeights{final_norm.view(), kEps}, tiles ? kVocab : -1);
    for (const Layer& layer : layers) {
      DecoderLayerWeights w;
      w.input_norm = {layer.input_norm.view(), kEps};
      w.qkv = layer.qkv.view();
      w.q_norm = NormWeights{layer.q_norm.view(), kEps};
      w.k_norm = NormWeights{layer.k_norm.view(), kEps};
      w.cos_sin = cos_sin.view();
      w.attention_scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
      w.o = layer.o.view();
      w.post_attention_norm = {layer.post_norm.view(), kEps};
      w.gate_up = layer.gate_up.view();
      w.down = layer.down.view();
      stack->add_layer(w);
    }
    return stack;
  }
};

using Rows = std::vector<std::vector<double>>;

std::vector<double> rms_norm(const std::vector<double>& x, const float* weight) {
  double squares = 0.0;
  for (double v : x) squares += v * v;
  const double inv = 1.0 / std::sqrt(squares / static_cast<double>(x.size()) + kEps);
  std::vector<double> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = x[i] * inv * weight[i];
  return out;
}

std::vector<double> linear(const std::vector<double>& x, const Linear& w) {
  const int64_t in = w.weight.shape[1], out = w.weight.shape[0];
  std::vector<double> y(static_cast<size_t>(out));
  for (int64_t n = 0; n < out; ++n) {
    double sum = w.bias[n];
    for (int64_t k = 0; k < in; ++k) sum += x[static_cast<size_t>(k)] * w.weight[n * in + k];
    y[static_cast<size_t>(n)] = sum;
  }
  return y;
}

// Head h of a row (q, k or v block at `offset`), normalised per head (when `norm`) and rotated to `pos`.
std::vector<double> head(const std::vector<double>& qkv, int64_t offset, const float* norm, const Model& m,
                         int64_t pos) {
  std::vector<double> x(qkv.begin() + offset, qkv.begin() + offset + kHeadDim);
  if (norm == nullptr) return x;
  x = rms_norm(x, norm);
  const int64_t half = kHeadDim / 2;
  std::vector<double> out = x;
  for (int64_t i = 0; i < half; ++i) {
    const double c = m.cos_sin[pos * kHeadDim + i], s = m.cos_sin[pos * kHeadDim + half + i];
    out[static_cast<size_t>(i)] = x[static_cast<size_t>(i)] * c - x[static_cast<size_t>(half + i)] * s;
    out[static_cast<size_t>(half + i)] = x[static_cast<size_t>(half + i)] * c + x[static_cast<size_t>(i)] * s;
  }
  return out;
}

// The float64 model over one sequence of tokens at positions 0.. (causal): each token's final hidden state.
Rows reference(const Model& m, const std::vector<int32_t>& ids) {
  const auto tokens = static_cast<int64_t>(ids.size());
  Rows stream;
  for (int32_t id : ids) stream.emplace_back(m.embedding.data.begin() + id * kHidden,
                                             m.embedding.data.begin() + (id + 1) * kHidden);
  for (const Layer& layer : m.layers) {
    Rows qkv;
    for (const auto& row : stream) qkv.push_back(linear(rms_norm(row, layer.input_norm.data.data()), layer.qkv));
    for (int64_t t = 0; t < tokens; ++t) {
      std::vector<double> attn(static_cast<size_t>(kQ));
      for (int64_t h = 0; h < kHeads; ++h) {
        const int64_t g = h / (kHeads / kKvHeads);
        const auto q = head(qkv[static_cast<size_t>(t)], h * kHeadDim, layer.q_norm.data.data(), m, t);
        std::vector<double> scores;
        for (int64_t j = 0; j <= t; ++j) {
          const auto k = head(qkv[static_cast<size_t>(j)], kQ + g * kHeadDim, layer.k_norm.data.data(), m, j);
          double dot = 0.0;
          for (int64_t d = 0; d < kHeadDim; ++d) dot += q[static_cast<size_t>(d)] * k[static_cast<size_t>(d)];
          scores.push_back(dot / std::sqrt(static_cast<double>(kHeadDim)));
        }
        double top = scores[0], total = 0.0;
        for (double s : scores) top = std::max(top, s);
        for (double& s : scores) total += (s = std::exp(s - top));
        for (int64_t j = 0; j <= t; ++j) {
          const auto v = head(qkv[static_cast<size_t>(j)], kQ + kKv + g * kHeadDim, nullptr, m, j);
          for (int64_t d = 0; d < kHeadDim; ++d) {
            attn[static_cast<size_t>(h * kHeadDim + d)] += scores[static_cast<size_t>(j)] / total * v[static_cast<size_t>(d)];
          }
        }
      }
      auto& row = stream[static_cast<size_t>(t)];
      const auto o = linear(attn, layer.o);
      for (int64_t i = 0; i < kHidden; ++i) row[static_cast<size_t>(i)] += o[static_cast<size_t>(i)];
      const auto gu = linear(rms_norm(row, layer.post_norm.data.data()), layer.gate_up);
      std::vector<double> act(static_cast<size_t>(kInter));
      for (int64_t i = 0; i < kInter; ++i) {
        const double g = gu[static_cast<size_t>(i)];
        act[static_cast<size_t>(i)] = g / (1.0 + std::exp(-g)) * gu[static_cast<size_t>(kInter + i)];
      }
      const auto d = linear(act, layer.down);
      for (int64_t i = 0; i < kHidden; ++i) row[static_cast<size_t>(i)] += d[static_cast<size_t>(i)];
    }
  }
  for (auto& row : stream) row = rms_norm(row, m.final_norm.data.data());
  return stream;
}

// One step of a single sequence: tokens [first, first + count) of `ids`, blocks {2, 0} (out of order).
struct Step {
  HostTensor<int32_t> ids, positions, slots, block_tables{{1, 2}}, query_start_loc{{2}}, seq_lens{{1}};

  Step(const std::vector<int32_t>& all, int64_t first, int64_t count)
      : ids({count}), positions({count}), slots({count}) {
    block_tables[0] = 2;
    block_tables[1] = 0;
    for (int64_t i = 0; i < count; ++i) {
      const int64_t p = first + i;
      ids[i] = all[static_cast<size_t>(p)];
      positions[i] = static_cast<int32_t>(p);
      slots[i] = static_cast<int32_t>(block_tables[p / kBlock] * kBlock + p % kBlock);
    }
    query_start_loc[0] = 0;
    query_start_loc[1] = static_cast<int32_t>(count);
    seq_lens[0] = static_cast<int32_t>(first + count);
  }
  DecoderStep view() const {
    return {ids.view(), positions.view(), slots.view(), block_tables.view(), query_start_loc.view(), seq_lens.view()};
  }
};

TEST(DecoderStack, PrefillThenDecodeMatchFloat64) {
  const Model model;
  const auto stack = model.stack();
  const std::vector<int32_t> ids{3, 17, 0, 9, 9, 12};
  const Rows expected = reference(model, ids);
  HostTensor<float> kv_cache({kLayers, 2, kBlocks, kKvHeads, kBlock, kHeadDim});
  std::vector<float> got;
  for (const auto& [first, count] : {std::pair<int64_t, int64_t>{0, 5}, {5, 1}}) {
    HostTensor<float> out({count, kHidden});
    stack->forward(out.view(), Step(ids, first, count).view(), kv_cache.view());
    got.insert(got.end(), out.data.begin(), out.data.end());
  }
  for (size_t t = 0; t < ids.size(); ++t) {
    for (int64_t i = 0; i < kHidden; ++i) {
      EXPECT_NEAR(got[t * kHidden + static_cast<size_t>(i)], expected[t][static_cast<size_t>(i)], 2e-4)
          << "token " << t << " dim " << i;
    }
  }
}

// Every step through both stacks: a prefill of 5 tokens, then decodes of 1 (the scratch shrinks for them).
std::vector<float> run_steps(DecoderStack& stack, const std::vector<int32_t>& ids) {
  HostTensor<float> kv_cache({kLayers, 2, kBlocks, kKvHeads, kBlock, kHeadDim});
  std::vector<float> got;
  for (const auto& [first, count] : {std::pair<int64_t, int64_t>{0, 5}, {5, 1}, {6, 1}}) {
    HostTensor<float> out({count, kHidden});
    stack.forward(out.view(), Step(ids, first, count).view(), kv_cache.view());
    got.insert(got.end(), out.data.begin(), out.data.end());
  }
  return got;
}

TEST(DecoderStack, EmbeddingRowsFromTiedHeadTilesAreBitIdentical) {
  const Model model;
  const std::vector<int32_t> ids{3, 17, 0, 19, 9, 12, 16};  // rows in the first and the (padded) last tile
  EXPECT_EQ(run_steps(*model.stack(true), ids), run_steps(*model.stack(false), ids));
}

TEST(DecoderStack, NamesBadEmbeddingTiles) {
  const Model model;
  const NormWeights norm{model.final_norm.view(), kEps};
  const DecoderShape shape{kHidden, kHeads, kKvHeads, kHeadDim, kInter, true};
  try {
    DecoderStack(shape, model.embedding_tiles.view(), norm, kVocab + 16);  // one tile more than there are
    ADD_FAILURE() << "no error for tiles of another vocabulary";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("pack_linear_weight's layout"), std::string::npos) << e.what();
  }
  const auto stack = model.stack(true);
  HostTensor<float> kv_cache({kLayers, 2, kBlocks, kKvHeads, kBlock, kHeadDim});
  HostTensor<float> out({1, kHidden});
  const std::vector<int32_t> ids{kVocab};  // inside the last tile's padding, not a token
  try {
    stack->forward(out.view(), Step(ids, 0, 1).view(), kv_cache.view());
    ADD_FAILURE() << "no error for a token id in the tiles' padding";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("is not a token id in [0, 20)"), std::string::npos) << e.what();
  }
}

TEST(DecoderStack, NamesBadArguments) {
  const Model model;
  const auto stack = model.stack();
  HostTensor<float> kv_cache({kLayers, 2, kBlocks, kKvHeads, kBlock, kHeadDim});
  HostTensor<float> out({1, kHidden});
  std::vector<int32_t> ids{kVocab};
  const auto expect_error = [](auto&& call, const std::string& message) {
    try {
      call();
      ADD_FAILURE() << "no error, expected: " << message;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  };
  expect_error([&] { stack->forward(out.view(), Step(ids, 0, 1).view(), kv_cache.view()); },
               "DecoderStack: input_ids[0] = 20 is not a token id in [0, 20)");
  HostTensor<float> one_layer({1, 2, kBlocks, kKvHeads, kBlock, kHeadDim});
  ids[0] = 1;
  expect_error([&] { stack->forward(out.view(), Step(ids, 0, 1).view(), one_layer.view()); },
               "DecoderStack: kv_cache must have size 2 in dim 0");
  HostTensor<float> wide({1, kHidden + 1});
  expect_error([&] { stack->forward(wide.view(), Step(ids, 0, 1).view(), kv_cache.view()); },
               "DecoderStack: out must have size 32 in dim 1");
  DecoderLayerWeights w;
  std::mt19937 rng(3);
  const Linear wrong(kHidden, kQ, rng);  // qkv without its k and v blocks
  w.qkv = wrong.view();
  expect_error([&] { stack->add_layer(w); }, "DecoderStack: qkv must map 32 to 64 features, got 32 to 32");
  // GGUF blocks are raw bytes [out, row bytes], multiplied under float32 activations only.
  w.qkv = model.layers[0].qkv.view();
  w.qkv.format = ops::LinearFormat::kGguf;
  w.qkv.ggml_type = 8;  // Q8_0
  expect_error([&] { stack->add_layer(w); }, "DecoderStack: qkv");
  HostTensor<BFloat16> bf16_norm_weight({kHidden});
  HostTensor<float> blocks_as_float({kVocab, 34});
  HostTensor<uint8_t> blocks({kVocab, 34});
  expect_error(
      [&] {
        DecoderStack(DecoderShape{kHidden, kHeads, kKvHeads, kHeadDim, kInter, true}, blocks_as_float.view(),
                     NormWeights{model.final_norm.view(), kEps}, -1, /*embedding_ggml_type=*/8);
      },
      "DecoderStack: embedding");
  expect_error(
      [&] {
        DecoderStack(DecoderShape{kHidden, kHeads, kKvHeads, kHeadDim, kInter, true}, blocks.view(),
                     NormWeights{bf16_norm_weight.view(), kEps}, -1, /*embedding_ggml_type=*/8);
      },
      "DecoderStack: an embedding in GGUF blocks needs float32 activations");
}

}  // namespace
}  // namespace pagedserve::testing
