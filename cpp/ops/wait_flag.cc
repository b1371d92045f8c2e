// wait_for_flag (ops.h): the host's side of a flag another thread raises.
#include <atomic>
#include <chrono>
#include <thread>

#include "ops/op_contracts.h"
#include "ops/ops.h"

namespace pagedserve::ops {

void wait_for_flag(const TensorView& flag, int64_t target, double timeout_seconds) {
  check_wait_for_flag(flag, timeout_seconds);
  int64_t* words = flag.ptr<int64_t>();
  std::atomic_ref<int64_t> value(words[0]);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_seconds);
  // Spin briefly (a raise usually lands within microseconds of the wait), then sleep in short naps.
  for (int spins = 0; value.load(std::memory_order_acquire) < target; ++spins) {
    if (spins < 1000) {
      std::this_thread::yield();
      continue;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      std::atomic_ref<int64_t>(words[1]).store(1, std::memory_order_release);
      return;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

}  // namespace pagedserve::ops
