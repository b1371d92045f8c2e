#include "ops/cpu_isa.h"

#include <atomic>
#include <stdexcept>
#include <string>

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#endif
#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace pagedserve::ops {
namespace {

// AMX needs the CPU's tile and bf16 units (CPUID.7.0:EDX bits 24 and 22) and
// Linux's permission to use the tile state (arch_prctl, Linux 5.16+), which
// is per process and must come before any thread touches a tile register.
bool amx_usable() {
#if PS_X86_MULTIVERSION && defined(__linux__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0) return false;
  const bool has_tile = (edx >> 24) & 1u;
  const bool has_bf16 = (edx >> 22) & 1u;
  if (!has_tile || !has_bf16) return false;
  constexpr long kArchRequestXcompPerm = 0x1023;
  constexpr long kXfeatureTileData = 18;
  return syscall(SYS_arch_prctl, kArchRequestXcompPerm, kXfeatureTileData) == 0;
#else
  return false;
#endif
}

// CPUID.(EAX=7, ECX=sub_leaf) register bit; false where the leaf is absent.
bool cpuid7_bit(unsigned sub_leaf, int reg, int bit) {
#if PS_X86_MULTIVERSION
  unsigned regs[4] = {};
  if (__get_cpuid_count(7, sub_leaf, &regs[0], &regs[1], &regs[2], &regs[3]) == 0) return false;
  return (regs[reg] >> bit) & 1u;
#else
  (void)sub_leaf, (void)reg, (void)bit;
  return false;
#endif
}

constexpr int kEax = 0, kEcx = 2, kEdx = 3;

// AVX512_BF16: CPUID.(EAX=7, ECX=1):EAX bit 5.
bool has_avx512_bf16() { return cpuid7_bit(1, kEax, 5); }

CpuIsa detect_cpu_isa() {
#if PS_X86_MULTIVERSION
  __builtin_cpu_init();
  if (__builtin_cpu_supports("x86-64-v4")) {
    if (!has_avx512_bf16()) return CpuIsa::kAvx512;
    return amx_usable() ? CpuIsa::kAmx : CpuIsa::kAvx512Bf16;
  }
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
    case CpuIsa::kAvx512Bf16: return "avx512_bf16";
    case CpuIsa::kAmx: return "amx";
  }
  return "unknown";
}

CpuIsa best_supported_cpu_isa() {
  static const CpuIsa best = detect_cpu_isa();
  return best;
}

std::vector<CpuIsa> supported_cpu_isas() {
  std::vector<CpuIsa> isas;
  for (CpuIsa isa : {CpuIsa::kBaseline, CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Bf16, CpuIsa::kAmx}) {
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

bool cpu_has_avx512_vnni() {
  static const bool has = cpuid7_bit(0, kEcx, 11);
  return has && cpu_isa() >= CpuIsa::kAvx512;
}

bool cpu_has_amx_int8() {
  static const bool has = cpuid7_bit(0, kEdx, 25);
  return has && cpu_isa() == CpuIsa::kAmx;
}

}  // namespace pagedserve::ops
