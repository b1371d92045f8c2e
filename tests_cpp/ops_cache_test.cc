// reshape_and_cache and copy_blocks against element-by-element loops.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>

#include "ops/kv_cache_layout.h"
#include "ops/ops.h"
#include "ops_test_util.h"

namespace pagedserve::ops {
namespace {

using testing::HostTensor;
using testing::random_tensor;
using testing::throws_invalid;

template <typename T>
bool same_bits(const T& a, const T& b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

template <typename T>
class CacheOpsTest : public ::testing::Test {
 protected:
  std::mt19937 rng_{99};
};
TYPED_TEST_SUITE(CacheOpsTest, testing::FloatTypes);

TYPED_TEST(CacheOpsTest, ReshapeAndCacheWritesEachSlotAndSkipsPadding) {
  using T = TypeParam;
  for (auto [block_size, head_dim] : {std::pair<int64_t, int64_t>{16, 64}, {5, 24}}) {
    const int64_t num_blocks = 7, kv_heads = 3, tokens = 23;
    auto key_cache = random_tensor<T>({num_blocks, kv_heads, block_size, head_dim}, this->rng_);
    auto value_cache = random_tensor<T>({num_blocks, kv_heads, block_size, head_dim}, this->rng_);
    const auto key_before = key_cache, value_before = value_cache;
    auto key = random_tensor<T>({tokens, kv_heads, head_dim}, this->rng_);
    auto value = random_tensor<T>({tokens, kv_heads, head_dim}, this->rng_);
    std::vector<int32_t> all_slots(static_cast<size_t>(num_blocks * block_size));
    std::iota(all_slots.begin(), all_slots.end(), 0);
    std::shuffle(all_slots.begin(), all_slots.end(), this->rng_);
    auto slots = testing::int_tensor({tokens}, std::vector<int32_t>(all_slots.begin(), all_slots.begin() + tokens));
    slots[2] = kPadSlot;
    slots[tokens - 1] = kPadSlot;

    reshape_and_cache(key.view(), value.view(), key_cache.view(), value_cache.view(), slots.view());

    // Expected: the old cache with each real token's rows written at its slot.
    auto expected_key = key_before, expected_value = value_before;
    for (int64_t t = 0; t < tokens; ++t) {
      if (slots[t] == kPadSlot) continue;
      const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
      for (int64_t h = 0; h < kv_heads; ++h) {
        for (int64_t d = 0; d < head_dim; ++d) {
          const int64_t at = ((block * kv_heads + h) * block_size + offset) * head_dim + d;
          expected_key[at] = key[(t * kv_heads + h) * head_dim + d];
          expected_value[at] = value[(t * kv_heads + h) * head_dim + d];
        }
      }
    }
    for (int64_t i = 0; i < key_cache.numel(); ++i) {
      ASSERT_TRUE(same_bits(key_cache[i], expected_key[i])) << "key element " << i;
      ASSERT_TRUE(same_bits(value_cache[i], expected_value[i])) << "value element " << i;
    }
  }
}

TEST(ReshapeAndCache, RejectsBadArguments) {
  HostTensor<float> key({2, 1, 8}), cache({2, 1, 4, 8}), value_cache({2, 1, 4, 8});
  auto slots = testing::int_tensor({2}, {0, 8});
  EXPECT_TRUE(throws_invalid([&] { reshape_and_cache(key.view(), key.view(), cache.view(), value_cache.view(), slots.view()); },
                             "slot_mapping[1] = 8 is outside the cache [0, 8)"));
  slots[1] = -5;
  EXPECT_TRUE(throws_invalid([&] { reshape_and_cache(key.view(), key.view(), cache.view(), value_cache.view(), slots.view()); },
                             "slot_mapping[1] = -5"));
  slots[1] = 1;
  HostTensor<float> wide_cache({2, 1, 4, 16});
  EXPECT_TRUE(throws_invalid(
      [&] { reshape_and_cache(key.view(), key.view(), wide_cache.view(), wide_cache.view(), slots.view()); },
      "key_cache must have size 8 in dim 3"));
  HostTensor<Half> half_cache({2, 1, 4, 8});
  EXPECT_TRUE(throws_invalid(
      [&] { reshape_and_cache(key.view(), key.view(), half_cache.view(), value_cache.view(), slots.view()); },
      "key_cache must have the same dtype"));
  HostTensor<int64_t> long_slots({2});
  EXPECT_TRUE(throws_invalid(
      [&] { reshape_and_cache(key.view(), key.view(), cache.view(), value_cache.view(), long_slots.view()); },
      "slot_mapping must be int32"));
}

TYPED_TEST(CacheOpsTest, CopyBlocksAppliesCopiesInOrderInEveryLayer) {
  using T = TypeParam;
  const int64_t layers = 3, num_blocks = 9, kv_heads = 2, block_size = 4, head_dim = 12;
  auto cache = random_tensor<T>({layers, 2, num_blocks, kv_heads, block_size, head_dim}, this->rng_);
  // 1 -> 4 then 4 -> 5: block 5 must end with block 1's data. 7 -> 7 is a no-op.
  auto copies = testing::int_tensor({4, 2}, {1, 4, 4, 5, 0, 8, 7, 7});
  auto expected = cache;
  const int64_t block_elems = kv_heads * block_size * head_dim;
  for (int64_t c = 0; c < 4; ++c) {
    for (int64_t plane = 0; plane < layers * 2; ++plane) {
      const int64_t base = plane * num_blocks * block_elems;
      for (int64_t i = 0; i < block_elems; ++i) {
        expected[base + copies[2 * c + 1] * block_elems + i] = expected[base + copies[2 * c] * block_elems + i];
      }
    }
  }
  copy_blocks(cache.view(), copies.view());
  for (int64_t i = 0; i < cache.numel(); ++i) ASSERT_TRUE(same_bits(cache[i], expected[i])) << i;
}

TEST(CopyBlocks, ManyLayersInParallelMatchSerial) {
  std::mt19937 rng(5);
  auto cache = random_tensor<float>({30, 2, 40, 3, 16, 64}, rng);
  auto copies = testing::int_tensor({3, 2}, {3, 10, 10, 20, 39, 0});
  auto expected = cache;
  const int64_t block_elems = 3 * 16 * 64;
  for (int64_t c = 0; c < 3; ++c) {
    for (int64_t plane = 0; plane < 60; ++plane) {
      std::copy_n(expected.data.begin() + (plane * 40 + copies[2 * c]) * block_elems, block_elems,
                  expected.data.begin() + (plane * 40 + copies[2 * c + 1]) * block_elems);
    }
  }
  copy_blocks(cache.view(), copies.view());
  EXPECT_EQ(cache.data, expected.data);
}

TEST(CopyBlocks, RejectsBadArguments) {
  HostTensor<float> cache({1, 2, 3, 1, 4, 8});
  auto copies = testing::int_tensor({1, 2}, {0, 3});
  EXPECT_TRUE(throws_invalid([&] { copy_blocks(cache.view(), copies.view()); },
                             "block_copies[0][1] = 3 is not a block id in [0, 3)"));
  HostTensor<float> not_kv({1, 3, 3, 1, 4, 8});
  copies[1] = 1;
  EXPECT_TRUE(throws_invalid([&] { copy_blocks(not_kv.view(), copies.view()); }, "kv_cache must have size 2 in dim 1"));
  auto flat = testing::int_tensor({2}, {0, 1});
  EXPECT_TRUE(throws_invalid([&] { copy_blocks(cache.view(), flat.view()); }, "block_copies must have 2 dims"));
}

}  // namespace
}  // namespace pagedserve::ops
