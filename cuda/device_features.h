// What the launches ask of the machine: the current device's compute
// capability (read once a device) and the environment switches that turn a
// feature off for A/B runs.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "cuda_check.h"

namespace pagedserve::cuda {

// Whether the environment variable `name` is unset or anything but "0" (a switch that defaults to on).
inline bool env_switch_on(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr || std::strcmp(value, "0") != 0;
}

// The current device's compute capability as major * 10 + minor (90: Hopper), cached per device.
inline int current_compute_capability() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> known[kMaxDevices] = {};  // 0: not read yet
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  if (device < 0 || device >= kMaxDevices) return 0;
  int capability = known[device].load(std::memory_order_relaxed);
  if (capability == 0) {
    int major = 0;
    int minor = 0;
    check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute");
    check_cuda(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), "cudaDeviceGetAttribute");
    capability = 10 * major + minor;
    known[device].store(capability, std::memory_order_relaxed);
  }
  return capability;
}

}  // namespace pagedserve::cuda
