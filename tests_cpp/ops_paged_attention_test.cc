// paged_attention on random ragged batches against a float64 loop that reads
// each position through the block table and does a two-pass softmax.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>

#include "ops/attention_tile.h"
#include "ops/cpu_isa.h"
#include "ops/kv_cache_layout.h"
#include "ops/ops.h"
#include "ops_test_util.h"

namespace pagedserve::ops {
namespace {

using testing::HostTensor;
using testing::as_double;
using testing::throws_invalid;

struct SeqSpec {
  int32_t seq_len;
  int32_t q_len;
};

struct Shape {
  int64_t q_heads;
  int64_t kv_heads;
  int64_t head_dim;
  int64_t block_size;
};

// A batch whose sequences own randomly chosen, scattered blocks. Block 0 is
// never owned and, like every unwritten slot, holds NaN: block tables are
// padded with it (kPadBlock), so reading past a sequence poisons the output.
template <typename T>
struct PagedBatch {
  Shape shape;
  std::vector<SeqSpec> seqs;
  HostTensor<T> query, out, key_cache, value_cache;
  HostTensor<int32_t> block_tables, query_start_loc, seq_lens;

  PagedBatch(const Shape& s, std::vector<SeqSpec> specs, std::mt19937& rng, int64_t pad_tokens = 0)
      : shape(s), seqs(std::move(specs)) {
    const auto blocks_for = [&](int32_t len) { return (len + s.block_size - 1) / s.block_size; };
    int64_t owned = 0, max_blocks = 1, tokens = 0;
    for (const SeqSpec& q : seqs) {
      owned += blocks_for(q.seq_len);
      max_blocks = std::max(max_blocks, blocks_for(q.seq_len) + 1);
      tokens += q.q_len;
    }
    const int64_t num_blocks = owned + 4;
    const auto num_seqs = static_cast<int64_t>(seqs.size());
    key_cache = testing::full_tensor<T>({num_blocks, s.kv_heads, s.block_size, s.head_dim}, NAN);
    value_cache = key_cache;
    block_tables = HostTensor<int32_t>({num_seqs, max_blocks});  // zero-filled: kPadBlock
    std::vector<int32_t> free_blocks(static_cast<size_t>(num_blocks - 1));
    std::iota(free_blocks.begin(), free_blocks.end(), 1);
    std::shuffle(free_blocks.begin(), free_blocks.end(), rng);
    std::normal_distribution<float> normal;
    for (int64_t q = 0; q < num_seqs; ++q) {
      const SeqSpec& spec = seqs[static_cast<size_t>(q)];
      for (int64_t b = 0; b < blocks_for(spec.seq_len); ++b) {
        block_tables[q * max_blocks + b] = free_blocks.back();
        free_blocks.pop_back();
      }
      for (int64_t pos = 0; pos < spec.seq_len; ++pos) {
        for (int64_t h = 0; h < s.kv_heads; ++h) {
          const int64_t at = slot_offset(q, pos, h);
          for (int64_t d = 0; d < s.head_dim; ++d) {
            key_cache[at + d] = from_float<T>(normal(rng));
            value_cache[at + d] = from_float<T>(normal(rng));
          }
        }
      }
    }
    std::vector<int32_t> starts{0}, lens;
    for (const SeqSpec& q : seqs) {
      starts.push_back(starts.back() + q.q_len);
      lens.push_back(q.seq_len);
    }
    query_start_loc = testing::int_tensor({num_seqs + 1}, starts);
    seq_lens = testing::int_tensor({num_seqs}, lens);
    query = testing::random_tensor<T>({tokens + pad_tokens, s.q_heads, s.head_dim}, rng);
    out = testing::full_tensor<T>({tokens + pad_tokens, s.q_heads, s.head_dim}, NAN);
  }

  // Element offset of (sequence q, position pos, kv head h, dim 0) in a cache.
  int64_t slot_offset(int64_t q, int64_t pos, int64_t h) const {
    const int64_t block = block_tables[q * block_tables.shape[1] + pos / shape.block_size];
    return kv_cache_offset(block, h, pos % shape.block_size, shape.kv_heads, shape.block_size, shape.head_dim);
  }

  void run(float scale, const AttentionOptions& options = {}) {
    paged_attention(out.view(), query.view(), key_cache.view(), value_cache.view(), block_tables.view(),
                    query_start_loc.view(), seq_lens.view(), scale, options);
  }

