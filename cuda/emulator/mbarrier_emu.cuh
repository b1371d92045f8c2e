// Host stand-in for cuda/mbarrier.cuh (same interface). cp.async copies
// synchronously here, so its arrival is immediate; a wait yields to the other
// threads until the phase completes (a wait no arrival will ever end aborts
// as a deadlock after 10^7 turns).
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace pagedserve::cuda {

inline void mbarrier_init(uint64_t* bar, int count) {
  emu::Mbarrier& state = emu::current_cta->mbarrier(bar);
  state = emu::Mbarrier{count, count, 0};
}

inline void mbarrier_arrive(uint64_t* bar) {
  emu::Mbarrier& state = emu::current_cta->mbarrier(bar);
  if (state.expected == 0) {
    std::fprintf(stderr, "emulator: arrival on an mbarrier never initialized\n");
    std::abort();
  }
  if (--state.pending == 0) {
    ++state.completed;
    state.pending = state.expected;
  }
}

inline void cp_async_arrive(uint64_t* bar) { mbarrier_arrive(bar); }

inline void mbarrier_wait(uint64_t* bar, int parity) {
  for (long turns = 0; (emu::current_cta->mbarrier(bar).completed & 1) == static_cast<unsigned long>(parity); ++turns) {
    if (turns == 10'000'000) {
      std::fprintf(stderr, "emulator: deadlock: an mbarrier wait no arrival ends\n");
      std::abort();
    }
    emu::cta_fibers().yield();
  }
}

inline void named_barrier_sync(int id, int threads) { emu::current_cta->named_barrier(id, threads).arrive_and_wait(); }
inline void named_barrier_arrive(int id, int threads) { emu::current_cta->named_barrier(id, threads).arrive(); }

}  // namespace pagedserve::cuda
