// wait_for_flag (cpp/ops/ops.h) on a stream: the device waits for a host thread.
//
// The grammar thread (python/pagedserve/engine/grammar_thread.py) fills a step's
// token masks into pinned memory while the device runs the step's forward, then
// raises a counter there. The draw that reads the masks is queued right after
// the forward with this wait before its mask copy, so the engine's thread need
// not wait for the masks to queue it. One thread polls the counter through the
// pinned page (mapped: unified addressing), napping 0.5 us between reads (a
// read crosses PCIe, ~1 us); the copy queued next reads the masks only once it
// has seen the raise (the thread writes the masks, then the counter).
#include <cstdint>
#include <string>

#include "cuda_check.h"
#include "cuda_ops.h"
#include "host_wait.cuh"
#include "ops/op_contracts.h"

namespace pagedserve::cuda {
namespace {

__global__ void wait_for_flag_kernel(volatile int64_t* flag, int64_t target, uint64_t timeout_ns) {
  const uint64_t start = global_nanoseconds();
  while (flag[0] < target) {
    if (global_nanoseconds() - start > timeout_ns) {
      flag[1] = 1;
      break;
    }
    nap(500);
  }
  fence_system();
}

}  // namespace

void wait_for_flag(const TensorView& flag, int64_t target, double timeout_seconds, cudaStream_t stream) {
  constexpr const char* kOp = "wait_for_flag";
  ops::check_wait_for_flag(flag, timeout_seconds);
  void* device_ptr = nullptr;
  if (cudaHostGetDevicePointer(&device_ptr, flag.data, 0) != cudaSuccess) {
    cudaGetLastError();  // clear it: the error is the caller's, not a sticky one
    ops::fail_argument(kOp, "flag must be pinned host memory (torch.empty(..., pin_memory=True)), got " +
                                 flag.describe());
  }
  wait_for_flag_kernel<<<1, 1, 0, stream>>>(static_cast<int64_t*>(device_ptr), target,
                                            static_cast<uint64_t>(timeout_seconds * 1e9));
  check_launch("wait_for_flag_kernel");
}

}  // namespace pagedserve::cuda