  // The expected output of the real tokens, [tokens, Hq, D] flattened: each
  // query over positions [first visible, itself], scores soft-capped if asked.
  std::vector<double> oracle(double scale, const AttentionOptions& options = {}) const {
    const int64_t group = shape.q_heads / shape.kv_heads, dims = shape.head_dim;
    const int64_t tokens = query_start_loc[static_cast<int64_t>(seqs.size())];
    std::vector<double> expected(static_cast<size_t>(tokens * shape.q_heads * dims));
    for (int64_t q = 0; q < static_cast<int64_t>(seqs.size()); ++q) {
      const SeqSpec& spec = seqs[static_cast<size_t>(q)];
      for (int64_t i = 0; i < spec.q_len; ++i) {
        const int64_t token = query_start_loc[q] + i;
        const int64_t last_visible = spec.seq_len - spec.q_len + i;
        const int64_t first_visible = options.first_visible(last_visible);
        for (int64_t head = 0; head < shape.q_heads; ++head) {
          const int64_t kv_head = head / group;
          const int64_t q_at = (token * shape.q_heads + head) * dims;
          std::vector<double> scores;
          for (int64_t pos = first_visible; pos <= last_visible; ++pos) {
            double dot = 0;
            const int64_t k_at = slot_offset(q, pos, kv_head);
            for (int64_t d = 0; d < dims; ++d) dot += as_double(query[q_at + d]) * as_double(key_cache[k_at + d]);
            const double cap = options.softcap;
            scores.push_back(cap > 0 ? cap * std::tanh(dot * scale / cap) : dot * scale);
          }
          const double max = *std::max_element(scores.begin(), scores.end());
          double total = 0;
          for (double& sc : scores) total += (sc = std::exp(sc - max));
          for (int64_t d = 0; d < dims; ++d) {
            double sum = 0;
            for (int64_t pos = first_visible; pos <= last_visible; ++pos) {
              sum += scores[static_cast<size_t>(pos - first_visible)] *
                     as_double(value_cache[slot_offset(q, pos, kv_head) + d]);
            }
            expected[static_cast<size_t>(q_at + d)] = sum / total;
          }
        }
      }
    }
    return expected;
  }

