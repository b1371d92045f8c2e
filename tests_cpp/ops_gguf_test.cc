// The GGUF block decoders (gguf_blocks.h, gguf_decode_avx512.h): hand-built
// blocks against the formulas of ggml's layouts written out per element, and
// the AVX-512 decoders bit-identical to the portable ones on random blocks.
// (The Python tests check both against the `gguf` package's dequantization.)
// The interleaved layout (gguf_interleaved.h): the byte map written out, the
// round trip, row lookups, and its int8-activation kernel beside the file
// layout's on rows with tails (under the sanitizers in CI).
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "ops/cpu_isa.h"
#include "ops/gguf_blocks.h"
#include "ops/gguf_decode_avx512.h"
#include "ops/gguf_int8.h"
#include "ops/gguf_interleaved.h"

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

std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> bytes(n);
  for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng());
  return bytes;
}

TEST(GgufInterleaved, ByteMapRoundTripAndRowLookup) {
  constexpr int64_t kRows = 16, kBlocks = 3, kRowBytes = kBlocks * 20;  // Q4_1, K = 96
  const std::vector<uint8_t> rows = random_bytes(kRows * kRowBytes, 7);
  std::vector<uint8_t> groups(rows.size()), back(rows.size()), row(kRowBytes);
  interleave_rows(BlockType::kQ4_1, rows.data(), groups.data(), kRows, kRowBytes);
  // Group 1, block 2: d of row r at 2r, m at 16 + 2r, chunk c's byte 4r + i = the row's code byte 4c + i.
  const uint8_t* block = groups.data() + 8 * kRowBytes + 2 * 8 * 20;
  for (int r = 0; r < 8; ++r) {
    const uint8_t* src = rows.data() + (8 + r) * kRowBytes + 2 * 20;
    EXPECT_EQ(block[2 * r], src[0]);
    EXPECT_EQ(block[2 * r + 1], src[1]);
    EXPECT_EQ(block[16 + 2 * r], src[2]);
    EXPECT_EQ(block[16 + 2 * r + 1], src[3]);
    for (int c = 0; c < 4; ++c) {
      for (int i = 0; i < 4; ++i) EXPECT_EQ(block[32 + 32 * c + 4 * r + i], src[4 + 4 * c + i]);
    }
  }
  deinterleave_groups(BlockType::kQ4_1, groups.data(), back.data(), kRows / 8, kRowBytes);
  EXPECT_EQ(back, rows);
  for (int64_t n = 0; n < kRows; ++n) {
    deinterleave_row(BlockType::kQ4_1, groups.data(), n, row.data(), kRowBytes);
    EXPECT_TRUE(std::equal(row.begin(), row.end(), rows.begin() + n * kRowBytes)) << "row " << n;
  }
}

// Random codes with small float16 scales (finite, so the two layouts' sums are comparable).
std::vector<uint8_t> random_blocks(BlockType type, int64_t rows, int64_t blocks, uint32_t seed) {
  const int bytes = block_format(static_cast<int64_t>(type), "test").bytes;
  std::vector<uint8_t> data = random_bytes(static_cast<size_t>(rows * blocks * bytes), seed);
  std::mt19937 rng(seed + 1);
  std::uniform_real_distribution<float> scale(-0.05f, 0.05f);
  for (int64_t b = 0; b < rows * blocks; ++b) {
    put_half(data.data() + b * bytes, scale(rng));
    if (type == BlockType::kQ4_1) put_half(data.data() + b * bytes + 2, scale(rng));
  }
  return data;
}

TEST(GgufInterleaved, KernelAgreesWithTheFileLayoutsOnRowsWithTails) {
  if (!int8_activations_apply(BlockType::kQ4_1)) GTEST_SKIP() << "no int8-activation kernels below AVX2";
  constexpr int64_t kK = 96, kN = 24;
  for (BlockType type : {BlockType::kQ4_0, BlockType::kQ4_1, BlockType::kQ8_0}) {
    const int64_t row_bytes = kK / 32 * block_format(static_cast<int64_t>(type), "test").bytes;
    const std::vector<uint8_t> rows = random_blocks(type, kN, kK / 32, 11);
    std::vector<uint8_t> groups(rows.size());
    interleave_rows(type, rows.data(), groups.data(), kN, row_bytes);
    for (int64_t m : {1, 5, 70}) {  // register blocks of 4 rows of x, their remainders, chunks of 64 rows
      std::mt19937 rng(static_cast<uint32_t>(m));
      std::normal_distribution<float> normal;
      std::vector<float> x(static_cast<size_t>(m * kK)), want(static_cast<size_t>(m * kN)), got(want.size());
      for (float& v : x) v = normal(rng);
      std::vector<float> bias(kN, 0.5f);
      const LinearArgs file{x.data(), rows.data(), bias.data(), want.data(), m, kK, kN, kN, row_bytes};
      LinearArgs interleaved = file;
      interleaved.blocks = groups.data();
      interleaved.out = got.data();
      linear_int8_activations(type, file);
      linear_int8_interleaved(type, interleaved);
      for (size_t i = 0; i < want.size(); ++i) {  // the same integer sums, rounded in another order
        EXPECT_NEAR(got[i], want[i], 1e-4f * (1.0f + std::abs(want[i]))) << "type " << static_cast<int>(type)
                                                                          << ", m " << m << ", i " << i;
      }
    }
  }
}

}  // namespace
}  // namespace pagedserve::ops::gguf
