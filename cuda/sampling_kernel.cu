// sample_tokens: Gumbel-max sampling of one token per row (see cpp/ops/ops.h).
//
// One CTA per row: its threads stride over the vocabulary in 16-byte chunks of
// logits, each keeping the best (score, id) it saw; a warp-shuffle then
// shared-memory reduction picks the row's best, lowest id on ties (so the
// thread count does not change the draw). The noise is a hash of (row key, id)
// (cpp/ops/gumbel_noise.h), so this draws exactly what the CPU op draws.
// A sampled row skips, exactly, the tokens that cannot win (consider() below):
// the two logarithms of the noise remain for ~1 token in 1,000.
// H200, bf16 logits, median of 50 calls (bench/results/h200/session42.md), before
// (every token's noise computed, one 2-byte load in flight a thread) and after:
// 256 x 151,936 (the long workload's rows) 131 -> 91-95 us; one row of 151,936
// 67 -> 49-52 us; 64 x 49,152 28 -> 25-28 us; one row of 32,000 21-23 us both.
// 1024 threads: with 256 threads 177 sampled rows of 151936 tokens took 242 us
// on an H100 (each thread a chain of ~600 candidates), 124 us with 1024.
// Bytes: one read of the logits (a 256 x 151936 bf16 step reads 78 MB, ~20 us
// on an H200) instead of the six or so full passes a softmax-based sampler
// makes over float32 logits.
#include <cfloat>

#include "cuda_check.h"
#include "cuda_ops.h"
#include "dispatch.h"
#include "float_convert.cuh"
#include "launch_limits.h"
#include "ops/gumbel_noise.h"
#include "ops/op_contracts.h"
#include "ops/token_mask.h"

namespace pagedserve::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
static_assert(kWarps == 32, "cta_best reduces one Best a lane");

struct Best {
  float score;
  int id;
};

__device__ __forceinline__ Best better(Best a, Best b) {
  return (b.score > a.score || (b.score == a.score && b.id < a.id)) ? b : a;
}

__device__ __forceinline__ Best warp_best(Best b) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const Best other{__shfl_xor_sync(0xffffffffu, b.score, offset), __shfl_xor_sync(0xffffffffu, b.id, offset)};
    b = better(b, other);
  }
  return b;
}

// The row's best over the CTA, in every thread (lowest id on ties).
__device__ __forceinline__ Best cta_best(Best b, Best* per_warp) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  b = warp_best(b);
  __syncthreads();  // per_warp is free: an earlier call's readers are past it
  if (lane == 0) per_warp[warp] = b;
  __syncthreads();
  return warp_best(per_warp[lane]);
}

// The logits of chunk c, tokens [c * kVec, c * kVec + kVec), in one access (16 bytes, or one element where a
// row does not start 16-byte aligned); -inf where the row's bitmask (null: none) clears a token's bit. One
// 2-byte load in flight a thread left the sampler latency-bound (H200, 256 x 151,936 bf16: 107-110 us).
template <typename T, int kVec>
__device__ __forceinline__ void load_chunk(float (&logit)[kVec], const T* x, const int32_t* mask, int c) {
  load_as_float(logit, x + static_cast<int64_t>(c) * kVec);
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    if (!ops::token_allowed(mask, c * kVec + e)) logit[e] = -INFINITY;
  }
}

// A token's score from its bits. Out of line: it runs for ~1 token in 1,000, and its two logarithms inlined at
// the unrolled loop's 16 call sites were cold code (the kernel's PTX 6,874 -> 5,863 lines).
__device__ __noinline__ float score(float logit, float inv_t, uint32_t bits) {
  return __fmaf_rn(logit, inv_t, ops::gumbel_noise(bits));
}

// `best` after token v of a sampled row, skipping (exactly) a token that cannot win: its logit / T plus the
// largest noise any bits give (most of a real model's vocabulary), or plus its own bucket's largest noise
// (random-weight logits lie close together), stays below the best so far. fmaf is monotone in the added
// noise, so a skipped token scores below a computed one; ties (lowest id wins) never skip. A skipped token
// costs the hash, a table read and two fmaf; the two logarithms remain for ~1 in 1,000.
__device__ __forceinline__ Best consider(Best best, float logit, int v, float inv_t, uint64_t key,
                                         const float* noise_bound) {
  if (__fmaf_rn(logit, inv_t, ops::kMaxGumbel) < best.score) return best;
  const uint32_t bits = ops::noise_bits(key, v);
  if (__fmaf_rn(logit, inv_t, noise_bound[ops::noise_bucket(bits)]) < best.score) return best;
  return better(best, Best{score(logit, inv_t, bits), v});
}

