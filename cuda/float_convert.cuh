// Storage types <-> float32, and aligned vectors of them.
//
// Kernels load float32 / float16 / bfloat16 storage, compute in float32 and
// round once on the way out (round to nearest even), like the CPU ops.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace pagedserve::cuda {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// N elements of T, aligned to their size so a load or store is one
// instruction (16 bytes: 8 x 16-bit or 4 x float32).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T elem[N];
};

// How many elements of T fit in one 16-byte access.
template <typename T>
inline constexpr int kVec16 = static_cast<int>(16 / sizeof(T));

// Loads / stores N consecutive elements as float32, in 16-byte pieces (or one
// N-element piece when smaller): src / dst must be aligned to the piece size.
template <typename T, int N>
__device__ __forceinline__ void load_as_float(float (&dst)[N], const T* src) {
  constexpr int kPiece = N < kVec16<T> ? N : kVec16<T>;
  static_assert(N % kPiece == 0, "vector length must be a multiple of the 16-byte piece");
#pragma unroll
  for (int p = 0; p < N / kPiece; ++p) {
    const Vec<T, kPiece> v = *reinterpret_cast<const Vec<T, kPiece>*>(src + p * kPiece);
#pragma unroll
    for (int i = 0; i < kPiece; ++i) dst[p * kPiece + i] = to_float(v.elem[i]);
  }
}

template <typename T, int N>
__device__ __forceinline__ void store_from_float(T* dst, const float (&src)[N]) {
  constexpr int kPiece = N < kVec16<T> ? N : kVec16<T>;
  static_assert(N % kPiece == 0, "vector length must be a multiple of the 16-byte piece");
#pragma unroll
  for (int p = 0; p < N / kPiece; ++p) {
    Vec<T, kPiece> v;
#pragma unroll
    for (int i = 0; i < kPiece; ++i) v.elem[i] = from_float<T>(src[p * kPiece + i]);
    *reinterpret_cast<Vec<T, kPiece>*>(dst + p * kPiece) = v;
  }
}

// Rounds a float through T and back: the value T storage would hold.
template <typename T>
__device__ __forceinline__ float round_through(float x) {
  return to_float(from_float<T>(x));
}

}  // namespace pagedserve::cuda
