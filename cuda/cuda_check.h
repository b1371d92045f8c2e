// Host-side helpers around kernel launches: error checks, the device guard,
// shared-memory opt-in.
#pragma once

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

namespace pagedserve::cuda {

// Throws std::runtime_error("<what>: <CUDA error string>") when status is an error.
inline void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
  }
}

// Call right after every <<<...>>> launch: reports bad launch configurations
// (and earlier asynchronous faults) without synchronizing.
inline void check_launch(const char* kernel_name) { check_cuda(cudaGetLastError(), kernel_name); }

// Makes `device` current for the launches in its scope. The extension links
// its own CUDA runtime, whose current device is independent of torch's.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) {
      check_cuda(cudaSetDevice(device), "cudaSetDevice");
      switched_ = true;
    }
  }
  ~DeviceGuard() {
    if (switched_) cudaSetDevice(previous_);  // best effort: destructors must not throw
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

// Kernels that use more than 48 KiB of dynamic shared memory must opt in.
template <typename Kernel>
void allow_dynamic_smem(Kernel kernel, size_t bytes, const char* kernel_name) {
  if (bytes > 48 * 1024) {
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)),
               kernel_name);
  }
}

template <typename Int>
constexpr Int ceil_div(Int a, Int b) {
  return (a + b - 1) / b;
}

}  // namespace pagedserve::cuda
