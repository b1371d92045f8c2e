// GGUF (ggml) quantized block formats: the one place their byte layouts live.
//
// A quantized GGUF matrix W [N, K] (y = x W^T) is stored row by row, each row
// (one output feature) a run of K / block_elems blocks along K. A block holds
// float16 scale(s) and packed integer codes; its weights are
//
//   Q8_0  (34 B / 32):  d, int8 q[32]                      w = d q
//   Q4_0  (18 B / 32):  d, 16 B of nibbles                 w = d (q - 8)
//   Q4_1  (20 B / 32):  d, m, 16 B of nibbles              w = d q + m
//        (nibbles: byte j holds element j in its low and element j + 16 in its high half)
//   Q4_K  (144 B / 256): d, dmin, 12 B of 6-bit (scale, min) pairs for 8 sub-blocks of 32,
//        128 B of nibbles: bytes [32 g, 32 g + 32) hold sub-block 2g (low) and 2g + 1 (high);
//        w = d sc_j q - dmin m_j
//   Q5_K  (176 B / 256): as Q4_K plus qh[32]: bit j of qh[i] is the 5th bit of element i of
//        sub-block j
//   Q6_K  (210 B / 256): ql[128], qh[64], int8 scales[16] (one per 16 weights), d last;
//        element e = 128 h + r: low 4 bits from ql[64 h + r % 64] >> (4 (r / 64)), high 2 bits
//        from qh[32 h + r % 32] >> (2 (r / 32)); w = d scales[e / 16] (q - 32)
//
// The type numbers are ggml's (GGMLQuantizationType in the `gguf` package).
// The decoders below are plain loops, inlined into each ISA's kernel body
// (cpu_isa.h) so the compiler vectorizes them for that level.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#include "ops/cpu_isa.h"
#include "ops/float_types.h"

