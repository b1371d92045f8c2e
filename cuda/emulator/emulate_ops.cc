// Runs every CUDA op, compiled for the host by the emulator, against the CPU
// reference ops (cpp/ops) on the same random inputs. Exit status 1 on any
// mismatch. Attention outputs must stay within the GPU tests' tolerances;
// the elementwise ops and cache writers must agree to the same tolerances (most
// are bit-identical). Cache slots no sequence may read hold NaN, outputs start
// as NaN, and shared memory is NaN before each CTA, so reading the wrong
// element shows up as a failure; build with ASan to catch out-of-bounds reads.
#include <cstdio>
#include <string>

#include "emu_check.h"

using namespace emu_check;

// The runtime calls the host code makes around its launches.
extern "C" {
cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int) { return cudaSuccess; }
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attribute, int) {
  switch (attribute) {  // an H100 SXM
    case cudaDevAttrComputeCapabilityMajor: *value = 9; break;
    case cudaDevAttrComputeCapabilityMinor: *value = 0; break;
    default: *value = 132;  // SMs
  }
  return cudaSuccess;
}
cudaError_t cudaGetLastError() { return cudaSuccess; }
cudaError_t cudaHostGetDevicePointer(void** device, void* host, unsigned int) {  // unified addressing
  *device = host;
  return cudaSuccess;
}
const char* cudaGetErrorString(cudaError_t) { return "emulated"; }
}

int main(int argc, char** argv) {
  const std::string only = argc > 1 ? argv[1] : "";
  cpu::set_num_threads(1);
  if (only.empty() || only == "elementwise") elementwise_cases();
  if (only.empty() || only == "attention") attention_cases();
  if (only.empty() || only == "attention" || only == "attention_options") attention_option_cases();
  if (only.empty() || only == "grouped_linear") grouped_linear_cases();
  if (only.empty() || only == "small_batch_linear") small_batch_linear_cases();
  if (only.empty() || only == "sampling") sampling_cases();
  std::printf("%d failures (%lld launches, %lld CTAs emulated)\n", failures, emu::num_launches, emu::num_ctas);
  return failures == 0 ? 0 : 1;
}
