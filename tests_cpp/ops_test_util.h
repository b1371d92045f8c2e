// Helpers for testing the CPU ops: host tensors over std::vector storage,
// random fills, and comparisons against float64 oracles.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "ops/cpu_isa.h"
#include "ops/float_types.h"
#include "ops/ops.h"
#include "ops/packed_weight_layout.h"
#include "ops/tensor_view.h"

namespace pagedserve::testing {

using ops::BFloat16;
using ops::DType;
using ops::Half;
using ops::TensorView;

template <typename T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, float>) return DType::kFloat32;
  if constexpr (std::is_same_v<T, Half>) return DType::kFloat16;
  if constexpr (std::is_same_v<T, BFloat16>) return DType::kBFloat16;
  if constexpr (std::is_same_v<T, int32_t>) return DType::kInt32;
  if constexpr (std::is_same_v<T, int64_t>) return DType::kInt64;
  if constexpr (std::is_same_v<T, uint8_t>) return DType::kUInt8;
  if constexpr (std::is_same_v<T, double>) return DType::kFloat64;
}

// A contiguous tensor owning its storage; view() lends it to an op.
template <typename T>
struct HostTensor {
  std::vector<int64_t> shape;
  std::vector<T> data;

  HostTensor() = default;
  explicit HostTensor(std::vector<int64_t> dims) : shape(std::move(dims)), data(static_cast<size_t>(count(shape))) {}

  static int64_t count(const std::vector<int64_t>& dims) {
    int64_t n = 1;
    for (int64_t d : dims) n *= d;
    return n;
  }

  TensorView view() const {
    TensorView v;
    v.data = const_cast<T*>(data.data());
    v.dtype = dtype_of<T>();
    v.ndim = static_cast<int>(shape.size());
    int64_t stride = 1;
    for (int d = v.ndim - 1; d >= 0; --d) {
      v.shape[static_cast<size_t>(d)] = shape[static_cast<size_t>(d)];
      v.strides[static_cast<size_t>(d)] = stride;
      stride *= shape[static_cast<size_t>(d)];
    }
    return v;
  }

  T& operator[](int64_t i) { return data[static_cast<size_t>(i)]; }
  const T& operator[](int64_t i) const { return data[static_cast<size_t>(i)]; }
  int64_t numel() const { return static_cast<int64_t>(data.size()); }
};

inline double as_double(float v) { return v; }
inline double as_double(Half v) { return ops::half_to_float(v); }
inline double as_double(BFloat16 v) { return ops::bf16_to_float(v); }

// Fills with N(0, scale^2) values rounded to T.
template <typename T>
void fill_normal(HostTensor<T>& t, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> normal(0.0f, scale);
  for (auto& v : t.data) v = ops::from_float<T>(normal(rng));
}

template <typename T>
HostTensor<T> random_tensor(std::vector<int64_t> shape, std::mt19937& rng, float scale = 1.0f) {
  HostTensor<T> t(std::move(shape));
  fill_normal(t, rng, scale);
  return t;
}

template <typename T>
HostTensor<T> full_tensor(std::vector<int64_t> shape, float value) {
  HostTensor<T> t(std::move(shape));
  for (auto& v : t.data) v = ops::from_float<T>(value);
  return t;
}

inline HostTensor<int32_t> int_tensor(std::vector<int64_t> shape, const std::vector<int32_t>& values) {
  HostTensor<int32_t> t(std::move(shape));
  t.data = values;
  return t;
}

// Tolerances for comparing an op's T output with a float64 oracle computed on
// the same T inputs: about one rounding of the output to T.
template <typename T>
struct Tolerance {
  static constexpr double kRelative = std::is_same_v<T, float> ? 2e-5 : (std::is_same_v<T, Half> ? 2e-3 : 1.6e-2);
  static constexpr double kAbsolute = std::is_same_v<T, float> ? 2e-5 : (std::is_same_v<T, Half> ? 2e-3 : 1e-2);
};

template <typename T>
::testing::AssertionResult all_close(const HostTensor<T>& actual, const std::vector<double>& expected,
                                     double scale_tolerance = 1.0) {
  if (static_cast<size_t>(actual.numel()) != expected.size()) {
    return ::testing::AssertionFailure() << "size " << actual.numel() << " != " << expected.size();
  }
  int mismatches = 0;
  std::string first;
  for (size_t i = 0; i < expected.size(); ++i) {
    const double got = as_double(actual.data[i]);
    const double bound =
        scale_tolerance * (Tolerance<T>::kAbsolute + Tolerance<T>::kRelative * std::abs(expected[i]));
    if (!(std::abs(got - expected[i]) <= bound)) {
      if (mismatches++ == 0) {
        first = "index " + std::to_string(i) + ": got " + std::to_string(got) + ", expected " +
                std::to_string(expected[i]);
      }
    }
  }
  if (mismatches == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << mismatches << " mismatches; first at " << first;
}

// Runs fn and checks that it throws std::invalid_argument whose message contains `needle`.
template <typename Fn>
::testing::AssertionResult throws_invalid(Fn&& fn, const std::string& needle) {
  try {
    fn();
  } catch (const std::invalid_argument& e) {
    if (std::string(e.what()).find(needle) != std::string::npos) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "message '" << e.what() << "' lacks '" << needle << "'";
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw a different exception: " << e.what();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

using FloatTypes = ::testing::Types<float, Half, BFloat16>;

// Runs body once per instruction set this CPU supports (cpu_isa.h), so the
// baseline and AVX2 kernels are tested on an AVX-512 machine too.
template <typename Body>
void for_each_cpu_isa(Body&& body) {
  const ops::CpuIsa before = ops::cpu_isa();
  for (ops::CpuIsa isa : ops::supported_cpu_isas()) {
    SCOPED_TRACE("cpu isa " + std::string(ops::cpu_isa_name(isa)));
    ops::set_cpu_isa(isa);
    body();
  }
  ops::set_cpu_isa(before);
}

// A weight [N, K] in packed_linear's bf16 tiles (ops::pack_linear_weight, packed_weight_layout.h).
inline HostTensor<BFloat16> packed_bf16_tiles(const HostTensor<float>& weight) {
  HostTensor<BFloat16> packed({packed_col_tiles(weight.shape[0]), packed_k_pairs(weight.shape[1]), 2 * kPackedCols});
  ops::pack_linear_weight(packed.view(), weight.view());
  return packed;
}

}  // namespace pagedserve::testing