// Sampled rows start from the CTA's best over every thread's first chunk (up to 8,192 draws, all computed),
// so that few tokens after it pass the bounds.
template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads)
    sample_tokens_kernel(int32_t* out, const T* logits, const float* inv_temperature, const int32_t* allowed,
                         int vocab, uint64_t seed) {
  __shared__ Best per_warp[kWarps];
  __shared__ float noise_bound[ops::kNoiseBuckets];
  const int row = blockIdx.x;
  const T* x = logits + static_cast<int64_t>(row) * vocab;
  const int32_t* mask = allowed == nullptr ? nullptr : allowed + row * ops::token_mask_words(vocab);
  const float inv_t = inv_temperature[row];
  const uint64_t key = ops::gumbel_row_key(seed, row);
  const int chunks = vocab / kVec;  // kVec divides vocab
  float logit[kVec];
  Best best{-FLT_MAX, vocab};
  if (inv_t <= 0.f) {  // greedy
    for (int c = threadIdx.x; c < chunks; c += kThreads) {
      load_chunk(logit, x, mask, c);
#pragma unroll
      for (int e = 0; e < kVec; ++e) best = better(best, Best{logit[e], c * kVec + e});
    }
  } else {
    for (int b = threadIdx.x; b < ops::kNoiseBuckets; b += kThreads) noise_bound[b] = ops::noise_bucket_bound(b);
    if (static_cast<int>(threadIdx.x) < chunks) {
      load_chunk(logit, x, mask, threadIdx.x);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const int v = threadIdx.x * kVec + e;
        best = better(best, Best{score(logit[e], inv_t, ops::noise_bits(key, v)), v});
      }
    }
    best = cta_best(best, per_warp);  // its barriers also publish noise_bound
#pragma unroll 2
    for (int c = threadIdx.x + kThreads; c < chunks; c += kThreads) {
      load_chunk(logit, x, mask, c);
#pragma unroll
      for (int e = 0; e < kVec; ++e) best = consider(best, logit[e], c * kVec + e, inv_t, key, noise_bound);
    }
  }
  best = cta_best(best, per_warp);
  if (threadIdx.x == 0) out[row] = best.id < vocab ? best.id : 0;  // all -inf logits: token 0
}

}  // namespace

void sample_tokens(const TensorView& out, const TensorView& logits, const TensorView& inv_temperature,
                   const TensorView& allowed, uint64_t seed, cudaStream_t stream) {
  constexpr const char* kOp = "sample_tokens";
  ops::check_sample_tokens(ops::Device::kCUDA, out, logits, inv_temperature, allowed);
  const int rows = checked_int(kOp, "rows", logits.size(0));
  const int vocab = checked_int(kOp, "vocabulary", logits.size(1));
  if (rows == 0) return;
  DeviceGuard guard(logits.device_index);
  dispatch_float(logits.dtype, kOp, [&]<typename T>() {
    const int32_t* mask = allowed.data == nullptr ? nullptr : allowed.ptr<const int32_t>();
    constexpr int kVec = kVec16<T>;
    if (vocab % kVec == 0 && is_aligned16(logits.data)) {  // every row 16-byte aligned
      sample_tokens_kernel<T, kVec><<<rows, kThreads, 0, stream>>>(
          out.ptr<int32_t>(), logits.ptr<const T>(), inv_temperature.ptr<const float>(), mask, vocab, seed);
    } else {
      sample_tokens_kernel<T, 1><<<rows, kThreads, 0, stream>>>(
          out.ptr<int32_t>(), logits.ptr<const T>(), inv_temperature.ptr<const float>(), mask, vocab, seed);
    }
    check_launch("sample_tokens_kernel");
  });
}

}  // namespace pagedserve::cuda
