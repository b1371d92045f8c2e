// What a kernel needs to wait for the host: the device's clock, a nap, and a
// fence that orders its reads of host memory (the emulator has host stand-ins:
// emulator/host_wait_emu.cuh).
#pragma once

#include <cstdint>

namespace pagedserve::cuda {

// Nanoseconds on the device's global timer (the same on every SM).
__device__ __forceinline__ uint64_t global_nanoseconds() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void nap(unsigned nanoseconds) { __nanosleep(nanoseconds); }

__device__ __forceinline__ void fence_system() { __threadfence_system(); }

}  // namespace pagedserve::cuda
