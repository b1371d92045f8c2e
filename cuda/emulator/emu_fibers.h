// The emulator's threads: fibers of one OS thread, switched in a few
// instructions. Included by emu_runtime.h, after Barrier, inside namespace emu.
#pragma once

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
