// host_wait.cuh on the host: the steady clock, a yield, a full fence.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

namespace pagedserve::cuda {

inline uint64_t global_nanoseconds() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

inline void nap(unsigned /*nanoseconds*/) { std::this_thread::yield(); }

inline void fence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }

}  // namespace pagedserve::cuda
