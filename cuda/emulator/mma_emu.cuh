// Host stand-in for cuda/mma.cuh (same interface), following the PTX ISA
// fragment layouts of ldmatrix and mma.m16n8k16 lane by lane.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace pagedserve::cuda {

inline void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
  if (valid) {
    std::memcpy(smem_dst, gmem_src, 16);
  } else {
    std::memset(smem_dst, 0, 16);
  }
}
inline void cp_async_commit() {}
template <int kPending>
inline void cp_async_wait() {}

namespace emulated {

inline uint32_t element(const void* row, int i) { return static_cast<const uint16_t*>(row)[i]; }

template <bool kTranspose>
void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
  emu::Warp& w = emu::warp();
  const int lane = emu::lane_id;
  w.address[lane] = smem_row;
  w.barrier.arrive_and_wait();
  for (int m = 0; m < 4; ++m) {
    const void* const* rows = w.address + 8 * m;
    if constexpr (kTranspose) {  // lane t: M[2(t%4)][t/4], M[2(t%4)+1][t/4]
      r[m] = element(rows[2 * (lane % 4)], lane / 4) | element(rows[2 * (lane % 4) + 1], lane / 4) << 16;
    } else {  // lane t: M[t/4][2(t%4)], M[t/4][2(t%4)+1]
      r[m] = element(rows[lane / 4], 2 * (lane % 4)) | element(rows[lane / 4], 2 * (lane % 4) + 1) << 16;
    }
  }
  w.barrier.arrive_and_wait();
}

template <typename T>
float to_float_bits(uint32_t bits) {
  const auto half_bits = static_cast<uint16_t>(bits & 0xffffu);
  T value;
  std::memcpy(&value, &half_bits, sizeof(value));
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat162float(value);
  } else {
    return __half2float(value);
  }
}

}  // namespace emulated

inline void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) { emulated::ldmatrix_x4<false>(r, smem_row); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_row) { emulated::ldmatrix_x4<true>(r, smem_row); }

template <typename T>
void mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  emu::Warp& w = emu::warp();
  const int lane = emu::lane_id;
  std::memcpy(w.a[lane], a, sizeof(a));
  w.b[lane][0] = b0;
  w.b[lane][1] = b1;
  w.barrier.arrive_and_wait();
  float A[16][16];
  float B[16][8];
  auto lo = [](uint32_t v) { return emulated::to_float_bits<T>(v); };
  auto hi = [](uint32_t v) { return emulated::to_float_bits<T>(v >> 16); };
  for (int t = 0; t < 32; ++t) {
    const int g = t / 4;
    const int q = t % 4;
    for (int half = 0; half < 2; ++half) {  // a0/a1: rows g, g + 8 at k 2q; a2/a3: the same at k 2q + 8
      A[g][2 * q + 8 * half] = lo(w.a[t][2 * half]);
      A[g][2 * q + 8 * half + 1] = hi(w.a[t][2 * half]);
      A[g + 8][2 * q + 8 * half] = lo(w.a[t][2 * half + 1]);
      A[g + 8][2 * q + 8 * half + 1] = hi(w.a[t][2 * half + 1]);
      B[2 * q + 8 * half][g] = lo(w.b[t][half]);
      B[2 * q + 8 * half + 1][g] = hi(w.b[t][half]);
    }
  }
  w.barrier.arrive_and_wait();
  for (int e = 0; e < 4; ++e) {
    const int row = lane / 4 + 8 * (e / 2);
    const int col = 2 * (lane % 4) + e % 2;
    float acc = 0.f;
    for (int k = 0; k < 16; ++k) acc += A[row][k] * B[k][col];
    c[e] += acc;
  }
}

// ex2.approx.ftz: subnormal results flush to zero.
inline float exp2_ftz(float x) {
  const float y = std::exp2(x);
  return y < FLT_MIN ? 0.f : y;
}

template <typename T>
uint32_t pack2(float lo, float hi) {
  uint32_t bits;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
    std::memcpy(&bits, &pair, sizeof(bits));
  } else {
    const __half2 pair = __floats2half2_rn(lo, hi);
    std::memcpy(&bits, &pair, sizeof(bits));
  }
  return bits;
}

}  // namespace pagedserve::cuda
