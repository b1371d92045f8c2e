// Runtime choice of the x86-64 instruction set the hot kernels run with.
//
// The library is compiled for baseline x86-64 (SSE2) so it runs anywhere;
// with_cpu_isa() additionally compiles a kernel body for the x86-64-v3 (AVX2,
// FMA) and x86-64-v4 (AVX-512) levels and runs the best one this CPU has.
// Above plain AVX-512, avx512_bf16 adds the bf16 dot product `vdpbf16ps`
// (Cooper Lake, Sapphire Rapids, Zen 4; not Ice Lake or Skylake-X), which
// the bf16-activation matrix kernels use. The top level, AMX (bf16 and int8
// tile matrix multiply, Sapphire Rapids and later; it implies avx512_bf16
// here), counts only where the OS granted this process the tile state; the
// matrix kernels check for these levels, and every other body runs its
// AVX-512 code there. AVX512-VNNI (`vpdpbusd`, int8 dot products) is a
// feature beside the levels (Cascade Lake has it without bf16): see
// cpu_has_avx512_vnni().
// The body must be a lambda marked PS_INLINE_BODY whose callees are
// PS_ALWAYS_INLINE, so that all of it is compiled for the chosen level:
//
//   with_cpu_isa([&]() PS_INLINE_BODY { silu_and_mul_rows<T>(...); });
//
// On other architectures and compilers every level runs the baseline code.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#define PS_X86_MULTIVERSION 1
#else
#define PS_X86_MULTIVERSION 0
#endif

// Helpers the kernel bodies call: inlined so they take on the body's ISA.
#define PS_ALWAYS_INLINE [[gnu::always_inline]] inline
// Placed after a lambda's parameter list: `[&]() PS_INLINE_BODY { ... }`.
#define PS_INLINE_BODY __attribute__((always_inline))

namespace pagedserve::ops {

enum class CpuIsa : uint8_t { kBaseline, kAvx2, kAvx512, kAvx512Bf16, kAmx };

std::string_view cpu_isa_name(CpuIsa isa);  // "baseline", "avx2", "avx512", "avx512_bf16", "amx"
CpuIsa best_supported_cpu_isa();
std::vector<CpuIsa> supported_cpu_isas();  // ascending, baseline first

// The level kernels run with; best_supported_cpu_isa() unless set otherwise.
CpuIsa cpu_isa();
// For tests and benchmarks: run kernels at a lower level. Throws
// std::invalid_argument for a level this CPU lacks.
void set_cpu_isa(CpuIsa isa);

// AVX512-VNNI's int8 dot product (CPUID.7.0:ECX bit 11), usable while the
// level is avx512 or above; AMX's int8 tiles (CPUID.7.0:EDX bit 25) while
// it is amx.
bool cpu_has_avx512_vnni();
bool cpu_has_amx_int8();

namespace isa_detail {

#if PS_X86_MULTIVERSION
template <typename Fn>
[[gnu::target("arch=x86-64-v4")]] void run_avx512(Fn& fn) {
  fn();
}
template <typename Fn>
[[gnu::target("arch=x86-64-v3")]] void run_avx2(Fn& fn) {
  fn();
}
#endif

}  // namespace isa_detail

template <typename Fn>
void with_cpu_isa(Fn&& fn) {
#if PS_X86_MULTIVERSION
  switch (cpu_isa()) {
    case CpuIsa::kAmx:
    case CpuIsa::kAvx512Bf16:
    case CpuIsa::kAvx512:
      isa_detail::run_avx512(fn);
      return;
    case CpuIsa::kAvx2:
      isa_detail::run_avx2(fn);
      return;
    case CpuIsa::kBaseline:
      break;
  }
#endif
  fn();
}

}  // namespace pagedserve::ops
