// TensorView parsing and checks, the thread pool, and the CPU ISA switch.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>

#include "ops/cpu_isa.h"
#include "ops/dlpack.h"
#include "ops/ops.h"
#include "ops/parallel.h"
#include "ops/thread_pool.h"
#include "ops_test_util.h"

namespace pagedserve::ops {
namespace {

// ---------------------------------------------------------------------------
// TensorView

struct FakeDLPack {
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  DLManagedTensor managed{};

  FakeDLPack(std::vector<int64_t> dims, DLDataType dtype, void* data, bool with_strides = false,
             int32_t device_type = kDLCPU)
      : shape(std::move(dims)) {
    managed.dl_tensor.data = data;
    managed.dl_tensor.device = {device_type, 3};
    managed.dl_tensor.ndim = static_cast<int32_t>(shape.size());
    managed.dl_tensor.dtype = dtype;
    managed.dl_tensor.shape = shape.data();
    if (with_strides) {
      strides.assign(shape.size(), 1);
      for (int d = static_cast<int>(shape.size()) - 2; d >= 0; --d) {
        strides[static_cast<size_t>(d)] = strides[static_cast<size_t>(d) + 1] * shape[static_cast<size_t>(d) + 1];
      }
      managed.dl_tensor.strides = strides.data();
    }
  }
};

TEST(TensorView, ParsesDLPack) {
  std::vector<float> storage(64);
  FakeDLPack fake({2, 3, 4}, DLDataType{kDLBfloat, 16, 1}, storage.data());
  fake.managed.dl_tensor.byte_offset = 8;
  const TensorView v = view_from_dlpack(&fake.managed);
  EXPECT_EQ(v.dtype, DType::kBFloat16);
  EXPECT_EQ(v.device, Device::kCPU);
  EXPECT_EQ(v.ndim, 3);
  EXPECT_EQ(v.data, reinterpret_cast<char*>(storage.data()) + 8);
  EXPECT_EQ(v.size(-1), 4);
  EXPECT_EQ(v.stride(0), 12);  // null strides: compact row-major
  EXPECT_EQ(v.stride(2), 1);
  EXPECT_EQ(v.numel(), 24);
  EXPECT_TRUE(v.is_contiguous());
  EXPECT_EQ(v.describe(), "bfloat16[2, 3, 4] cpu");

  const std::pair<DLDataType, DType> mapping[] = {{{kDLFloat, 32, 1}, DType::kFloat32},
                                                  {{kDLFloat, 16, 1}, DType::kFloat16},
                                                  {{kDLInt, 32, 1}, DType::kInt32},
                                                  {{kDLInt, 64, 1}, DType::kInt64}};
  for (const auto& [dl, expected] : mapping) {
    FakeDLPack f({5}, dl, storage.data(), /*with_strides=*/true, kDLCUDA);
    const TensorView view = view_from_dlpack(&f.managed);
    EXPECT_EQ(view.dtype, expected);
    EXPECT_EQ(view.device, Device::kCUDA);
    EXPECT_EQ(view.device_index, 3);
    EXPECT_EQ(view.describe(), std::string(dtype_name(expected)) + "[5] cuda:3");
  }
}

TEST(TensorView, RejectsWhatItCannotRepresent) {
  std::vector<float> storage(8);
  FakeDLPack vector_type({2}, DLDataType{kDLFloat, 32, 4}, storage.data());
  EXPECT_TRUE(testing::throws_invalid([&] { view_from_dlpack(&vector_type.managed); }, "lanes = 4"));
  FakeDLPack float8({2}, DLDataType{kDLFloat, 8, 1}, storage.data());
  EXPECT_TRUE(testing::throws_invalid([&] { view_from_dlpack(&float8.managed); }, "unsupported dtype float8"));
  FakeDLPack uint16({2}, DLDataType{kDLUInt, 16, 1}, storage.data());  // uint8 is a dtype (GGUF blocks)
  EXPECT_TRUE(testing::throws_invalid([&] { view_from_dlpack(&uint16.managed); }, "unsupported dtype uint16"));
  FakeDLPack too_many_dims({1, 1, 1, 1, 1, 1, 2}, DLDataType{kDLFloat, 32, 1}, storage.data());
  EXPECT_TRUE(testing::throws_invalid([&] { view_from_dlpack(&too_many_dims.managed); }, "7 dims"));
  FakeDLPack other_device({2}, DLDataType{kDLFloat, 32, 1}, storage.data(), false, /*device_type=*/7);
  EXPECT_TRUE(testing::throws_invalid([&] { view_from_dlpack(&other_device.managed); }, "device type 7"));
  EXPECT_TRUE(testing::throws_invalid([] { view_from_dlpack(nullptr); }, "null"));
}

TEST(TensorView, ContiguityIgnoresSizeOneDims) {
  testing::HostTensor<float> t({4, 1, 3});
  TensorView v = t.view();
  EXPECT_TRUE(v.is_contiguous());
  v.strides[1] = 99;  // a size-1 dim's stride is irrelevant
  EXPECT_TRUE(v.is_contiguous());
  v.strides = {1, 3, 4};  // a transpose
  EXPECT_FALSE(v.is_contiguous());
  v.shape = {0, 1, 3};  // empty: trivially contiguous
  EXPECT_TRUE(v.is_contiguous());
}

TEST(TensorView, RequireHelpersNameOpAndArgument) {
  testing::HostTensor<BFloat16> t({8, 9, 64});
  TensorView v = t.view();
  EXPECT_NO_THROW(require_device("op", "x", v, Device::kCPU));
  EXPECT_TRUE(testing::throws_invalid([&] { require_device("op", "x", v, Device::kCUDA); },
                                      "op: x must be on the cuda, got bfloat16[8, 9, 64] cpu"));
  EXPECT_TRUE(testing::throws_invalid([&] { require_dtype("op", "x", v, DType::kInt32); }, "op: x must be int32"));
  EXPECT_NO_THROW(require_float("op", "x", v));
  EXPECT_TRUE(testing::throws_invalid([&] { require_ndim("op", "x", v, 2); }, "op: x must have 2 dims"));
  EXPECT_TRUE(testing::throws_invalid([&] { require_size("op", "x", v, 1, 3); }, "op: x must have size 3 in dim 1"));
  EXPECT_TRUE(testing::throws_invalid([&] { require_size("op", "x", v, 3, 3); }, "op: x has no dim 3"));
  testing::HostTensor<float> other({2});
  EXPECT_TRUE(testing::throws_invalid([&] { require_same_dtype("op", "y", other.view(), v); },
                                      "op: y must have the same dtype as the other inputs (bfloat16)"));
  EXPECT_TRUE(testing::throws_invalid([&] { PS_REQUIRE(false, "op", "custom"); }, "op: custom"));
  int evaluated = 0;
  const auto message = [&] {
    ++evaluated;
    return std::string("never built");
  };
  PS_REQUIRE(true, "op", message());
  EXPECT_EQ(evaluated, 0) << "a passing check must not build its message";
  v.strides = {576, 1, 9};
  EXPECT_TRUE(testing::throws_invalid([&] { require_contiguous("paged_attention", "query", v); },
                                      "paged_attention: query must be contiguous, got bfloat16[8, 9, 64] strides "
                                      "[576, 1, 9] cpu"));
  testing::HostTensor<int32_t> ints({3});
  EXPECT_TRUE(testing::throws_invalid([&] { require_float("op", "ids", ints.view()); },
                                      "op: ids must be float32, float16 or bfloat16, got int32[3] cpu"));
}

// ---------------------------------------------------------------------------
// ThreadPool

TEST(ThreadPool, RunsEveryTaskOnceWithDistinctWorkers) {
  ThreadPool pool(4);
  EXPECT_EQ(pool.num_threads(), 4);
  for (int round = 0; round < 50; ++round) {
    std::vector<std::atomic<int>> hits(1000);
    std::vector<std::atomic<int>> busy(4);
    std::atomic<bool> shared_worker{false};
    pool.run(1000, [&](int64_t task, int worker) {
      ASSERT_GE(worker, 0);
      ASSERT_LT(worker, 4);
      if (busy[static_cast<size_t>(worker)].fetch_add(1) != 0) shared_worker = true;
      hits[static_cast<size_t>(task)].fetch_add(1);
      busy[static_cast<size_t>(worker)].fetch_sub(1);
    });
    for (auto& h : hits) ASSERT_EQ(h.load(), 1);
    ASSERT_FALSE(shared_worker.load()) << "two tasks ran on the same worker id at once";
  }
}

TEST(ThreadPool, UsesSeveralThreads) {
  ThreadPool pool(3);
  std::mutex mutex;
  std::set<std::thread::id> threads;
  std::atomic<int> arrived{0};
  pool.run(3, [&](int64_t, int) {
    {
      std::lock_guard lock(mutex);
      threads.insert(std::this_thread::get_id());
    }
    // Hold each task until all three started, so one thread cannot take them all.
    arrived.fetch_add(1);
    for (int wait = 0; wait < 2000 && arrived.load() < 3; ++wait) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  EXPECT_EQ(threads.size(), 3u);
}

TEST(ThreadPool, NestedAndConcurrentRunsCompleteInline) {
  ThreadPool pool(2);
  std::atomic<int64_t> total{0};
  pool.run(8, [&](int64_t, int) { pool.run(10, [&](int64_t task, int) { total += task; }); });
  EXPECT_EQ(total.load(), 8 * 45);

  std::atomic<int64_t> sum{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&] {
      for (int r = 0; r < 100; ++r) pool.run(16, [&](int64_t task, int) { sum += task; });
    });
  }
  for (auto& t : callers) t.join();
  EXPECT_EQ(sum.load(), 4 * 100 * 120);
}

TEST(ThreadPool, PropagatesTheFirstException) {
  ThreadPool pool(2);
  std::atomic<int> ran{0};
  EXPECT_THROW(pool.run(100,
                        [&](int64_t task, int) {
                          ran++;
                          if (task == 17) throw std::runtime_error("task 17");
                        }),
               std::runtime_error);
  EXPECT_EQ(ran.load(), 100);
  pool.run(4, [&](int64_t, int) { ran++; });  // still usable
  EXPECT_EQ(ran.load(), 104);
}

TEST(ThreadPool, SetNumThreads) {
  const int before = num_threads();
  set_num_threads(3);
  EXPECT_EQ(num_threads(), 3);
  EXPECT_EQ(parallel_run(kMinParallelWork).num_workers(), 3);
  EXPECT_EQ(parallel_run(kMinParallelWork - 1).num_workers(), 1);  // small work stays inline
  set_num_threads(1);
  EXPECT_EQ(parallel_run(kMinParallelWork * 100).num_workers(), 1);
  EXPECT_TRUE(testing::throws_invalid([] { set_num_threads(0); }, "num_threads must be >= 1"));
  set_num_threads(before);
}

TEST(ThreadPool, ParallelForRangeCoversEachItemOnce) {
  std::vector<std::atomic<int>> hits(1001);
  parallel_for_range(1001, kMinParallelWork, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) hits[static_cast<size_t>(i)]++;
  });
  for (auto& h : hits) ASSERT_EQ(h.load(), 1);
}