namespace pagedserve::ops::gguf {

enum class BlockType : int { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

struct BlockFormat {
  BlockType type;
  const char* name;
  int elems;  // weights per block
  int bytes;  // bytes per block
};

inline constexpr BlockFormat kFormats[] = {
    {BlockType::kQ4_0, "Q4_0", 32, 18},   {BlockType::kQ4_1, "Q4_1", 32, 20},
    {BlockType::kQ8_0, "Q8_0", 32, 34},   {BlockType::kQ4_K, "Q4_K", 256, 144},
    {BlockType::kQ5_K, "Q5_K", 256, 176}, {BlockType::kQ6_K, "Q6_K", 256, 210},
};

// The format of ggml type number `type`; throws std::invalid_argument naming
// the supported types otherwise.
const BlockFormat& block_format(int64_t type, const char* op);
std::string supported_type_names();  // "Q4_0 (2), Q4_1 (3), ..."

PS_ALWAYS_INLINE float load_half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return half_to_float(Half{bits});
}

// 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K block's 12 scale bytes.
PS_ALWAYS_INLINE void k_scale_min(const uint8_t* s, int j, int& scale, int& min) {
  if (j < 4) {
    scale = s[j] & 63;
    min = s[j + 4] & 63;
  } else {
    scale = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
    min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

PS_ALWAYS_INLINE void decode_q8_0(const uint8_t* b, float* out) {
  const float d = load_half(b);
  const auto* q = reinterpret_cast<const int8_t*>(b + 2);
  for (int i = 0; i < 32; ++i) out[i] = d * static_cast<float>(q[i]);
}

PS_ALWAYS_INLINE void decode_q4_0(const uint8_t* b, float* out) {
  const float d = load_half(b);
  const uint8_t* q = b + 2;
  for (int i = 0; i < 16; ++i) {
    out[i] = d * static_cast<float>((q[i] & 0x0f) - 8);
    out[i + 16] = d * static_cast<float>((q[i] >> 4) - 8);
  }
}

PS_ALWAYS_INLINE void decode_q4_1(const uint8_t* b, float* out) {
  const float d = load_half(b);
  const float m = load_half(b + 2);
  const uint8_t* q = b + 4;
  for (int i = 0; i < 16; ++i) {
    out[i] = d * static_cast<float>(q[i] & 0x0f) + m;
    out[i + 16] = d * static_cast<float>(q[i] >> 4) + m;
  }
}

PS_ALWAYS_INLINE void decode_q4_k(const uint8_t* b, float* out) {
  const float d = load_half(b);
  const float dmin = load_half(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* q = b + 16;
  for (int j = 0; j < 8; ++j) {
    int sc, mn;
    k_scale_min(scales, j, sc, mn);
    const float scale = d * static_cast<float>(sc);
    const float min = dmin * static_cast<float>(mn);
    const uint8_t* bytes = q + (j / 2) * 32;
    const int shift = (j % 2) * 4;
    for (int i = 0; i < 32; ++i) out[j * 32 + i] = scale * static_cast<float>((bytes[i] >> shift) & 0x0f) - min;
  }
}

PS_ALWAYS_INLINE void decode_q5_k(const uint8_t* b, float* out) {
  const float d = load_half(b);
  const float dmin = load_half(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* q = b + 48;
  for (int j = 0; j < 8; ++j) {
    int sc, mn;
    k_scale_min(scales, j, sc, mn);
    const float scale = d * static_cast<float>(sc);
    const float min = dmin * static_cast<float>(mn);
    const uint8_t* bytes = q + (j / 2) * 32;
    const int shift = (j % 2) * 4;
    for (int i = 0; i < 32; ++i) {
      const int code = ((bytes[i] >> shift) & 0x0f) | (((qh[i] >> j) & 1) << 4);
      out[j * 32 + i] = scale * static_cast<float>(code) - min;
    }
  }
}

PS_ALWAYS_INLINE void decode_q6_k(const uint8_t* b, float* out) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const auto* scales = reinterpret_cast<const int8_t*>(b + 192);
  const float d = load_half(b + 208);
  for (int h = 0; h < 2; ++h) {
    for (int part = 0; part < 4; ++part) {  // 32 elements each: r = 32 part + i
      const uint8_t* low = ql + 64 * h + (part % 2) * 32;
      const int low_shift = (part / 2) * 4;
      const uint8_t* high = qh + 32 * h;
      const int high_shift = 2 * part;
      const int base = 128 * h + 32 * part;
      const float scale0 = d * static_cast<float>(scales[base / 16]);
      const float scale1 = d * static_cast<float>(scales[base / 16 + 1]);
      for (int i = 0; i < 32; ++i) {
        const int code = ((low[i] >> low_shift) & 0x0f) | (((high[i] >> high_shift) & 3) << 4);
        out[base + i] = (i < 16 ? scale0 : scale1) * static_cast<float>(code - 32);
      }
    }
  }
}

// Decodes `count` consecutive blocks of one row.
template <BlockType kType>
PS_ALWAYS_INLINE void decode_blocks(const uint8_t* blocks, int64_t count, float* out) {
  for (int64_t blk = 0; blk < count; ++blk) {
    if constexpr (kType == BlockType::kQ8_0) decode_q8_0(blocks + blk * 34, out + blk * 32);
    if constexpr (kType == BlockType::kQ4_0) decode_q4_0(blocks + blk * 18, out + blk * 32);
    if constexpr (kType == BlockType::kQ4_1) decode_q4_1(blocks + blk * 20, out + blk * 32);
    if constexpr (kType == BlockType::kQ4_K) decode_q4_k(blocks + blk * 144, out + blk * 256);
    if constexpr (kType == BlockType::kQ5_K) decode_q5_k(blocks + blk * 176, out + blk * 256);
    if constexpr (kType == BlockType::kQ6_K) decode_q6_k(blocks + blk * 210, out + blk * 256);
  }
}

// Calls fn.template operator()<kType>() for the runtime type (one kernel per format).
template <typename Fn>
decltype(auto) dispatch_block_type(BlockType type, Fn&& fn) {
  switch (type) {
    case BlockType::kQ4_0: return fn.template operator()<BlockType::kQ4_0>();
    case BlockType::kQ4_1: return fn.template operator()<BlockType::kQ4_1>();
    case BlockType::kQ8_0: return fn.template operator()<BlockType::kQ8_0>();
    case BlockType::kQ4_K: return fn.template operator()<BlockType::kQ4_K>();
    case BlockType::kQ5_K: return fn.template operator()<BlockType::kQ5_K>();
    case BlockType::kQ6_K: return fn.template operator()<BlockType::kQ6_K>();
  }
  return fn.template operator()<BlockType::kQ8_0>();  // unreachable: block_format() checked the type
}

}  // namespace pagedserve::ops::gguf