  // The real tokens' outputs, and whether the padding tokens were left alone.
  HostTensor<T> real_outputs() const {
    HostTensor<T> real({static_cast<int64_t>(query_start_loc[static_cast<int64_t>(seqs.size())]), shape.q_heads,
                        shape.head_dim});
    std::copy_n(out.data.begin(), real.data.size(), real.data.begin());
    return real;
  }
  bool padding_untouched() const {
    const auto first_pad = real_outputs().data.size();
    return std::all_of(out.data.begin() + static_cast<std::ptrdiff_t>(first_pad), out.data.end(),
                       [](T v) { return std::isnan(as_double(v)); });
  }
};

// Decodes first, then prefill chunks over earlier context, a whole prompt, an empty row.
std::vector<SeqSpec> random_mixed_batch(std::mt19937& rng) {
  std::uniform_int_distribution<int32_t> context(1, 160), chunk(2, 40);
  std::vector<SeqSpec> seqs;
  for (int i = 0; i < 5; ++i) seqs.push_back({context(rng), 1});
  for (int i = 0; i < 3; ++i) {
    const int32_t q_len = chunk(rng);
    seqs.push_back({q_len + context(rng) - 1, q_len});
  }
  seqs.push_back({37, 37});
  seqs.push_back({12, 0});
  seqs.push_back({1, 1});
  return seqs;
}

template <typename T>
class PagedAttentionTest : public ::testing::Test {
 protected:
  std::mt19937 rng_{31337};
};
TYPED_TEST_SUITE(PagedAttentionTest, testing::FloatTypes);

TYPED_TEST(PagedAttentionTest, MatchesOracleOnRandomRaggedBatches) {
  using T = TypeParam;
  testing::for_each_cpu_isa([&] {
    const Shape shapes[] = {
        {4, 4, 64, 16},  // MHA
        {9, 3, 64, 16},  // SmolLM2: GQA 3
        {8, 2, 128, 16}, // GQA 4, head dim 128
        {6, 2, 64, 7},   // odd block size: chunks straddle blocks everywhere
        {4, 1, 128, 32}, // MQA-like, blocks wider than the key tile
    };
    for (const Shape& shape : shapes) {
      PagedBatch<T> batch(shape, random_mixed_batch(this->rng_), this->rng_, /*pad_tokens=*/3);
      const float scale = 1.0f / std::sqrt(static_cast<float>(shape.head_dim));
      batch.run(scale);
      EXPECT_TRUE(testing::all_close(batch.real_outputs(), batch.oracle(scale)))
          << "Hq " << shape.q_heads << " Hkv " << shape.kv_heads << " D " << shape.head_dim << " B "
          << shape.block_size;
      EXPECT_TRUE(batch.padding_untouched()) << "tokens past query_start_loc[S] must not be written";
    }
  });
}

TYPED_TEST(PagedAttentionTest, LongPrefillChunkAndLongDecodes) {
  using T = TypeParam;
  testing::for_each_cpu_isa([&] {
    // Large enough to run on the thread pool; the query tiles split the prefill.
    PagedBatch<T> batch({9, 3, 64, 16}, {{300, 1}, {257, 1}, {290, 130}}, this->rng_);
    batch.run(0.125f);
    EXPECT_TRUE(testing::all_close(batch.real_outputs(), batch.oracle(0.125)));
  });
}

TYPED_TEST(PagedAttentionTest, SlidingWindowAndSoftcapMatchOracle) {
  using T = TypeParam;
  testing::for_each_cpu_isa([&] {
    const Shape shapes[] = {{9, 3, 64, 16}, {8, 2, 128, 16}, {6, 2, 64, 7}, {4, 1, 80, 32}};
    const AttentionOptions options[] = {{1, 0.0f}, {5, 0.0f}, {16, 30.0f}, {40, 0.0f}, {0, 2.0f}, {1000, 0.0f}};
    for (const Shape& shape : shapes) {
      for (const AttentionOptions& option : options) {
        PagedBatch<T> batch(shape, random_mixed_batch(this->rng_), this->rng_);
        const float scale = 1.0f / std::sqrt(static_cast<float>(shape.head_dim));
        batch.run(scale, option);
        EXPECT_TRUE(testing::all_close(batch.real_outputs(), batch.oracle(scale, option)))
            << "D " << shape.head_dim << " B " << shape.block_size << " window " << option.window << " softcap "
            << option.softcap;
      }
    }
  });
}

TEST(PagedAttention, BlocksBeforeTheWindowAreNeverRead) {
  std::mt19937 rng(5);
  PagedBatch<float> batch({4, 2, 64, 8}, {{100, 1}, {120, 30}}, rng);
  // Window 20: the decode row reads [80, 100), the chunk [71, 120): earlier entries may be anything.
  for (int64_t b = 0; b < 10; ++b) batch.block_tables[b] = -1;
  for (int64_t b = 0; b < 8; ++b) batch.block_tables[batch.block_tables.shape[1] + b] = -1;
  batch.run(0.125f, {20, 0.0f});
  EXPECT_TRUE(testing::all_close(batch.real_outputs(), batch.oracle(0.125, {20, 0.0f})));  // reads the window only
  // Window 28 starts the decode row at position 72, in the dropped block 9.
  EXPECT_TRUE(throws_invalid([&] { batch.run(0.125f, {28, 0.0f}); }, "sequence 0: block_tables[9] = -1"));
}

TEST(PagedAttention, ThreadCountDoesNotChangeResults) {
  std::mt19937 rng(3);
  PagedBatch<float> batch({9, 3, 64, 16}, {{300, 1}, {300, 1}, {301, 1}, {200, 64}, {64, 64}}, rng);
  const int before = num_threads();
  set_num_threads(1);
  batch.run(0.125f);
  const auto single = batch.out.data;
  set_num_threads(4);
  batch.run(0.125f);
  set_num_threads(before);
  EXPECT_EQ(batch.out.data, single);
}

// The tile kernel scores a tile's first keys eight at a time (dot8) and the rest one by one (dot); which
// keys go which way depends on where the tile starts, so on how the queries were chunked. Batch invariance
// needs both to give the same bits, at every instruction set (each compiles them with its own registers).
TEST(PagedAttention, TileScoresAreTheSameEightAtATimeAndOneByOne) {
  std::mt19937 rng(6);
  std::normal_distribution<float> normal;
  const CpuIsa before = cpu_isa();
  for (const CpuIsa isa : supported_cpu_isas()) {
    set_cpu_isa(isa);
    for (const int n : {8, 64, 80, 128, 256}) {
      for (int trial = 0; trial < 50; ++trial) {
        std::vector<float> query(static_cast<size_t>(n)), keys(static_cast<size_t>(8 * n));
        for (float& v : query) v = normal(rng);
        for (float& v : keys) v = normal(rng);
        const float* key_rows[8];
        for (int k = 0; k < 8; ++k) key_rows[k] = keys.data() + k * n;
        float eight[8], one[8];
        with_tile_isa([&]<int kVectorFloats, bool kFma>() PS_INLINE_BODY {
          attention_detail::dot8<kFma>(query.data(), key_rows, n, eight);
          for (int k = 0; k < 8; ++k) one[k] = attention_detail::dot<kFma>(query.data(), key_rows[k], n);
        });
        ASSERT_EQ(std::memcmp(eight, one, sizeof eight), 0) << cpu_isa_name(isa) << ", head dim " << n;
      }
    }
  }
  set_cpu_isa(before);
}

TEST(PagedAttention, LargeScoresStayFinite) {
  std::mt19937 rng(4);
  PagedBatch<float> batch({2, 1, 64, 16}, {{50, 3}}, rng);
  for (auto& v : batch.query.data) v *= 30.0f;  // logits in the hundreds: the online max must rescale
  batch.run(1.0f);
  EXPECT_TRUE(testing::all_close(batch.real_outputs(), batch.oracle(1.0), 5.0));
}

TEST(PagedAttention, EmptyBatchIsANoOp) {
  std::mt19937 rng(5);
  PagedBatch<float> batch({2, 1, 64, 16}, {{5, 0}}, rng, /*pad_tokens=*/1);
  batch.run(0.1f);
  EXPECT_TRUE(batch.padding_untouched());
  PagedBatch<float> no_seqs({2, 1, 64, 16}, {}, rng);
  EXPECT_NO_THROW(no_seqs.run(0.1f));
}

TEST(PagedAttention, RejectsInconsistentBatches) {
  std::mt19937 rng(6);
  PagedBatch<float> batch({4, 2, 64, 16}, {{20, 4}, {3, 1}}, rng);
  const auto expect_error = [&](const std::string& needle) {
    EXPECT_TRUE(throws_invalid([&] { batch.run(1.0f); }, needle));
  };
  batch.seq_lens[0] = 3;
  expect_error("sequence 0: seq_lens = 3 is shorter than its 4 queries");
  batch.seq_lens[0] = 20;
  batch.block_tables[1] = 1000;
  expect_error("sequence 0: block_tables[1] = 1000 is not a block id");
  batch.block_tables[1] = -1;
  expect_error("block_tables[1] = -1");
  batch.block_tables[1] = 2;
  batch.seq_lens[1] = 16 * 3 + 1;
  expect_error("sequence 1: seq_lens = 49 needs 4 blocks, the block table has 3");
  batch.seq_lens[1] = 3;
  batch.query_start_loc[1] = 6;  // past query_start_loc[2] = 5
  expect_error("sequence 1: query_start_loc must be non-decreasing");
  batch.query_start_loc[1] = 4;
  batch.query_start_loc[2] = 6;
  expect_error("query_start_loc must lie within the 5 query tokens");
  batch.query_start_loc[2] = 5;
  EXPECT_NO_THROW(batch.run(1.0f));
}

TEST(PagedAttention, RejectsMismatchedTensors) {
  HostTensor<float> query({3, 6, 64}), out({3, 6, 64}), cache({4, 4, 16, 64}), cache_d({4, 2, 16, 32});
  HostTensor<float> gqa_cache({4, 2, 16, 64});
  auto tables = testing::int_tensor({1, 2}, {1, 2});
  auto starts = testing::int_tensor({2}, {0, 3});
  auto lens = testing::int_tensor({1}, {10});
  EXPECT_TRUE(throws_invalid([&] { paged_attention(out.view(), query.view(), cache.view(), cache.view(), tables.view(),
                                                   starts.view(), lens.view(), 1.0f); },
                             "query heads (6) must be a multiple of kv heads (4)"));
  EXPECT_TRUE(throws_invalid([&] { paged_attention(out.view(), query.view(), cache_d.view(), cache_d.view(),
                                                   tables.view(), starts.view(), lens.view(), 1.0f); },
                             "key_cache must have size 64 in dim 3"));
  HostTensor<Half> half_out({3, 6, 64});
  EXPECT_TRUE(throws_invalid([&] { paged_attention(half_out.view(), query.view(), gqa_cache.view(), gqa_cache.view(),
                                                   tables.view(), starts.view(), lens.view(), 1.0f); },
                             "out must have the same dtype"));
  auto short_starts = testing::int_tensor({1}, {0});
  EXPECT_TRUE(throws_invalid([&] { paged_attention(out.view(), query.view(), gqa_cache.view(), gqa_cache.view(),
                                                   tables.view(), short_starts.view(), lens.view(), 1.0f); },
                             "query_start_loc must have size 2 in dim 0"));
  TensorView strided = query.view();
  strided.strides = {64, 192, 1};
  EXPECT_TRUE(throws_invalid([&] { paged_attention(out.view(), strided, gqa_cache.view(), gqa_cache.view(),
                                                   tables.view(), starts.view(), lens.view(), 1.0f); },
                             "paged_attention: query must be contiguous, got float32[3, 6, 64] strides "
                             "[64, 192, 1] cpu"));
  EXPECT_NO_THROW(paged_attention(out.view(), query.view(), gqa_cache.view(), gqa_cache.view(), tables.view(),
                                  starts.view(), lens.view(), 1.0f));
}

}  // namespace
}  // namespace pagedserve::ops
