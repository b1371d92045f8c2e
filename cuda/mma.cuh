// Warp-level tensor-core and async-copy primitives (sm_80+), and the bare
// exponent, as thin PTX wrappers.
//
// Fragment layouts of mma.m16n8k16 (g = lane / 4, q = lane % 4), each 32-bit
// register holding two 16-bit values, lower address in the low half:
//   A (16 x 16, row major): a0 = A[g][2q..2q+1]   a1 = A[g+8][2q..]
//                           a2 = A[g][2q+8..]     a3 = A[g+8][2q+8..]
//   B (16 x 8, "col"):      b0 = B[2q..2q+1][g]   b1 = B[2q+8..2q+9][g]
//   C (16 x 8, float):      c0, c1 = C[g][2q..2q+1]   c2, c3 = C[g+8][2q..2q+1]
// ldmatrix.x4 gives each lane one register per 8 x 8 matrix; lanes 8i..8i+7
// supply the row addresses of matrix i. Without .trans thread t receives
// M[t/4][2(t%4)..+1]; with .trans it receives M[2(t%4)..+1][t/4].
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "pagedserve's attention kernels need sm_80 or newer (cp.async, bf16 mma.sync)"
#endif

namespace pagedserve::cuda {

__device__ __forceinline__ uint32_t shared_address(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// 16 bytes global -> shared without staging in registers; copies zeros instead
// when !valid (src is then not read, but must still be a valid pointer value).
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(smem_dst)), "l"(gmem_src),
               "r"(src_bytes)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most kPending of this thread's committed groups are in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(smem_row)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(smem_row)));
}

// c += a * b with float accumulation; T is __half or __nv_bfloat16.
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    static_assert(std::is_same_v<T, __half>, "mma_m16n8k16 takes __half or __nv_bfloat16");
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// 2^x as one MUFU.EX2 (ex2.approx.ftz.f32). exp2f is the same instruction
// plus a compare and two predicated multiplies per value, which keep results
// below 2^-126 as subnormals instead of zero; equal everywhere else.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Two floats rounded into one register of T pairs (lo in the low half).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t bits;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
    __builtin_memcpy(&bits, &pair, sizeof(bits));
  } else {
    const __half2 pair = __floats2half2_rn(lo, hi);
    __builtin_memcpy(&bits, &pair, sizeof(bits));
  }
  return bits;
}

}  // namespace pagedserve::cuda
