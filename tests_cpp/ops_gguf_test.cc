// The GGUF block decoders (gguf_blocks.h, gguf_decode_avx512.h): hand-built
// blocks against the formulas of ggml's layouts written out per element, and
// the AVX-512 decoders bit-identical to the portable ones on random blocks.
// (The Python tests check both against the `gguf` package's dequantization.)
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "ops/cpu_isa.h"
#include "ops/gguf_blocks.h"
#include "ops/gguf_decode_avx512.h"

namespace pagedserve::ops::gguf {
namespace {

void put_half(uint8_t* p, float value) {
  const Half h = float_to_half(value);
  std::memcpy(p, &h.bits, 2);
}

TEST(GgufBlocks, Q4_1ElementOrderAndAffineMap) {
  uint8_t block[20] = {};
  put_half(block, 0.5f);
  put_half(block + 2, -1.0f);
  for (int i = 0; i < 16; ++i) block[4 + i] = static_cast<uint8_t>(i | ((15 - i) << 4));
  float out[32];
  decode_q4_1(block, out);
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(out[i], 0.5f * static_cast<float>(i) - 1.0f) << i;             // low nibbles: elements 0..15
    EXPECT_EQ(out[i + 16], 0.5f * static_cast<float>(15 - i) - 1.0f) << i;   // high nibbles: 16..31
  }
}

TEST(GgufBlocks, Q6_KHighBitsAndScales) {
  std::vector<uint8_t> block(210, 0);
  put_half(block.data() + 208, 2.0f);
  for (int g = 0; g < 16; ++g) block[192 + static_cast<size_t>(g)] = static_cast<uint8_t>(g - 8);  // int8 scales
  // Element e = 128 h + r: its high 2 bits sit at qh[32 h + r % 32] >> 2 (r / 32). Set only element 200's.
  const int e = 200, h = e / 128, r = e % 128;
  block[static_cast<size_t>(128 + 32 * h + r % 32)] = static_cast<uint8_t>(3 << (2 * (r / 32)));
  float out[256];
  decode_q6_k(block.data(), out);
  for (int i = 0; i < 256; ++i) {
    const int code = i == e ? 48 : 0;  // low bits 0, high bits 3 -> 48
    EXPECT_EQ(out[i], 2.0f * static_cast<float>(i / 16 - 8) * static_cast<float>(code - 32)) << i;
  }
}

TEST(GgufBlocks, KScaleMinUnpacksSixBitPairs) {
  uint8_t s[12];
  for (int i = 0; i < 12; ++i) s[i] = static_cast<uint8_t>(37 * i + 11);
  for (int j = 0; j < 8; ++j) {
    int scale, min;
    k_scale_min(s, j, scale, min);
    const int want_scale = j < 4 ? (s[j] & 63) : ((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4));
    const int want_min = j < 4 ? (s[j + 4] & 63) : ((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    EXPECT_EQ(scale, want_scale) << j;
    EXPECT_EQ(min, want_min) << j;
  }
}

#if PS_X86_MULTIVERSION
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"  // GCC 12's AVX-512 headers (see packed_linear.cc)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
template <BlockType kType>
[[gnu::target("arch=x86-64-v4")]] void decode_with_avx512(const uint8_t* blocks, int64_t count, float* out) {
  decode_blocks_avx512<kType>(blocks, count, out);
}
#pragma GCC diagnostic pop

template <BlockType kType>
void expect_avx512_matches_portable(const BlockFormat& format) {
  std::mt19937 rng(static_cast<unsigned>(format.type));
  const int blocks = 3;
  std::vector<uint8_t> bytes(static_cast<size_t>(blocks * format.bytes));
  for (auto& b : bytes) b = static_cast<uint8_t>(rng());
  std::uniform_real_distribution<float> scale(-0.05f, 0.05f);
  for (int blk = 0; blk < blocks; ++blk) {  // finite float16 scales where each format keeps them
    uint8_t* base = bytes.data() + blk * format.bytes;
    if (kType == BlockType::kQ6_K) {
      put_half(base + 208, scale(rng));
    } else {
      put_half(base, scale(rng));
      if (kType != BlockType::kQ8_0 && kType != BlockType::kQ4_0) put_half(base + 2, scale(rng));
    }
  }
  std::vector<float> portable(static_cast<size_t>(blocks * format.elems));
  std::vector<float> vectorized(portable.size());
  decode_blocks<kType>(bytes.data(), blocks, portable.data());
  decode_with_avx512<kType>(bytes.data(), blocks, vectorized.data());
  EXPECT_EQ(portable, vectorized) << format.name;
}

TEST(GgufBlocks, Avx512DecodersMatchPortable) {
  if (best_supported_cpu_isa() < CpuIsa::kAvx512) GTEST_SKIP() << "no AVX-512 on this CPU";
  for (const BlockFormat& format : kFormats) {
    dispatch_block_type(format.type, [&]<BlockType kType>() { expect_avx512_matches_portable<kType>(format); });
  }
}
#endif

}  // namespace
}  // namespace pagedserve::ops::gguf
