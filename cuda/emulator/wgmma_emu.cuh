// Host stand-in for cuda/wgmma.cuh (same interface). A wgmma is a rendezvous
// of the warpgroup's 128 threads: the first reads both operands through their
// descriptors, as the PTX ISA defines them (128-byte swizzle: the 16-byte
// chunk bits 4-6 of each shared address XOR bits 7-9; K-major rows 128 bytes
// apart, 8-row groups `stride` apart; MN-major 64-column slabs `leading`
// apart), and writes every thread's accumulator fragment. Synchronous, so the
// waits and fences have nothing to do; the descriptors must be uniform across
// the warpgroup, as the hardware requires, or the run aborts.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "mma.cuh"  // the emulator's (mma_emu.cuh)

namespace pagedserve::cuda {

// Shared "addresses" are offsets into the emulator's (1,024-byte aligned) shared memory.
inline uint32_t shared_address(const void* ptr) {
  return static_cast<uint32_t>(static_cast<const unsigned char*>(ptr) - emu_smem);
}

namespace wgmma {

inline constexpr int kGroupThreads = 128;
inline constexpr int kRows = 64;
inline constexpr int kAtomBytes = 1024;
inline constexpr int kSwizzleRowBytes = 128;

inline uint64_t descriptor(const void* smem, uint32_t leading_bytes, uint32_t stride_bytes) {
  const uint32_t address = shared_address(smem);
  return static_cast<uint64_t>((address & 0x3FFFF) >> 4) | static_cast<uint64_t>((leading_bytes & 0x3FFFF) >> 4) << 16 |
         static_cast<uint64_t>((stride_bytes & 0x3FFFF) >> 4) << 32 | uint64_t{1} << 62;
}
inline uint64_t advance(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

inline void fence() {}
inline void commit_group() {}
template <int kPending>
inline void wait_group() {}
inline void fence_shared_for_async_proxy() {}
template <typename V, int N>
inline void pin(V (&)[N]) {}

namespace emulated {

struct Operand {
  uint32_t start, leading, stride;
  explicit Operand(uint64_t desc)
      : start(static_cast<uint32_t>(desc & 0x3FFF) << 4),
        leading(static_cast<uint32_t>(desc >> 16 & 0x3FFF) << 4),
        stride(static_cast<uint32_t>(desc >> 32 & 0x3FFF) << 4) {
    if (desc >> 62 != 1) {
      std::fprintf(stderr, "emulator: wgmma descriptor without the 128-byte swizzle\n");
      std::abort();
    }
  }
  template <typename T>
  float at(uint32_t byte) const {
    byte ^= (byte >> 7 & 7) << 4;
    uint16_t bits;
    std::memcpy(&bits, emu_smem + byte, sizeof(bits));
    return pagedserve::cuda::emulated::to_float_bits<T>(bits);
  }
  // Element (mn, k) of a K-major operand: row mn's 16 values contiguous.
  template <typename T>
  float k_major(int mn, int k) const {
    return at<T>(start + static_cast<uint32_t>(mn / 8) * stride + static_cast<uint32_t>(mn % 8) * 128 + 2 * k);
  }
  // Element (k, n) of an MN-major operand: row k's 64-column slabs `leading` apart.
  template <typename T>
  float mn_major(int k, int n) const {
    return at<T>(start + static_cast<uint32_t>(n / 64) * leading + static_cast<uint32_t>(n % 64) * 2 +
                 static_cast<uint32_t>(k / 8) * stride + static_cast<uint32_t>(k % 8) * 128);
  }
};

template <typename T>
float register_value(uint32_t reg, int half) {
  return pagedserve::cuda::emulated::to_float_bits<T>(half == 0 ? reg : reg >> 16);
}

// The group's 64 x 128 product of a(row, k) and b(k, col), into each thread's fragment.
template <typename A, typename B>
void multiply(emu::WarpGroup& g, int threads, A a, B b) {
  for (int t = 1; t < threads; ++t) {
    if (g.desc_b[t] != g.desc_b[0] || g.desc_a[t] != g.desc_a[0] || g.accumulate[t] != g.accumulate[0]) {
      std::fprintf(stderr, "emulator: wgmma operands differ across the warpgroup\n");
      std::abort();
    }
  }
  float A_[64][16];
  float B_[16][128];
  for (int r = 0; r < 64; ++r)
    for (int k = 0; k < 16; ++k) A_[r][k] = a(r, k);
  for (int k = 0; k < 16; ++k)
    for (int n = 0; n < 128; ++n) B_[k][n] = b(k, n);
  for (int t = 0; t < threads; ++t) {
    const int lane = t % 32;
    for (int j = 0; j < 16; ++j) {
      for (int e = 0; e < 4; ++e) {
        const int row = 16 * (t / 32) + lane / 4 + 8 * (e / 2);
        const int col = 8 * j + 2 * (lane % 4) + e % 2;
        float acc = 0.f;
        for (int k = 0; k < 16; ++k) acc += A_[row][k] * B_[k][col];
        float& d = g.d[t][4 * j + e];
        d = (g.accumulate[0] != 0 ? d : 0.f) + acc;
      }
    }
  }
}

template <typename Body>
void group_rendezvous(float (&d)[64], const uint32_t* a, uint64_t desc_a, uint64_t desc_b, int accumulate,
                      Body body) {
  emu::WarpGroup& g = emu::warp_group();
  const int t = static_cast<int>(threadIdx.x) % kGroupThreads;
  g.d[t] = d;
  if (a != nullptr) std::memcpy(g.a[t], a, sizeof(g.a[t]));
  g.desc_a[t] = desc_a;
  g.desc_b[t] = desc_b;
  g.accumulate[t] = accumulate;
  g.barrier.arrive_and_wait();
  if (t == 0) body(g);
  g.barrier.arrive_and_wait();
}

}  // namespace emulated

template <typename T>
void mma_128_ss(float (&d)[64], uint64_t a, uint64_t b, int accumulate) {
  emulated::group_rendezvous(d, nullptr, a, b, accumulate, [](emu::WarpGroup& g) {
    const emulated::Operand A(g.desc_a[0]);
    const emulated::Operand B(g.desc_b[0]);
    emulated::multiply(g, kGroupThreads, [&](int r, int k) { return A.k_major<T>(r, k); },
                       [&](int k, int n) { return B.k_major<T>(n, k); });
  });
}

template <typename T>
void mma_128_rs_mn(float (&d)[64], const uint32_t (&a)[4], uint64_t b) {
  emulated::group_rendezvous(d, a, 0, b, 1, [](emu::WarpGroup& g) {
    const emulated::Operand B(g.desc_b[0]);
    // A fragments as mma.m16n8k16's, warp w holding rows [16 w, 16 w + 16).
    float A_[64][16];
    for (int t = 0; t < kGroupThreads; ++t) {
      const int row = 16 * (t / 32) + (t % 32) / 4;
      const int k = 2 * (t % 4);
      for (int half = 0; half < 2; ++half) {
        A_[row][k + half] = emulated::register_value<T>(g.a[t][0], half);
        A_[row + 8][k + half] = emulated::register_value<T>(g.a[t][1], half);
        A_[row][k + 8 + half] = emulated::register_value<T>(g.a[t][2], half);
        A_[row + 8][k + 8 + half] = emulated::register_value<T>(g.a[t][3], half);
      }
    }
    emulated::multiply(g, kGroupThreads, [&](int r, int k) { return A_[r][k]; },
                       [&](int k, int n) { return B.mn_major<T>(k, n); });
  });
}

}  // namespace wgmma
}  // namespace pagedserve::cuda
