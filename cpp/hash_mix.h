// mix64: splitmix64's finalizer, a bijective 64-bit mixer with full avalanche.
// Shared by the prefix-cache block hash and the sampler's hashed noise; usable
// from CUDA device code.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define PS_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define PS_HOST_DEVICE inline
#endif

namespace pagedserve {

PS_HOST_DEVICE constexpr uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

}  // namespace pagedserve
