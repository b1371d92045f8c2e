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
// that make_host_sources.py writes.
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

#if !defined(__x86_64__)
#error "the emulator switches between fibers in x86-64 assembly (switch_stack)"
#endif

// Saves the callee-saved registers and the SSE / x87 control words on the
// running stack, stores its stack pointer in *from, and returns on the stack
// `to` (saved the same way). glibc's swapcontext also saves the signal mask,
// a system call each switch: the attention cases took 58 s with it, 12 s
// without. run.sh builds with -fcf-protection=none, so no CET shadow stack
// ever sees a `ret` to an address no call pushed.
[[gnu::naked, gnu::noinline]] inline void switch_stack(void** /*from*/, void* /*to*/) {
  asm volatile(
      "pushq %rbp\n pushq %rbx\n pushq %r12\n pushq %r13\n pushq %r14\n pushq %r15\n"
      "subq $8, %rsp\n stmxcsr (%rsp)\n fnstcw 4(%rsp)\n"
      "movq %rsp, (%rdi)\n movq %rsi, %rsp\n"
      "ldmxcsr (%rsp)\n fldcw 4(%rsp)\n addq $8, %rsp\n"
      "popq %r15\n popq %r14\n popq %r13\n popq %r12\n popq %rbx\n popq %rbp\n ret\n");
}

// The fibers that play a CTA's threads: fiber t is threadIdx.x = t. Their
// stacks (1 MiB, reserved but committed only as touched, a guard page below)
// are made once and reused by every CTA.
class CtaFibers {
 public:
  CtaFibers() = default;
  CtaFibers(const CtaFibers&) = delete;
  CtaFibers& operator=(const CtaFibers&) = delete;
  ~CtaFibers() {
    for (auto& fiber : fibers_) munmap(fiber->stack, kStackBytes);
  }

  // Runs body(t) as threads t = 0 .. count - 1, round robin, and returns when all have finished.
  void run(int count, const std::function<void(int)>& body) {
    while (static_cast<int>(fibers_.size()) < count) add_fiber();
    body_ = &body;
    for (int t = 0; t < count; ++t) start(t);
    for (int live = count; live > 0;) {
      bool resumed = false;
      for (int t = 0; t < count; ++t) {
        Fiber& fiber = *fibers_[static_cast<size_t>(t)];
        if (fiber.done || (fiber.waiting != nullptr && fiber.waiting->phase() == fiber.phase)) continue;
        fiber.waiting = nullptr;
        resume(t);
        resumed = true;
        if (fiber.done) --live;
      }
      if (!resumed) {  // on a GPU a hang: a barrier that some thread never reaches
        std::fprintf(stderr, "emulator: deadlock: %d threads wait at barriers no thread will complete\n", live);
        std::abort();
      }
    }
  }

  // The running thread lets the others run (a spin-wait's turn); it runs again in the next round.
  void yield() {
    Fiber& fiber = *fibers_[static_cast<size_t>(current_)];
    fiber.waiting = nullptr;
    switch_out(fiber, false);
  }

  // The running thread waits until `barrier` leaves `phase`.
  void wait(const Barrier* barrier, unsigned long phase) {
    Fiber& fiber = *fibers_[static_cast<size_t>(current_)];
    fiber.waiting = barrier;
    fiber.phase = phase;
    switch_out(fiber, false);
  }

 private:
  static constexpr size_t kStackBytes = size_t{1} << 20;
  static constexpr size_t kGuardBytes = 4096;

  struct Fiber {
    char* stack = nullptr;
    void* sp = nullptr;  // where switch_stack left it
    bool done = true;
    const Barrier* waiting = nullptr;
    unsigned long phase = 0;
    void* asan_fake_stack = nullptr;
  };

  void add_fiber() {
    auto fiber = std::make_unique<Fiber>();
    void* stack = mmap(nullptr, kStackBytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
    if (stack == MAP_FAILED || mprotect(stack, kGuardBytes, PROT_NONE) != 0) {
      std::perror("emulator: a fiber stack");
      std::abort();
    }
    fiber->stack = static_cast<char*>(stack);
    fibers_.push_back(std::move(fiber));
  }

  // A fresh stack that switch_stack "returns" into entry() on, as if entry had been called (rsp = 8 mod 16).
  void start(int t) {
    Fiber& fiber = *fibers_[static_cast<size_t>(t)];
#if defined(__SANITIZE_ADDRESS__)  // the redzones of the frames the last fiber on this stack left behind
    __asan_unpoison_memory_region(fiber.stack + kGuardBytes, kStackBytes - kGuardBytes);
#endif
    auto** sp = reinterpret_cast<void**>(fiber.stack + kStackBytes);  // 16-aligned (mmap)
    *--sp = nullptr;                                      // entry's return address: it never returns
    *--sp = reinterpret_cast<void*>(&CtaFibers::entry);   // switch_stack's ret
    for (int r = 0; r < 6; ++r) *--sp = nullptr;          // rbp rbx r12 r13 r14 r15
    *--sp = reinterpret_cast<void*>(uintptr_t{0x037F} << 32 | 0x1F80);  // fcw : mxcsr, the defaults
    fiber.sp = sp;
    fiber.done = false;
    fiber.waiting = nullptr;
    fiber.asan_fake_stack = nullptr;
  }

  void resume(int t) {
    current_ = t;
    threadIdx = make_uint3(static_cast<unsigned>(t), 0, 0);
    lane_id = t % 32;
    warp_id = t / 32;
    Fiber& fiber = *fibers_[static_cast<size_t>(t)];
#if defined(__SANITIZE_ADDRESS__)
    void* fake_stack = nullptr;
    __sanitizer_start_switch_fiber(&fake_stack, fiber.stack + kGuardBytes, kStackBytes - kGuardBytes);
    switch_stack(&scheduler_sp_, fiber.sp);
    __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#else
    switch_stack(&scheduler_sp_, fiber.sp);
#endif
  }

  void switch_out(Fiber& fiber, bool finished) {
#if defined(__SANITIZE_ADDRESS__)
    __sanitizer_start_switch_fiber(finished ? nullptr : &fiber.asan_fake_stack, scheduler_stack_,
                                   scheduler_stack_bytes_);
#endif
    switch_stack(&fiber.sp, scheduler_sp_);  // a finished fiber is never switched back to
    switched_in(fiber);
  }

  void switched_in([[maybe_unused]] Fiber& fiber) {
#if defined(__SANITIZE_ADDRESS__)
    __sanitizer_finish_switch_fiber(fiber.asan_fake_stack, &scheduler_stack_, &scheduler_stack_bytes_);
#endif
  }

  static void entry();

  std::vector<std::unique_ptr<Fiber>> fibers_;
  const std::function<void(int)>* body_ = nullptr;
  void* scheduler_sp_ = nullptr;
  int current_ = 0;
  const void* scheduler_stack_ = nullptr;
  size_t scheduler_stack_bytes_ = 0;
};

inline CtaFibers& cta_fibers() {
  static CtaFibers fibers;
  return fibers;
}

inline void CtaFibers::entry() {
  CtaFibers& self = cta_fibers();
  const int t = self.current_;
  Fiber& fiber = *self.fibers_[static_cast<size_t>(t)];
  self.switched_in(fiber);
  (*self.body_)(t);
  fiber.done = true;
  self.switch_out(fiber, true);  // never returns
  __builtin_unreachable();
}

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
