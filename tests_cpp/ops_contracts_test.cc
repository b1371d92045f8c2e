// The argument contracts (op_contracts.h) on both devices, without a GPU: a
// CUDA tensor here is a TensorView marked kCUDA whose data pointer is null,
// so a contract that read device memory on the host would crash the test.
#include <gtest/gtest.h>

#include <string>

#include "ops/op_contracts.h"
#include "ops_test_util.h"

namespace pagedserve::ops {
namespace {

using testing::HostTensor;
using testing::throws_invalid;

TensorView on_gpu(const TensorView& host, int index = 0) {
  TensorView v = host;
  v.device = Device::kCUDA;
  v.device_index = index;
  v.data = nullptr;
  return v;
}

// The tensors of one paged_attention call: 2 sequences (4 and 1 queries) over
// a cache of 4 blocks of 16, with GQA 6 / 2, as host views.
struct AttentionArgs {
  HostTensor<float> query{{5, 6, 64}}, out{{5, 6, 64}}, cache{{4, 2, 16, 64}};
  HostTensor<int32_t> tables = testing::int_tensor({2, 2}, {0, 1, 2, 3});
  HostTensor<int32_t> starts = testing::int_tensor({3}, {0, 4, 5});
  HostTensor<int32_t> lens = testing::int_tensor({2}, {20, 3});

  void check(Device device) const {
    const auto v = [&](const TensorView& t) { return device == Device::kCPU ? t : on_gpu(t); };
    check_paged_attention(device, v(out.view()), v(query.view()), v(cache.view()), v(cache.view()), v(tables.view()),
                          v(starts.view()), v(lens.view()));
  }
};

TEST(OpContracts, BothDevicesRejectAShapeWithTheSameMessage) {
  HostTensor<float> x({4, 8}), out({4, 8}), short_w({7});
  EXPECT_TRUE(throws_invalid([&] { check_rms_norm(Device::kCPU, out.view(), x.view(), short_w.view()); },
                             "rms_norm: weight must have size 8 in dim 0, got float32[7] cpu"));
  EXPECT_TRUE(throws_invalid(
      [&] { check_rms_norm(Device::kCUDA, on_gpu(out.view()), on_gpu(x.view()), on_gpu(short_w.view())); },
      "rms_norm: weight must have size 8 in dim 0, got float32[7] cuda:0"));
  HostTensor<float> odd({4, 7});
  for (Device device : {Device::kCPU, Device::kCUDA}) {
    const auto v = [&](const TensorView& t) { return device == Device::kCPU ? t : on_gpu(t); };
    EXPECT_TRUE(throws_invalid([&] { check_silu_and_mul(device, v(out.view()), v(odd.view())); },
                               "silu_and_mul: x's last dim must be even"));
  }
}

TEST(OpContracts, EachDeviceTakesOnlyItsOwnTensors) {
  HostTensor<float> x({4, 8}), out({4, 4});
  EXPECT_TRUE(throws_invalid([&] { check_silu_and_mul(Device::kCPU, out.view(), on_gpu(x.view())); },
                             "silu_and_mul: x must be on the cpu, got float32[4, 8] cuda:0"));
  EXPECT_TRUE(throws_invalid([&] { check_silu_and_mul(Device::kCUDA, out.view(), on_gpu(x.view())); },
                             "silu_and_mul: out must be on the cuda, got float32[4, 4] cpu"));
}

TEST(OpContracts, OnAGpuAllTensorsShareOne) {
  HostTensor<float> x({4, 8}), w({8}), out({4, 8});
  EXPECT_NO_THROW(check_rms_norm(Device::kCUDA, on_gpu(out.view(), 1), on_gpu(x.view(), 1), on_gpu(w.view(), 1)));
  EXPECT_TRUE(throws_invalid(
      [&] { check_rms_norm(Device::kCUDA, on_gpu(out.view()), on_gpu(x.view()), on_gpu(w.view(), 1)); },
      "rms_norm: weight is on cuda:1 but the other tensors are on cuda:0"));
}

TEST(OpContracts, IndexTensorsAreReadOnTheCpuOnly) {
  AttentionArgs args;
  EXPECT_NO_THROW(args.check(Device::kCPU));
  EXPECT_NO_THROW(args.check(Device::kCUDA));  // null data: nothing was read
  args.tables[3] = 4;                          // sequence 1's block 1 is past the cache
  args.lens[1] = 17;
  EXPECT_TRUE(throws_invalid([&] { args.check(Device::kCPU); }, "sequence 1: block_tables[1] = 4 is not a block id"));
  EXPECT_NO_THROW(args.check(Device::kCUDA));

  HostTensor<float> key({2, 1, 8}), cache({2, 1, 4, 8});
  auto slots = testing::int_tensor({2}, {0, 8});
  EXPECT_TRUE(throws_invalid(
      [&] { check_reshape_and_cache(Device::kCPU, key.view(), key.view(), cache.view(), cache.view(), slots.view()); },
      "slot_mapping[1] = 8 is outside the cache"));
  EXPECT_NO_THROW(check_reshape_and_cache(Device::kCUDA, on_gpu(key.view()), on_gpu(key.view()), on_gpu(cache.view()),
                                          on_gpu(cache.view()), on_gpu(slots.view())));
}

TEST(OpContracts, TensorRulesHoldOnBothDevices) {
  AttentionArgs args;
  HostTensor<float> wide_query({5, 6, 32});
  for (Device device : {Device::kCPU, Device::kCUDA}) {
    const auto v = [&](const TensorView& t) { return device == Device::kCPU ? t : on_gpu(t); };
    EXPECT_TRUE(throws_invalid(
        [&] {
          check_paged_attention(device, v(args.out.view()), v(wide_query.view()), v(args.cache.view()),
                                v(args.cache.view()), v(args.tables.view()), v(args.starts.view()),
                                v(args.lens.view()));
        },
        "paged_attention: out must have size 32 in dim 2"));
    HostTensor<float> table({16, 64}), query({2, 4, 64}), key({2, 2, 64});
    auto positions = testing::int_tensor({2}, {0, 1});
    HostTensor<float> narrow({2, 4, 32});
    EXPECT_TRUE(throws_invalid(
        [&] {
          check_rotary_embedding(device, v(positions.view()), v(narrow.view()), v(narrow.view()), v(table.view()));
        },
        "rotary dim must be even and in (0, head_dim = 32]"));
    HostTensor<int64_t> long_ids({2});
    HostTensor<float> logits({2, 5}), inv_t({2});
    EXPECT_TRUE(throws_invalid(
        [&] { check_sample_tokens(device, v(long_ids.view()), v(logits.view()), v(inv_t.view()), {}); },
        "sample_tokens: out must be int32"));
  }
}

}  // namespace
}  // namespace pagedserve::ops
