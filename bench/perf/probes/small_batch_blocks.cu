// Probe (session 24): does the block size of small_batch_linear's kernel, its unroll depth or a cache hint on
// the weight loads change a batch-1 decode step? TinyLlama-1.1B's products at M = 1, bf16, 22 layers of
// distinct weights (1.7 GB: every step streams them from HBM), captured in one CUDA graph with dependent
// launches (PDL) as the engine launches them. The kernel is small_batch_linear.cu's arithmetic (one warp
// per output column, 16-byte pieces per lane, the same order of sums) with the block size (warps), unroll
// and load flavour as template parameters. Two tables:
//   - products only: o, gate_up (gated), down per layer; and each product alone, 22 in a row;
//   - engine-like: norm, qkv, attention, o, norm, gate_up, down per layer, with stand-ins for the norm
//     (one CTA) and the attention (32 CTAs), the norm letting the next kernel launch before or after its wait.
// The engine itself did not follow the probe: bench/results/h200/session24.md has both.
//
//   nvcc -O3 -std=c++20 -arch=sm_90 -Icuda -o /tmp/probe bench/perf/probes/small_batch_blocks.cu
//   /tmp/probe            # weights filled with a constant
//   /tmp/probe random     # random bf16 weights (the figures did not move)
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "float_convert.cuh"
using namespace pagedserve::cuda;
using T = __nv_bfloat16;
#define CK(x)                                                \
  do {                                                       \
    cudaError_t e = (x);                                     \
    if (e != cudaSuccess) {                                  \
      printf("%s: %s\n", #x, cudaGetErrorString(e));         \
      exit(1);                                               \
    }                                                        \
  } while (0)

__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_go() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

template <int kHint>
__device__ __forceinline__ uint4 wload(const T* p) {
  if constexpr (kHint == 0) return *reinterpret_cast<const uint4*>(p);
  uint4 v;
  if constexpr (kHint == 1)
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
  else
  {
    uint64_t pol;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p), "l"(pol));
  }
  return v;
}
__device__ __forceinline__ void to_f(float (&w)[8], uint4 v) {
  const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
  for (int i = 0; i < 8; ++i) w[i] = __bfloat162float(e[i]);
}

template <int kUnroll, int kWarps, int kHint, bool kGated>
__global__ void __launch_bounds__(kWarps * 32) sbl(T* out, const T* x, const T* weight, int K, int N) {
  const int lane = threadIdx.x % 32;
  const int n = blockIdx.x * kWarps + threadIdx.x / 32;
  pdl_wait();
  pdl_go();
  if (n >= N) return;
  const T* row = weight + (int64_t)n * K;
  const T* row2 = row + (int64_t)N * K;
  float acc = 0.f, acc2 = 0.f;
#pragma unroll kUnroll
  for (int k0 = lane * 8; k0 < K; k0 += 256) {
    float w[8], xv[8];
    to_f(w, wload<kHint>(row + k0));
    to_f(xv, *reinterpret_cast<const uint4*>(x + k0));
#pragma unroll
    for (int e = 0; e < 8; ++e) acc = __fmaf_rn(w[e], xv[e], acc);
    if constexpr (kGated) {
      float w2[8];
      to_f(w2, wload<kHint>(row2 + k0));
#pragma unroll
      for (int e = 0; e < 8; ++e) acc2 = __fmaf_rn(w2[e], xv[e], acc2);
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) { acc += __shfl_xor_sync(~0u, acc, o); acc2 += __shfl_xor_sync(~0u, acc2, o); }
  if (lane == 0) {
    float v = acc;
    if constexpr (kGated) { float g = __bfloat162float(__float2bfloat16_rn(v)); v = g / (1.f + expf(-g)) * acc2; }
    out[n] = __float2bfloat16_rn(v);
  }
}

template <typename K, typename... A>
void launch(K kernel, int grid, int block, cudaStream_t s, A... a) {
  cudaLaunchConfig_t c = {};
  c.gridDim = grid; c.blockDim = block; c.stream = s;
  cudaLaunchAttribute at = {};
  at.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at.val.programmaticStreamSerializationAllowed = 1;
  c.attrs = &at; c.numAttrs = 1;
  CK(cudaLaunchKernelEx(&c, kernel, a...));
}

struct Layer { T *o, *gu, *down; };
__global__ void fill_random(T* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u ^ seed; h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
    p[i] = __float2bfloat16_rn(((h & 0xffff) / 65536.f - 0.5f) * 0.05f);
  }
}
static bool g_random = false;
static void fill(T* p, size_t n) {
  if (g_random) {
    fill_random<<<1024, 256>>>(p, n, (uint32_t)n ^ (uint32_t)(uintptr_t)p);
  } else {
    CK(cudaMemset(p, 0x3c, n * 2));
  }
}
constexpr int H = 2048, I = 5632, L = 22;


