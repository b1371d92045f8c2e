// Probe (session 32): which CTA shape of the prefill attention kernel (cuda/prefill_attention.cuh) is
// fastest? One causal prompt, 32 query / 8 kv heads, head dim 128, bf16, block size 16, the blocks in a
// shuffled order (as a pool hands them out). Each binary holds the default shape and one candidate
// (compiled with -DWARPS= -DKEYS= -DSTAGES= -DCTAS=, the CTAs per SM) and times them alternately, so both see the same
// clocks; it prints the candidate's largest difference from the default's output too (0 where the key
// tile is the same: the shape moves no rounding point then).
//
//   nvcc -O3 -std=c++20 -arch=sm_90 -Icuda -DWARPS=8 -DKEYS=64 -DSTAGES=2 -DCTAS=1 \
//       -o /tmp/p bench/perf/probes/prefill_tiles.cu
//   /tmp/p 1024 2048 4096          # prompt lengths
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#include "prefill_attention.cuh"

using namespace pagedserve::cuda;
using T = __nv_bfloat16;

#ifndef WARPS  // nvcc splits -D values at commas, hence four macros
#define WARPS 4
#define KEYS 64
#define STAGES 2
#define CTAS 2
#endif
using Candidate = prefill::CtaShape<WARPS, KEYS, STAGES, CTAS>;
using Default = prefill::DefaultShape<128>;

constexpr int kHeads = 32, kKvHeads = 8, kHeadDim = 128, kBlock = 16;

template <typename U>
U* device_copy(const std::vector<U>& host) {
  U* ptr = nullptr;
  check_cuda(cudaMalloc(&ptr, host.size() * sizeof(U)), "cudaMalloc");
  check_cuda(cudaMemcpy(ptr, host.data(), host.size() * sizeof(U), cudaMemcpyHostToDevice), "cudaMemcpy");
  return ptr;
}

std::vector<T> random_values(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<T> v(n);
  for (auto& x : v) x = __float2bfloat16(normal(rng));
  return v;
}

template <typename Shape>
float time_ms(const PagedAttentionParams& p, int repeats) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  cudaEventRecord(start);
  for (int i = 0; i < repeats; ++i) launch_prefill_attention_shaped<T, kHeadDim, kBlock, Shape>(p, nullptr);
  cudaEventRecord(stop);
  check_cuda(cudaEventSynchronize(stop), "kernel");
  float ms = 0.f;
  cudaEventElapsedTime(&ms, start, stop);
  return ms / repeats;
}

int main(int argc, char** argv) {
  std::vector<int> lengths;
  for (int i = 1; i < argc; ++i) lengths.push_back(std::atoi(argv[i]));
  if (lengths.empty()) lengths = {1024, 2048, 4096};
  std::mt19937 rng(0);
  for (const int n : lengths) {
    const int blocks = (n + kBlock - 1) / kBlock;
    std::vector<int32_t> table(blocks);
    std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), rng);
    const size_t cache_elems = static_cast<size_t>(blocks) * kKvHeads * kBlock * kHeadDim;
    const size_t q_elems = static_cast<size_t>(n) * kHeads * kHeadDim;
    T* query = device_copy(random_values(q_elems, rng));
    T* keys = device_copy(random_values(cache_elems, rng));
    T* values = device_copy(random_values(cache_elems, rng));
    int32_t* block_table = device_copy(table);
    int32_t* starts = device_copy(std::vector<int32_t>{0, n});
    int32_t* lens = device_copy(std::vector<int32_t>{n});
    T *out_default = nullptr, *out_candidate = nullptr;
    cudaMalloc(&out_default, q_elems * sizeof(T));
    cudaMalloc(&out_candidate, q_elems * sizeof(T));

    PagedAttentionParams p{.out = nullptr, .query = query, .key_cache = keys, .value_cache = values,
                           .block_tables = block_table, .query_start_loc = starts, .seq_lens = lens,
                           .scale = 1.f / std::sqrt(static_cast<float>(kHeadDim)), .num_seqs = 1, .num_tokens = n,
                           .num_heads = kHeads, .num_kv_heads = kKvHeads, .max_blocks_per_seq = blocks,
                           .max_query_len = n, .max_seq_len = n, .num_decodes = 0, .window_span = 1 << 30,
                           .softcap = 0.f, .fixed_split = false};

    p.out = out_default;
    launch_prefill_attention_shaped<T, kHeadDim, kBlock, Default>(p, nullptr);
    p.out = out_candidate;
    launch_prefill_attention_shaped<T, kHeadDim, kBlock, Candidate>(p, nullptr);
    check_cuda(cudaDeviceSynchronize(), "first runs");
    std::vector<T> a(q_elems), b(q_elems);
    cudaMemcpy(a.data(), out_default, q_elems * sizeof(T), cudaMemcpyDeviceToHost);
    cudaMemcpy(b.data(), out_candidate, q_elems * sizeof(T), cudaMemcpyDeviceToHost);
    float max_diff = 0.f;
    double checksum = 0.0;  // the candidate's outputs, weighted by position: equal across builds = equal outputs
    for (size_t i = 0; i < q_elems; ++i) {
      max_diff = std::max(max_diff, std::fabs(__bfloat162float(a[i]) - __bfloat162float(b[i])));
      checksum += static_cast<double>(__bfloat162float(b[i])) * static_cast<double>(i % 7 + 1);
    }

    const int repeats = n >= 4096 ? 20 : 50;
    std::vector<float> t_default, t_candidate;
    for (int round = 0; round < 5; ++round) {  // alternated, so both see the same clocks
      p.out = out_default;
      t_default.push_back(time_ms<Default>(p, repeats));
      p.out = out_candidate;
      t_candidate.push_back(time_ms<Candidate>(p, repeats));
    }
    std::sort(t_default.begin(), t_default.end());
    std::sort(t_candidate.begin(), t_candidate.end());
    const double flop = 4.0 * n * n / 2 * kHeadDim * kHeads;
    const float md = t_default[2], mc = t_candidate[2];
    std::printf("shape %d,%d,%d,%d tokens %d smem %d KB | default %.4f ms %.0f TFLOP/s | candidate %.4f ms %.0f TFLOP/s"
                " | ratio %.3f | max diff %.3g | checksum %.6f\n",
                Candidate::kWarps, Candidate::kKeys, Candidate::kStages, Candidate::kCtasPerSm, n,
                prefill::SharedLayout<T, kHeadDim, Candidate>::kBytes / 1024, md, flop / md / 1e9, mc,
                flop / mc / 1e9, md / mc, max_diff, checksum);
    for (void* ptr : {static_cast<void*>(query), static_cast<void*>(keys), static_cast<void*>(values),
                      static_cast<void*>(block_table), static_cast<void*>(starts), static_cast<void*>(lens),
                      static_cast<void*>(out_default), static_cast<void*>(out_candidate)}) {
      cudaFree(ptr);
    }
  }
  return 0;
}
