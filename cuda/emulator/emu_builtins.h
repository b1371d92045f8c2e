// The CUDA builtins the kernels call (barriers, shuffles, math intrinsics) and
// the runtime calls around their launches, on the emulator's CTA state.
// Included at the end of emu_runtime.h.
#pragma once

inline void __syncthreads() { emu::current_cta->barrier.arrive_and_wait(); }

inline float __shfl_xor_sync(unsigned /*mask*/, float v, int lane_mask) {
  emu::Warp& w = emu::warp();
  w.value[emu::lane_id] = v;
  w.barrier.arrive_and_wait();
  const float other = w.value[emu::lane_id ^ lane_mask];
  w.barrier.arrive_and_wait();
  return other;
}

inline int __shfl_sync(unsigned /*mask*/, int v, int src_lane) {
  emu::Warp& w = emu::warp();
  w.value[emu::lane_id] = static_cast<float>(v);  // exact for the small indices kernels broadcast
  w.barrier.arrive_and_wait();
  const int other = static_cast<int>(w.value[src_lane]);
  w.barrier.arrive_and_wait();
  return other;
}

inline float __shfl_down_sync(unsigned /*mask*/, float v, int delta) {
  emu::Warp& w = emu::warp();
  w.value[emu::lane_id] = v;
  w.barrier.arrive_and_wait();
  const int from = emu::lane_id + delta;
  const float other = from < 32 ? w.value[from] : v;
  w.barrier.arrive_and_wait();
  return other;
}

inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdividef(float a, float b) { return a / b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

// Launch-time runtime calls of the host code: a single emulated H100.
template <typename Kernel>
cudaError_t cudaFuncSetAttribute(Kernel*, cudaFuncAttribute, int) {
  return cudaSuccess;
}
