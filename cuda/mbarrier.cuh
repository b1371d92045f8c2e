// Shared-memory barriers (mbarrier, sm_80+ / try_wait sm_90) and named
// barriers, as thin PTX wrappers: how the warpgroups of one CTA hand buffers
// to each other without stopping the whole CTA at a __syncthreads.
//
// An mbarrier is 8 bytes of shared memory counting arrivals: when `count`
// threads have arrived, its phase completes and its parity bit flips;
// waiting on parity p returns once the phase with that parity has completed
// (phases 0, 1, 2, ... have parities 0, 1, 0, ...).
#pragma once

#include <cstdint>

#include "mma.cuh"

namespace pagedserve::cuda {

// One thread initializes; a __syncthreads publishes it before any use.
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(shared_address(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(shared_address(bar)) : "memory");
}

// Arrives once every cp.async this thread issued before it has landed (the
// barrier's count includes this arrival: .noinc).
__device__ __forceinline__ void cp_async_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(shared_address(bar)) : "memory");
}

// Returns once the phase of `parity` has completed; its writes are then visible to this thread.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(shared_address(bar)),
      "r"(parity)
      : "memory");
}

// Named barrier `id` (1..15; 0 is __syncthreads) of `threads` threads: sync
// arrives and waits, arrive only arrives (the producer side of a hand-off).
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace pagedserve::cuda
