// The int8-activation kernels of gguf_linear (gguf_ops.h), for CPUs with
// AVX2 or AVX512_VNNI: each row of x is quantized to int8 per 32-element block
// (one float scale per block, as llama.cpp's Q8_0 activations), and the GGUF
// blocks' integer codes are multiplied by it with vpdpbusd (or AVX2's
// vpmaddubsw + vpmaddwd, the same sums), 4 code pairs per int32 lane, then
// scaled in float32 once per block.
//
// Why: the float32 kernel (decode to float, then FMA) spends ~10 vector
// instructions per 32 weights and streams Q4_1 blocks at ~9 GB/s per core;
// here the codes stay 8-bit and the same 32 weights take one vpdpbusd per
// row of x, so a decode step is bound by memory rather than arithmetic.
// Cost: x is rounded to 8 bits (relative error up to 1/254 per element of a
// block, ~1e-3 on a typical dot product), as llama.cpp's CPU backend does.
//
// Batch invariance: a row's result depends only on that row and the weight
// (the quantization and every sum are per row, in a fixed order), so the path
// is used for every M, prefill included, and a request's outputs do not
// depend on which requests share its batch.
#pragma once

#include <cstdint>

#include "ops/gguf_blocks.h"

namespace pagedserve::ops::gguf {

struct LinearArgs {
  const float* x;         // [M, K]
  const uint8_t* blocks;  // [N, row_bytes]
  const float* bias;      // [N] or null
  float* out;             // [M, out_stride]
  int64_t rows;           // M
  int64_t in_features;    // K
  int64_t out_features;   // N
  int64_t out_stride;
  int64_t row_bytes;
};

// Whether gguf_linear takes the int8-activation path for `type` (every format
// of gguf_blocks.h: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K): the kernels' ISA
// level (cpu_isa()) AVX2 or above. vpdpbusd where the level is AVX-512 and
// the CPU has AVX512_VNNI (CPUID leaf 7, ECX bit 11), else AVX2's products;
// both give the same bits.
bool int8_activations_apply(BlockType type);

// out = x W^T (+ bias) on that path; the caller checked the arguments.
void linear_int8_activations(BlockType type, const LinearArgs& args);

// The same over interleaved blocks (gguf_interleaved.h: every format; out_features a multiple
// of 8; blocks [N, row_bytes] in that layout), on the same path: one int32 dot product per row and
// block instead of 8 lanes (gguf_int8_interleaved.inc gives the arithmetic).
void linear_int8_interleaved(BlockType type, const LinearArgs& args);

}  // namespace pagedserve::ops::gguf
