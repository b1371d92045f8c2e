// What the emulator's checks share: random inputs, host tensors viewed as CPU
// or (emulated) CUDA tensors, and the pass / fail report. Each emulate_*.cc
// checks one group of ops against the CPU reference ops (cpp/ops).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda_ops.h"
#include "ops/ops.h"

namespace emu_check {

using pagedserve::ops::Device;
using pagedserve::ops::DType;
using pagedserve::ops::TensorView;
namespace gpu = pagedserve::cuda;
namespace cpu = pagedserve::ops;


inline std::mt19937_64 rng(20261122);
inline float randn() { return std::normal_distribution<float>()(rng); }
inline int randint(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }

inline const char* name(DType t) { return t == DType::kFloat32 ? "f32" : t == DType::kFloat16 ? "f16" : "bf16"; }
inline double tolerance(DType t) { return t == DType::kFloat32 ? 1e-5 : t == DType::kFloat16 ? 2e-3 : 1e-2; }

// A contiguous host buffer, viewed as a CPU or an (emulated) CUDA tensor. Sized
// exactly, so AddressSanitizer flags any overrun; malloc aligns it to 16 bytes.
struct Tensor {
  Tensor(DType t, std::vector<int64_t> s) : dtype(t), shape(std::move(s)), bytes(size_t(numel() * pagedserve::ops::element_size(t))) {}
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  void* data() { return bytes.data(); }
  int32_t* ints() { return static_cast<int32_t*>(data()); }
  TensorView view(Device device) {
    TensorView v;
    v.data = data();
    v.dtype = dtype;
    v.device = device;
    v.ndim = static_cast<int>(shape.size());
    int64_t stride = 1;
    for (int d = v.ndim - 1; d >= 0; --d) {
      v.shape[size_t(d)] = shape[size_t(d)];
      v.strides[size_t(d)] = stride;
      stride *= shape[size_t(d)];
    }
    return v;
  }
  TensorView gpu() { return view(Device::kCUDA); }
  TensorView cpu() { return view(Device::kCPU); }
  float get(int64_t i) {
    if (dtype == DType::kFloat32) return static_cast<float*>(data())[i];
    const uint16_t bits = static_cast<uint16_t*>(data())[i];
    if (dtype == DType::kBFloat16) {
      __nv_bfloat16 v;
      std::memcpy(&v, &bits, 2);
      return __bfloat162float(v);
    }
    __half v;
    std::memcpy(&v, &bits, 2);
    return __half2float(v);
  }
  void set(int64_t i, float x) {
    if (dtype == DType::kFloat32) {
      static_cast<float*>(data())[i] = x;
    } else if (dtype == DType::kBFloat16) {
      const __nv_bfloat16 v = __float2bfloat16_rn(x);
      std::memcpy(static_cast<uint16_t*>(data()) + i, &v, 2);
    } else {
      const __half v = __float2half_rn(x);
      std::memcpy(static_cast<uint16_t*>(data()) + i, &v, 2);
    }
  }
  Tensor& randomize(float scale = 1.f) {
    for (int64_t i = 0; i < numel(); ++i) set(i, scale * randn());
    return *this;
  }
  Tensor& poison() {
    for (int64_t i = 0; i < numel(); ++i) set(i, NAN);
    return *this;
  }
  bool same_bytes(const Tensor& other) const { return bytes == other.bytes; }

  DType dtype;
  std::vector<int64_t> shape;
  std::vector<unsigned char> bytes;
};

inline double relative_error(Tensor& actual, Tensor& expected, int64_t count) {
  double diff = 0, norm = 0;
  for (int64_t i = 0; i < count; ++i) {
    const double a = actual.get(i), e = expected.get(i);
    if (!std::isfinite(a)) return INFINITY;
    diff += (a - e) * (a - e);
    norm += e * e;
  }
  return std::sqrt(diff / std::max(norm, 1e-300));
}

inline int failures = 0;
inline void report(const std::string& what, bool ok, double error = 0) {
  failures += !ok;
  std::printf("%s %-78s %.3g\n", ok ? "ok  " : "FAIL", what.c_str(), error);
  std::fflush(stdout);
}
inline void expect_close(const std::string& what, Tensor& actual, Tensor& expected) {
  const double error = relative_error(actual, expected, expected.numel());
  report(what, error < tolerance(expected.dtype), error);
}


// The groups of checks (emulate_*.cc).
// The inputs of the rope + KV-cache ops for `tokens` tokens: a cos/sin table of max_position rows,
// positions drawn from it, slots t * 3 + 1 with token 1 padded (slot -1: no KV write).
struct RopeInputs {
  Tensor cos_sin, positions, slots;
};
inline RopeInputs rope_inputs(int tokens, int max_position, int rotary_dim) {
  RopeInputs in{Tensor(DType::kFloat32, {max_position, rotary_dim}), Tensor(DType::kInt32, {tokens}),
                Tensor(DType::kInt32, {tokens})};
  for (int64_t i = 0; i < in.cos_sin.numel(); ++i) in.cos_sin.set(i, float(std::cos(0.37 * double(i))));
  for (int t = 0; t < tokens; ++t) {
    in.positions.ints()[t] = randint(0, max_position - 1);
    in.slots.ints()[t] = t == 1 ? -1 : t * 3 + 1;
  }
  return in;
}

void elementwise_cases();
void attention_cases();
void attention_option_cases();  // sliding window, soft-capping
void grouped_linear_cases();
void small_batch_linear_cases();
void sampling_cases();

}  // namespace emu_check
