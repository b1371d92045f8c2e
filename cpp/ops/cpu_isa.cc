#include "ops/cpu_isa.h"

#include <atomic>
#include <stdexcept>
#include <string>

namespace pagedserve::ops {
namespace {

CpuIsa detect_cpu_isa() {
#if PS_X86_MULTIVERSION
  __builtin_cpu_init();
  if (__builtin_cpu_supports("x86-64-v4")) return CpuIsa::kAvx512;
  if (__builtin_cpu_supports("x86-64-v3")) return CpuIsa::kAvx2;
#endif
  return CpuIsa::kBaseline;
}

// Process-wide like the thread count: which code the CPU runs, not per-call state.
std::atomic<CpuIsa>& active_isa() {
  static std::atomic<CpuIsa> isa{best_supported_cpu_isa()};
  return isa;
}

}  // namespace

std::string_view cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kBaseline: return "baseline";
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kAvx512: return "avx512";
  }
  return "unknown";
}

CpuIsa best_supported_cpu_isa() {
  static const CpuIsa best = detect_cpu_isa();
  return best;
}

std::vector<CpuIsa> supported_cpu_isas() {
  std::vector<CpuIsa> isas;
  for (CpuIsa isa : {CpuIsa::kBaseline, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (isa <= best_supported_cpu_isa()) isas.push_back(isa);
  }
  return isas;
}

CpuIsa cpu_isa() { return active_isa().load(std::memory_order_relaxed); }

void set_cpu_isa(CpuIsa isa) {
  if (isa > best_supported_cpu_isa()) {
    throw std::invalid_argument("set_cpu_isa: this CPU does not support " + std::string(cpu_isa_name(isa)) +
                                " (best: " + std::string(cpu_isa_name(best_supported_cpu_isa())) + ")");
  }
  active_isa().store(isa, std::memory_order_relaxed);
}

}  // namespace pagedserve::ops
