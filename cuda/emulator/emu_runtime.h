// A host emulation of the CUDA execution model, enough for the kernels in
// cuda/: each CTA runs as blockDim.x std::threads (a pool reused by every
// CTA), one CTA at a time.
// __syncthreads and the warp-wide operations (shuffles, ldmatrix, mma)
// rendezvous on barriers; cp.async copies synchronously, so the emulator checks
// indexing, masking and arithmetic, not the timing of the pipelines (that is
// compute-sanitizer racecheck's job on a GPU).
//
// Force-included (g++ -include) before the host copies of the kernel sources
// that make_host_sources.py writes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <semaphore>
#include <thread>
#include <vector>

#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif

inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline dim3 gridDim;
inline dim3 blockDim;

// The dynamic shared memory of the CTA being run (227 KB, the sm_90 maximum).
alignas(128) inline unsigned char emu_smem[232448];

namespace emu {

// What the lanes of one warp exchange at a rendezvous.
struct Warp {
  std::barrier<> barrier{32};
  float value[32];
  const void* address[32];
  uint32_t a[32][4];
  uint32_t b[32][2];
};

struct Cta {
  explicit Cta(int threads) : barrier(threads), warps(static_cast<size_t>((threads + 31) / 32)) {}
  std::barrier<> barrier;
  std::vector<Warp> warps;
};

inline Cta* current_cta = nullptr;
inline thread_local int lane_id = 0;
inline thread_local int warp_id = 0;
inline long long num_launches = 0;
inline long long num_ctas = 0;

inline Warp& warp() { return current_cta->warps[static_cast<size_t>(warp_id)]; }

// The OS threads that play a CTA's threads, made once and reused by every
// CTA: thread t of the pool is threadIdx.x = t. Creating ~150 threads a CTA
// for ~8,000 CTAs (and unmapping their stacks) was most of the emulator's
// time in CI, two thirds of it in the kernel (2-core Zen 3: 352 s).
class CtaThreads {
 public:
  CtaThreads() = default;
  CtaThreads(const CtaThreads&) = delete;
  CtaThreads& operator=(const CtaThreads&) = delete;
  ~CtaThreads() {
    for (auto& worker : workers_) {
      worker->stop = true;
      worker->go.release();
    }
    for (auto& worker : workers_) worker->thread.join();
  }

  // Runs body(t) on threads t = 0 .. count - 1 and returns when all have finished.
  void run(int count, const std::function<void(int)>& body) {
    while (static_cast<int>(workers_.size()) < count) add_worker();
    body_ = &body;
    remaining_.store(count);
    for (int t = 0; t < count; ++t) workers_[static_cast<size_t>(t)]->go.release();
    all_done_.acquire();
  }

 private:
  struct Worker {
    std::binary_semaphore go{0};
    bool stop = false;
    std::thread thread;
  };

  void add_worker() {
    const int t = static_cast<int>(workers_.size());
    auto worker = std::make_unique<Worker>();
    Worker* w = worker.get();
    worker->thread = std::thread([this, w, t] {
      for (;;) {
        w->go.acquire();
        if (w->stop) return;
        (*body_)(t);
        if (remaining_.fetch_sub(1) == 1) all_done_.release();
      }
    });
    workers_.push_back(std::move(worker));
  }

  std::vector<std::unique_ptr<Worker>> workers_;
  const std::function<void(int)>* body_ = nullptr;
  std::atomic<int> remaining_{0};
  std::binary_semaphore all_done_{0};
};

inline CtaThreads& cta_threads() {
  static CtaThreads threads;
  return threads;
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
        cta_threads().run(threads, [&](int t) {
          threadIdx = make_uint3(static_cast<unsigned>(t), 0, 0);
          blockIdx = make_uint3(x, y, z);
          lane_id = t % 32;
          warp_id = t / 32;
          kernel();
          warp().barrier.arrive_and_drop();  // an exited thread stops counting, as on the GPU
          cta.barrier.arrive_and_drop();
        });
        current_cta = nullptr;
      }
    }
  }
}

}  // namespace emu

inline void __syncthreads() { emu::current_cta->barrier.arrive_and_wait(); }

inline float __shfl_xor_sync(unsigned /*mask*/, float v, int lane_mask) {
  emu::Warp& w = emu::warp();
  w.value[emu::lane_id] = v;
  w.barrier.arrive_and_wait();
  const float other = w.value[emu::lane_id ^ lane_mask];
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
