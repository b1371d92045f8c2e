// The layout grouped_linear (ops.h, cuda/cuda_ops.h) reads: the expert
// products of a mixture-of-experts layer as one call.
//
// Routing picks top_k experts per token, so a step of T tokens makes
// R = T * top_k (token, expert) rows. The caller sorts those rows by expert
// (a stable argsort of the expert ids) and gathers x in that order:
//
//     x:              [R, K]     rows of expert 0, then expert 1, ...
//     expert_offsets: [E + 1]    int32, expert e owns rows [offsets[e], offsets[e + 1])
//                                (offsets = cumsum of the per-expert counts, offsets[0] = 0)
//     weight:         [E, N, K]  weight[e] is expert e's nn.Linear weight W_e [N, K]
//     out:            [R, N]     out[r] = x[r] W_e^T for r in expert e's rows
//
// i.e. the weights as checkpoints store them (Mixtral / Qwen-MoE w1 / w3 as
// [E, I, H], w2 as [E, H, I]; vLLM's fused [E, 2I, H] gate_up), so no copy or
// transpose at load time. Experts with no rows cost nothing; rows outside
// [offsets[0], offsets[E]) (padding of a captured CUDA graph) are not written.
// The caller scatters out back to its tokens and applies the routing weights.
//
// Kernels: the CPU converts one tile of 16 weight rows at a time to float32
// and runs a chunk of the expert's rows against it; the CUDA kernel
// (cuda/grouped_linear.cu) runs 64 x 64 output tiles on tensor cores, each CTA
// finding its expert and row tile from the offsets in device memory, so the
// launch needs no host copy of the routing.
#pragma once

#include <cstdint>

namespace pagedserve::ops {

// Output columns per CPU work item, rows per CPU work item.
inline constexpr int64_t kGroupedCols = 16;
inline constexpr int64_t kGroupedRows = 64;

}  // namespace pagedserve::ops
