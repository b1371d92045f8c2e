// Hopper's warpgroup tensor-core MMA (wgmma.mma_async, sm_90a), as thin PTX
// wrappers, and the shared-memory matrix descriptors it reads its operands by.
//
// A warpgroup is 4 consecutive warps (128 threads); one wgmma multiplies a
// 64 x K16 A (shared memory, or registers) by a K16 x N B (shared memory) into
// 64 x N float accumulators spread over the warpgroup. Warp w of the group
// owns rows [16 w, 16 w + 16), and inside a warp the accumulator and the
// register A fragments are laid out as mma.m16n8k16's (mma.cuh): accumulator
// d[4 j + e] is C fragment e of columns [8 j, 8 j + 8); an A register fragment
// is mma.sync's A fragment. So the flash-attention softmax written for
// mma.sync warps (warp_attention.cuh) runs on wgmma results unchanged.
//
// Operands in shared memory are "128-byte swizzled": 8 rows of 128 bytes make
// a 1,024-byte atom whose 16-byte chunk c of row r sits at chunk c ^ r (the
// hardware applies that XOR to address bits 4-6 from bits 7-9, so an atom must
// start 1,024-byte aligned). SlabTile (smem_tile.cuh) is that layout for rows
// of D values: D / 64 slabs of rows x 128 bytes. A descriptor gives the start
// address and two strides (PTX ISA, "Matrix Descriptor Format"):
//   K-major (the 16 reduced values of a row contiguous: Q, and K for Q K^T):
//     stride = 1,024 (from 8 rows to the next 8); leading unused; a k-step of
//     16 values is +32 bytes inside an atom, and D 64 onwards the next slab.
//   MN-major (the N values of a row contiguous: V for P V, "transposed" B):
//     leading = the slab stride (from 64 columns to the next 64); stride =
//     1,024 (from 8 reduced rows to the next 8); a k-step is +16 rows.
#pragma once

#include <cstdint>
#include <type_traits>

#include "mma.cuh"

namespace pagedserve::cuda::wgmma {

inline constexpr int kGroupThreads = 128;
inline constexpr int kRows = 64;              // M of every wgmma
inline constexpr int kAtomBytes = 1024;       // 8 rows x 128 bytes, the swizzle's period
inline constexpr int kSwizzleRowBytes = 128;  // one slab row

// A 128-byte-swizzled operand at `smem` (shared memory), strides in bytes.
__device__ __forceinline__ uint64_t descriptor(const void* smem, uint32_t leading_bytes, uint32_t stride_bytes) {
  const uint32_t address = shared_address(smem);
  return static_cast<uint64_t>((address & 0x3FFFF) >> 4) | static_cast<uint64_t>((leading_bytes & 0x3FFFF) >> 4) << 16 |
         static_cast<uint64_t>((stride_bytes & 0x3FFFF) >> 4) << 32 | uint64_t{1} << 62;  // layout 1: 128B swizzle
}

// The same operand `bytes` further on (start addresses stay below 256 KB, so no carry leaves the field).
__device__ __forceinline__ uint64_t advance(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

// Orders this thread's register writes (accumulators, A fragments) before the wgmmas issued next.
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit_group() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most kPending committed groups of this warpgroup are in flight.
template <int kPending>
__device__ __forceinline__ void wait_group() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Makes this thread's generic-proxy writes to shared memory (cp.async, stores)
// visible to wgmma's async-proxy reads; a __syncthreads after it publishes them CTA-wide.
__device__ __forceinline__ void fence_shared_for_async_proxy() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Pins values to their registers at this point of the program: after a
// wait_group, the compiler may not read accumulators (or reuse A registers)
// earlier than the wait, which it cannot see the asynchronous MMA needs.
template <int N>
__device__ __forceinline__ void pin(float (&values)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(values[i])::"memory");
}
template <int N>
__device__ __forceinline__ void pin(uint32_t (&values)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(values[i])::"memory");
}

#define PS_WGMMA_D64                                                                                               \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, "   \
  "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define PS_WGMMA_OUT8(d, i)                                                                                   \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
      "+f"(d[i + 7])
#define PS_WGMMA_OUT64(d)                                                                                     \
  PS_WGMMA_OUT8(d, 0), PS_WGMMA_OUT8(d, 8), PS_WGMMA_OUT8(d, 16), PS_WGMMA_OUT8(d, 24), PS_WGMMA_OUT8(d, 32), \
      PS_WGMMA_OUT8(d, 40), PS_WGMMA_OUT8(d, 48), PS_WGMMA_OUT8(d, 56)

// d (+)= A B for a 64 x 16 A and a 16 x 128 B, both K-major in shared memory
// (d is overwritten when accumulate is 0). T is __half or __nv_bfloat16.
template <typename T>
__device__ __forceinline__ void mma_128_ss(float (&d)[64], uint64_t a, uint64_t b, int accumulate) {
#define PS_WGMMA_SS(type)                                                                                 \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                               \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." type "." type " " PS_WGMMA_D64              \
               ", %64, %65, p, 1, 1, 0, 0;\n}\n"                                                          \
               : PS_WGMMA_OUT64(d)                                                                        \
               : "l"(a), "l"(b), "r"(accumulate))
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    PS_WGMMA_SS("bf16");
  } else {
    static_assert(std::is_same_v<T, __half>, "wgmma takes __half or __nv_bfloat16");
    PS_WGMMA_SS("f16");
  }
#undef PS_WGMMA_SS
}

// d += A B for a 64 x 16 A in registers (mma.sync A fragments) and a 16 x 128
// B in shared memory, MN-major (the 128 columns of a row contiguous).
template <typename T>
__device__ __forceinline__ void mma_128_rs_mn(float (&d)[64], const uint32_t (&a)[4], uint64_t b) {
#define PS_WGMMA_RS(type)                                                                     \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                   \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." type "." type " " PS_WGMMA_D64  \
               ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"                                 \
               : PS_WGMMA_OUT64(d)                                                            \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1))
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    PS_WGMMA_RS("bf16");
  } else {
    static_assert(std::is_same_v<T, __half>, "wgmma takes __half or __nv_bfloat16");
    PS_WGMMA_RS("f16");
  }
#undef PS_WGMMA_RS
}

#undef PS_WGMMA_OUT64
#undef PS_WGMMA_OUT8
#undef PS_WGMMA_D64

}  // namespace pagedserve::cuda::wgmma
