// Causal flash attention with switchable softmax arithmetic, for
// bench/softmax_numerics.py: which exponent form, row-sum order, final
// normalization and key tile reproduce cuDNN's bf16 SDPA bit for bit? (a
// measurement tool, built by that script with nvcc into a ctypes library; not
// part of pagedserve)
//
// One warp per 16 query rows of one head, reading q / k / v straight from
// global memory (speed is no concern here). The scores and P V use the same
// mma.sync m16n8k16 fragments as cuda/warp_attention.cuh.
#include <cuda_runtime.h>

#include "mma.cuh"

namespace {

using pagedserve::cuda::mma_m16n8k16;
using pagedserve::cuda::pack2;
using T = __nv_bfloat16;

constexpr int kDim = 64;
constexpr float kLog2e = 1.4426950408889634f;

enum Exp {
  kPrescaledLog2 = 0,    // t = s*c; exp2f(t - max t)                     (c = scale*log2 e; ours)
  kPrescaledLog2Approx,  // the same through ex2.approx.ftz
  kFmaLog2,              // exp2f(fma(s, c, -(max s)*c))                   (FlashAttention-2)
  kNaturalExpf,          // t = s*scale; expf(t - max t)
  kNaturalFastExp,       // t = s*scale; __expf(t - max t)
  kShiftThenScale,       // exp2f((s - max s) * c)
  kShiftThenScaleApprox, // ex2.approx.ftz((s - max s) * c)
  kNumExp
};
enum Sum { kPairThenSequential = 0, kSequential, kSequentialRounded, kTensorCore, kNumSum };
enum Quad { kXor1Then2 = 0, kXor2Then1, kNumQuad };
enum Norm { kMulReciprocal = 0, kDivide, kMulApproxReciprocal, kFastDivide, kNumNorm };

__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float quad(float v, int order, bool is_max) {
  const int first = order == kXor1Then2 ? 1 : 2, second = 3 - first;
  float o = __shfl_xor_sync(0xffffffffu, v, first);
  v = is_max ? fmaxf(v, o) : v + o;
  o = __shfl_xor_sync(0xffffffffu, v, second);
  return is_max ? fmaxf(v, o) : v + o;
}

__device__ __forceinline__ uint32_t load_pair(const T* p) { return *reinterpret_cast<const uint32_t*>(p); }

__device__ __forceinline__ uint32_t join(T lo, T hi) {
  return static_cast<uint32_t>(__bfloat16_as_ushort(lo)) | (static_cast<uint32_t>(__bfloat16_as_ushort(hi)) << 16);
}

__device__ __forceinline__ float exponent(int exp_form, float x, float m, float c_log2) {
  switch (exp_form) {
    case kPrescaledLog2: return exp2f(x - m);
    case kPrescaledLog2Approx: return ex2_approx(x - m);
    case kFmaLog2: return exp2f(__fmaf_rn(x, c_log2, -(m * c_log2)));
    case kNaturalExpf: return expf(x - m);
    case kNaturalFastExp: return __expf(x - m);
    case kShiftThenScale: return exp2f((x - m) * c_log2);
    default: return ex2_approx((x - m) * c_log2);
  }
}

// q, out: [heads, q_len, kDim]; k, v: [heads, k_len, kDim]; query row r sits at
// position k_len - q_len + r (causal). grid (heads, ceil(q_len / 16)), one warp.
// Online softmax over key tiles of kTile; `running` 0 keeps one row sum that
// each tile rescales and then extends (FlashAttention), 1 sums each tile
// separately and adds it to the rescaled running sum.
template <int kTile>
__global__ void attention_variant_kernel(T* out, const T* q, const T* k, const T* v, int q_len, int k_len,
                                         float scale, int exp_form, int sum_order, int quad_order, int norm,
                                         int running) {
  constexpr int kTiles8 = kTile / 8;
  const int head = blockIdx.x, row0 = blockIdx.y * 16, lane = threadIdx.x;
  const int g = lane / 4, c = lane % 4;
  const T* qh = q + static_cast<int64_t>(head) * q_len * kDim;
  const T* kh = k + static_cast<int64_t>(head) * k_len * kDim;
  const T* vh = v + static_cast<int64_t>(head) * k_len * kDim;
  const T zero = __float2bfloat16(0.f);
  const float c_log2 = scale * kLog2e;
  const bool natural = exp_form == kNaturalExpf || exp_form == kNaturalFastExp;
  const bool prescaled = exp_form <= kPrescaledLog2Approx;
  const uint32_t ones = join(__float2bfloat16(1.f), __float2bfloat16(1.f));

  uint32_t qf[kDim / 16][4];
  for (int ks = 0; ks < kDim / 16; ++ks) {
    for (int r = 0; r < 4; ++r) {
      const int row = row0 + g + 8 * (r % 2), col = 16 * ks + 2 * c + 8 * (r / 2);
      qf[ks][r] = row < q_len ? load_pair(qh + row * kDim + col) : 0u;
    }
  }
  float row_max[2] = {-INFINITY, -INFINITY}, sum[2] = {0.f, 0.f}, tc_sum[4] = {};
  float acc[kDim / 8][4] = {};
  for (int tile0 = 0; tile0 < k_len; tile0 += kTile) {
    float s[kTiles8][4] = {};
    for (int n = 0; n < kTiles8; ++n) {
      const int key = tile0 + 8 * n + g;
      for (int ks = 0; ks < kDim / 16; ++ks) {
        const uint32_t b0 = key < k_len ? load_pair(kh + key * kDim + 16 * ks + 2 * c) : 0u;
        const uint32_t b1 = key < k_len ? load_pair(kh + key * kDim + 16 * ks + 8 + 2 * c) : 0u;
        mma_m16n8k16<T>(s[n], qf[ks], b0, b1);
      }
    }
    float tile_max[2] = {-INFINITY, -INFINITY};
    for (int n = 0; n < kTiles8; ++n) {
      for (int e = 0; e < 4; ++e) {
        const int row = row0 + g + 8 * (e / 2), key = tile0 + 8 * n + 2 * c + e % 2;
        float x = s[n][e];
        if (prescaled) x *= c_log2;
        if (natural) x *= scale;
        s[n][e] = (key > k_len - q_len + row || key >= k_len) ? -INFINITY : x;
        tile_max[e / 2] = fmaxf(tile_max[e / 2], s[n][e]);
      }
    }
    float rescale[2], tile_sum[2] = {0.f, 0.f};
    for (int h = 0; h < 2; ++h) {
      const float m_new = fmaxf(row_max[h], quad(tile_max[h], kXor1Then2, true));
      const float shift = m_new == -INFINITY ? 0.f : m_new;
      rescale[h] = row_max[h] == -INFINITY ? 0.f : exponent(exp_form, row_max[h], shift, c_log2);
      row_max[h] = m_new;
      sum[h] *= rescale[h];
      tc_sum[2 * h] *= rescale[h];
      tc_sum[2 * h + 1] *= rescale[h];
      for (int dn = 0; dn < kDim / 8; ++dn) {
        acc[dn][2 * h] *= rescale[h];
        acc[dn][2 * h + 1] *= rescale[h];
      }
    }
    for (int n = 0; n < kTiles8; ++n) {
      for (int e = 0; e < 4; ++e) {
        const float m = row_max[e / 2];
        s[n][e] = s[n][e] == -INFINITY ? 0.f : exponent(exp_form, s[n][e], m == -INFINITY ? 0.f : m, c_log2);
      }
      for (int h = 0; h < 2; ++h) {
        float a = s[n][2 * h], b = s[n][2 * h + 1];
        if (sum_order == kSequentialRounded) {
          a = __bfloat162float(__float2bfloat16(a));
          b = __bfloat162float(__float2bfloat16(b));
        }
        float& into = running == 0 ? sum[h] : tile_sum[h];
        into = sum_order == kPairThenSequential ? into + (a + b) : (into + a) + b;
      }
    }
    if (running != 0) {
      for (int h = 0; h < 2; ++h) sum[h] += tile_sum[h];
    }
    for (int slice = 0; slice < kTile / 16; ++slice) {
      const uint32_t p[4] = {pack2<T>(s[2 * slice][0], s[2 * slice][1]), pack2<T>(s[2 * slice][2], s[2 * slice][3]),
                             pack2<T>(s[2 * slice + 1][0], s[2 * slice + 1][1]),
                             pack2<T>(s[2 * slice + 1][2], s[2 * slice + 1][3])};
      mma_m16n8k16<T>(tc_sum, p, ones, ones);
      for (int dn = 0; dn < kDim / 8; ++dn) {
        const int col = 8 * dn + g;
        auto value = [&](int key) { return key < k_len ? vh[key * kDim + col] : zero; };
        const int k0 = tile0 + 16 * slice + 2 * c;
        mma_m16n8k16<T>(acc[dn], p, join(value(k0), value(k0 + 1)), join(value(k0 + 8), value(k0 + 9)));
      }
    }
  }
  if (sum_order == kTensorCore) {
    sum[0] = tc_sum[0];  // every column of P x ones is the full row sum: no quad reduction
    sum[1] = tc_sum[2];
  } else {
    for (int h = 0; h < 2; ++h) sum[h] = quad(sum[h], quad_order, false);
  }

  for (int h = 0; h < 2; ++h) {
    const int row = row0 + g + 8 * h;
    if (row >= q_len) continue;
    const float l = sum[h];
    for (int dn = 0; dn < kDim / 8; ++dn) {
      float o[2];
      for (int i = 0; i < 2; ++i) {
        const float x = acc[dn][2 * h + i];
        switch (norm) {
          case kMulReciprocal: o[i] = x * (1.f / l); break;
          case kDivide: o[i] = x / l; break;
          case kMulApproxReciprocal: o[i] = x * rcp_approx(l); break;
          default: o[i] = __fdividef(x, l); break;
        }
      }
      T* dst = out + (static_cast<int64_t>(head) * q_len + row) * kDim + 8 * dn + 2 * c;
      dst[0] = __float2bfloat16(o[0]);
      dst[1] = __float2bfloat16(o[1]);
    }
  }
}

}  // namespace

// q, out: [heads, q_len, 64]; k, v: [heads, k_len, 64]; contiguous bf16 device pointers (ctypes entry point).
extern "C" int attention_variant(void* out, const void* q, const void* k, const void* v, int heads, int q_len,
                                 int k_len, float scale, int tile, int exp_form, int sum_order, int quad_order,
                                 int norm, int running, void* stream) {
  if (q_len > k_len || (tile != 64 && tile != 128)) return -1;
  const dim3 grid(heads, (q_len + 15) / 16);
  auto* kernel = tile == 64 ? attention_variant_kernel<64> : attention_variant_kernel<128>;
  kernel<<<grid, 32, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<T*>(out), static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), q_len, k_len,
      scale, exp_form, sum_order, quad_order, norm, running);
  return static_cast<int>(cudaGetLastError());
}

extern "C" int variant_counts(int* counts) {
  counts[0] = kNumExp;
  counts[1] = kNumSum;
  counts[2] = kNumQuad;
  counts[3] = kNumNorm;
  return 0;
}