// Microseconds a replay of the CUDA graph that `enqueue` records on `s` takes (5 warm-up replays, then 50).
template <typename Enqueue>
float time_graph(cudaStream_t s, Enqueue&& enqueue) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  enqueue();
  CK(cudaStreamEndCapture(s, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  for (int i = 0; i < 5; ++i) CK(cudaGraphLaunch(ge, s));
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  const int reps = 50;
  CK(cudaEventRecord(a, s));
  for (int i = 0; i < reps; ++i) CK(cudaGraphLaunch(ge, s));
  CK(cudaEventRecord(b, s));
  CK(cudaEventSynchronize(b));
  float ms; cudaEventElapsedTime(&ms, a, b);
  cudaGraphExecDestroy(ge); cudaGraphDestroy(g);
  return ms / reps * 1000.f;
}

// A stand-in for rms_norm_torch_order_kernel at batch 1: one CTA of 128 threads over H values.
template <bool kEarly>
__global__ void __launch_bounds__(128) norm1(T* out, const T* x, const T* w, int H) {
  if constexpr (kEarly) pdl_go();
  pdl_wait();
  if constexpr (!kEarly) pdl_go();
  __shared__ float part[4];
  float ss = 0.f;
  for (int i = threadIdx.x; i < H; i += 128) { float v = __bfloat162float(x[i]); ss += v * v; }
  for (int o = 16; o > 0; o /= 2) ss += __shfl_xor_sync(~0u, ss, o);
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = ss;
  __syncthreads();
  const float r = rsqrtf((part[0] + part[1] + part[2] + part[3]) / H + 1e-5f);
  for (int i = threadIdx.x; i < H; i += 128) {
    out[i] = __float2bfloat16_rn(__bfloat162float(x[i]) * r * __bfloat162float(w[i]));
  }
}
// A stand-in for decode attention at a short context: 32 CTAs, each a few dependent loads.
__global__ void __launch_bounds__(128) attn1(T* out, const T* q, const T* kv, int ctx) {
  pdl_wait();
  pdl_go();
  float acc = 0.f;
  for (int t = threadIdx.x; t < ctx * 64; t += 128) acc += __bfloat162float(kv[blockIdx.x * ctx * 64 + t]) * __bfloat162float(q[blockIdx.x * 64 + t % 64]);
  for (int o = 16; o > 0; o /= 2) acc += __shfl_xor_sync(~0u, acc, o);
  if (threadIdx.x < 64 && threadIdx.x % 32 == 0) out[blockIdx.x * 64 + threadIdx.x] = __float2bfloat16_rn(acc);
  else if (threadIdx.x < 64) out[blockIdx.x * 64 + threadIdx.x] = __float2bfloat16_rn(0.f);
}
struct Full { T *qkv, *o, *gu, *down, *nw; };
template <int kU, int kW, bool kEarly>
float run_engine_like(std::vector<Full>& layers, T* h, T* xn, T* q, T* ao, T* xi, T* kv, cudaStream_t s) {
  return time_graph(s, [&] {
    for (auto& l : layers) {
      launch(norm1<kEarly>, 1, 128, s, xn, (const T*)h, (const T*)l.nw, H);
      launch(sbl<kU, kW, 0, false>, (2560 + kW - 1) / kW, kW * 32, s, q, (const T*)xn, (const T*)l.qkv, H, 2560);
      launch(attn1, 32, 128, s, ao, (const T*)q, (const T*)kv, 100);
      launch(sbl<kU, kW, 0, false>, (H + kW - 1) / kW, kW * 32, s, h, (const T*)ao, (const T*)l.o, H, H);
      launch(norm1<kEarly>, 1, 128, s, xn, (const T*)h, (const T*)l.nw, H);
      launch(sbl<kU, kW, 0, true>, (I + kW - 1) / kW, kW * 32, s, xi, (const T*)xn, (const T*)l.gu, H, I);
      launch(sbl<kU, kW, 0, false>, (H + kW - 1) / kW, kW * 32, s, h, (const T*)xi, (const T*)l.down, I, H);
    }
  });
}

// which: 0 all three products of each layer, 1 o only, 2 gate_up only, 3 down only. Microseconds a step.
template <int kU, int kW, int kH>
float run_step(std::vector<Layer>& layers, T* xa, T* xb, T* xi, cudaStream_t s, int which) {
  return time_graph(s, [&] {
    for (auto& l : layers) {
      const int g = (I + kW - 1) / kW, n = (H + kW - 1) / kW;
      if (which == 0 || which == 1) launch(sbl<kU, kW, kH, false>, n, kW * 32, s, xb, xa, (const T*)l.o, H, H);
      if (which == 0 || which == 2) launch(sbl<kU, kW, kH, true>, g, kW * 32, s, xi, xb, (const T*)l.gu, H, I);
      if (which == 0 || which == 3) launch(sbl<kU, kW, kH, false>, n, kW * 32, s, xa, xi, (const T*)l.down, I, H);
    }
  });
}

template <int kU, int kW, int kH>
void variant(const char* name, std::vector<Layer>& layers, T* xa, T* xb, T* xi, cudaStream_t s) {
  float all = run_step<kU, kW, kH>(layers, xa, xb, xi, s, 0);
  float o = run_step<kU, kW, kH>(layers, xa, xb, xi, s, 1);
  float gu = run_step<kU, kW, kH>(layers, xa, xb, xi, s, 2);
  float d = run_step<kU, kW, kH>(layers, xa, xb, xi, s, 3);
  printf("| %-28s | %8.1f | %6.2f | %6.2f | %6.2f |\n", name, all, o / L, gu / L, d / L);
}

int main(int argc, char** argv) {
  g_random = argc > 1;
  cudaStream_t s; CK(cudaStreamCreate(&s));
  std::vector<Layer> layers(L);
  for (auto& l : layers) {
    CK(cudaMalloc(&l.o, (size_t)H * H * 2)); CK(cudaMalloc(&l.gu, (size_t)2 * I * H * 2)); CK(cudaMalloc(&l.down, (size_t)H * I * 2));
    fill(l.o, (size_t)H * H); fill(l.gu, (size_t)2 * I * H); fill(l.down, (size_t)H * I);
  }
  T *xa, *xb, *xi;
  CK(cudaMalloc(&xa, H * 2)); CK(cudaMalloc(&xb, H * 2)); CK(cudaMalloc(&xi, I * 2));
  fill(xa, H); fill(xb, H); fill(xi, I); CK(cudaDeviceSynchronize());
  printf("weights: %s\n", g_random ? "random" : "constant 0x3c3c");
  double bytes = (double)L * ((double)H * H + 2.0 * I * H + (double)H * I) * 2;
  printf("weights of the products: %.0f MB per step\n", bytes / 1e6);
  std::vector<Full> full(L);
  for (auto& l : full) {
    CK(cudaMalloc(&l.qkv, (size_t)2560 * H * 2)); CK(cudaMalloc(&l.o, (size_t)H * H * 2));
    CK(cudaMalloc(&l.gu, (size_t)2 * I * H * 2)); CK(cudaMalloc(&l.down, (size_t)H * I * 2)); CK(cudaMalloc(&l.nw, H * 2));
    fill(l.qkv, (size_t)2560 * H); fill(l.o, (size_t)H * H); fill(l.gu, (size_t)2 * I * H); fill(l.down, (size_t)H * I); fill(l.nw, H);
  }
  T *h, *xn, *q, *ao, *kv;
  CK(cudaMalloc(&h, H * 2)); CK(cudaMalloc(&xn, H * 2)); CK(cudaMalloc(&q, 2560 * 2)); CK(cudaMalloc(&ao, H * 2));
  CK(cudaMalloc(&kv, (size_t)32 * 100 * 64 * 2)); fill(h, H); fill(xn, H); fill(q, 2560); fill(ao, H); fill(kv, (size_t)32 * 100 * 64);
  CK(cudaDeviceSynchronize());
  printf("| engine-like layer x22 (norm, qkv, attn, o, norm, gate_up, down) | us per step |\n|---|---|\n");
  for (int round = 0; round < 2; ++round) {
    printf("| w4 unroll8, norm triggers after wait (main) | %.1f |\n", run_engine_like<8, 4, false>(full, h, xn, q, ao, xi, kv, s));
    printf("| w1 unroll8, norm after wait | %.1f |\n", run_engine_like<8, 1, false>(full, h, xn, q, ao, xi, kv, s));
    printf("| w1 unroll4, norm after wait | %.1f |\n", run_engine_like<4, 1, false>(full, h, xn, q, ao, xi, kv, s));
    printf("| w4 unroll8, norm triggers before wait | %.1f |\n", run_engine_like<8, 4, true>(full, h, xn, q, ao, xi, kv, s));
    printf("| w1 unroll8, norm before wait | %.1f |\n", run_engine_like<8, 1, true>(full, h, xn, q, ao, xi, kv, s));
    printf("| w1 unroll4, norm before wait | %.1f |\n", run_engine_like<4, 1, true>(full, h, xn, q, ao, xi, kv, s));
    printf("| w2 unroll4, norm before wait | %.1f |\n", run_engine_like<4, 2, true>(full, h, xn, q, ao, xi, kv, s));
    printf("| w2 unroll4, norm after wait | %.1f |\n", run_engine_like<4, 2, false>(full, h, xn, q, ao, xi, kv, s));
  }
  printf("\n| variant | step us (o+gu+down x22) | o us | gate_up us | down us |\n|---|---|---|---|---|\n");
  for (int round = 0; round < 2; ++round) {
    variant<8, 4, 0>("unroll8 w4 plain (main)", layers, xa, xb, xi, s);
    variant<8, 2, 0>("unroll8 w2 plain", layers, xa, xb, xi, s);
    variant<8, 1, 0>("unroll8 w1 plain", layers, xa, xb, xi, s);
    variant<4, 1, 0>("unroll4 w1 plain", layers, xa, xb, xi, s);
    variant<2, 1, 0>("unroll2 w1 plain", layers, xa, xb, xi, s);
    variant<16, 1, 0>("unroll16 w1 plain", layers, xa, xb, xi, s);
    variant<4, 4, 0>("unroll4 w4 plain", layers, xa, xb, xi, s);
    variant<8, 8, 0>("unroll8 w8 plain", layers, xa, xb, xi, s);
    variant<8, 4, 1>("unroll8 w4 no_allocate", layers, xa, xb, xi, s);
    variant<8, 4, 2>("unroll8 w4 evict_first", layers, xa, xb, xi, s);
  }
  printf("floor at 4.1 TB/s copy: %.1f us\n", bytes / 4.1e12 * 1e6);
  return 0;
}
