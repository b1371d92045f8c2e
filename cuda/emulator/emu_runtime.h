// A host emulation of the CUDA execution model, enough for the kernels in
// cuda/: each CTA runs as blockDim.x fibers of one OS thread, one CTA at a
// time. __syncthreads and the warp-wide operations (shuffles, ldmatrix, mma)
// rendezvous on barriers; a thread runs until it waits at one (or exits), then
// the next thread that can go on runs. cp.async copies synchronously, so the
// emulator checks indexing, masking and arithmetic, not the timing of the
// pipelines (that is compute-sanitizer racecheck's job on a GPU).
//
// Fibers, not OS threads: with a std::thread per CUDA thread, every barrier
// woke ~128 threads through futexes, and the run took 150 s on CI's 2-core
// Zen 3, 205 s of CPU in the kernel.
//
// Force-included (g++ -include) before the host copies of the kernel sources
// that make_host_sources.py writes. The CTA's state and launches are here; the
// fibers in emu_fibers.h, the CUDA builtins kernels call in emu_builtins.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <sys/mman.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <functional>
#include <memory>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif
#ifndef __noinline__
#define __noinline__ __attribute__((noinline))
#endif

// One OS thread runs every CUDA thread, so these are plain globals that the
// scheduler sets before it resumes a thread.
inline uint3 threadIdx;
inline uint3 blockIdx;
inline dim3 gridDim;
inline dim3 blockDim;

// The dynamic shared memory of the CTA being run (227 KB, the sm_90 maximum).
alignas(1024) inline unsigned char emu_smem[232448];

namespace emu {

inline int lane_id = 0;
inline int warp_id = 0;
inline long long num_launches = 0;
inline long long num_ctas = 0;

// A barrier of `expected` threads with std::barrier's two calls that the
// kernels need.
class Barrier {
 public:
  explicit Barrier(int expected) : expected_(expected) {}
  void arrive_and_wait();
  // Arrives without waiting (bar.arrive).
  void arrive() {
    if (++arrived_ == expected_) complete_phase();
  }
  // An exited thread stops counting, as on the GPU.
  void arrive_and_drop() {
    --expected_;
    if (expected_ > 0 && arrived_ == expected_) complete_phase();
  }
  unsigned long phase() const { return phase_; }

 private:
  void complete_phase() {
    arrived_ = 0;
    ++phase_;
  }
  int expected_;
  int arrived_ = 0;
  unsigned long phase_ = 0;
};

// What the lanes of one warp exchange at a rendezvous.
struct Warp {
  Barrier barrier{32};
  float value[32];
  const void* address[32];
  uint32_t a[32][4];
  uint32_t b[32][2];
};

// What the threads of one warpgroup (4 warps) exchange at a wgmma.
struct WarpGroup {
  explicit WarpGroup(int threads) : barrier(threads) {}
  Barrier barrier;
  float* d[128];  // each thread's accumulators
  uint32_t a[128][4];
  uint64_t desc_a[128];
  uint64_t desc_b[128];
  int accumulate[128];
};

// An mbarrier's state (its 8 bytes of shared memory only name it here).
struct Mbarrier {
  int expected = 0;
  int pending = 0;
  unsigned long completed = 0;  // phases completed; the current phase's parity is its low bit
};

struct Cta {
  explicit Cta(int threads) : barrier(threads), warps(static_cast<size_t>((threads + 31) / 32)) {
    for (int first = 0; first < threads; first += 128) groups.emplace_back(std::min(128, threads - first));
  }
  Barrier barrier;
  std::vector<Warp> warps;
  std::vector<WarpGroup> groups;
  std::vector<std::unique_ptr<Barrier>> named = std::vector<std::unique_ptr<Barrier>>(16);  // bar.sync ids
  std::vector<std::pair<const void*, Mbarrier>> mbarriers;

  Barrier& named_barrier(int id, int threads) {
    auto& bar = named[static_cast<size_t>(id)];
    if (!bar) bar = std::make_unique<Barrier>(threads);
    return *bar;
  }
  Mbarrier& mbarrier(const void* address) {
    for (auto& [where, state] : mbarriers)
      if (where == address) return state;
    return mbarriers.emplace_back(address, Mbarrier{}).second;
  }
};

inline Cta* current_cta = nullptr;

inline Warp& warp() { return current_cta->warps[static_cast<size_t>(warp_id)]; }
inline WarpGroup& warp_group() { return current_cta->groups[static_cast<size_t>(warp_id / 4)]; }

#include "emu_fibers.h"  // NOLINT: inside namespace emu, after Barrier

inline void Barrier::arrive_and_wait() {
  if (++arrived_ == expected_) {
    complete_phase();
    return;
  }
  cta_fibers().wait(this, phase_);
}

// Runs kernel() as every thread of every CTA of `grid`. Shared memory is
// filled with 0xff (NaN in every float format) before each CTA.
template <typename Kernel>
void launch(dim3 grid, dim3 block, size_t shared_bytes, Kernel kernel) {
  ++num_launches;
  gridDim = grid;
  blockDim = block;
  const int threads = static_cast<int>(block.x);
  for (unsigned z = 0; z < grid.z; ++z) {
    for (unsigned y = 0; y < grid.y; ++y) {
      for (unsigned x = 0; x < grid.x; ++x) {
        ++num_ctas;
        std::memset(emu_smem, 0xff, shared_bytes);
        Cta cta(threads);
        current_cta = &cta;
        blockIdx = make_uint3(x, y, z);
        cta_fibers().run(threads, [&](int) {
          kernel();
          warp().barrier.arrive_and_drop();
          warp_group().barrier.arrive_and_drop();
          cta.barrier.arrive_and_drop();
        });
        current_cta = nullptr;
      }
    }
  }
}

}  // namespace emu

#include "emu_builtins.h"  // NOLINT: after namespace emu