// ---------------------------------------------------------------------------
// CpuIsa

TEST(CpuIsa, SupportedLevelsAreAscendingAndSelectable) {
  const std::vector<CpuIsa> isas = supported_cpu_isas();
  ASSERT_FALSE(isas.empty());
  EXPECT_EQ(isas.front(), CpuIsa::kBaseline);
  EXPECT_EQ(isas.back(), best_supported_cpu_isa());
  EXPECT_EQ(cpu_isa(), best_supported_cpu_isa());
  for (CpuIsa isa : isas) {
    set_cpu_isa(isa);
    EXPECT_EQ(cpu_isa(), isa);
    int ran = 0;
    with_cpu_isa([&]() PS_INLINE_BODY { ++ran; });
    EXPECT_EQ(ran, 1);
  }
  if (best_supported_cpu_isa() < CpuIsa::kAvx512) {
    EXPECT_TRUE(testing::throws_invalid([] { set_cpu_isa(CpuIsa::kAvx512); }, "does not support avx512"));
  }
  if (best_supported_cpu_isa() < CpuIsa::kAmx) {
    EXPECT_TRUE(testing::throws_invalid([] { set_cpu_isa(CpuIsa::kAmx); }, "does not support amx"));
  }
  set_cpu_isa(best_supported_cpu_isa());
  EXPECT_EQ(cpu_isa_name(CpuIsa::kAvx2), "avx2");
  EXPECT_EQ(cpu_isa_name(CpuIsa::kAmx), "amx");
}

}  // namespace
}  // namespace pagedserve::ops
