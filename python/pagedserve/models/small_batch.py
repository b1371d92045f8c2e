"""A decode step's products of a row or two on a GPU: when ops.small_batch_linear (and the kernels built on
its loop, ops.qkv_linear_rope_cache) serve x W^T instead of cuBLAS."""

from __future__ import annotations

from typing import Optional

import torch

from pagedserve import ops

# Rows up to which ops.small_batch_linear beats cuBLAS (bench/perf/small_batch_linear_bench.py, H200, bf16,
# TinyLlama / Llama-3-8B projections per layer: 1 row 31.9 vs 39.1 / 115.6 vs 120.6 us, 2 rows 38.2 vs 39.3 /
# 127.1 vs 124.4, 4 rows 47.5 vs 39.4 / 171.3 vs 121.8). The kernel serves up to ops.MAX_SMALL_BATCH_ROWS.
SMALL_BATCH_FASTER_ROWS = 2


def small_batch_applies(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor]) -> bool:
    """Whether x W^T goes through the small-batch kernels (small_batch_product, qkv_linear_rope_cache)."""
    return not (weight is None or not x.is_cuda or not 1 <= x.shape[0] <= SMALL_BATCH_FASTER_ROWS
                or x.shape[1] < 2048 or weight.dtype not in (torch.bfloat16, torch.float16) or x.dtype != weight.dtype
                or not x.is_contiguous() or x.shape[1] % 8 or (bias is not None and bias.dtype != x.dtype))


def small_batch_product(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                        gated: bool = False) -> Optional[torch.Tensor]:
    """x W^T (+ bias) through ops.small_batch_linear when it applies (a CUDA decode step of at most
    SMALL_BATCH_FASTER_ROWS rows, 16-bit weights), else None. One memory-bound launch instead of cuBLAS's
    45-70 % of the copy bandwidth at M = 1 (bench/perf/decode_kernels.py); gated: W = [gate; up], the result
    silu(gate) * up. The shapes are the same at every replay of a captured CUDA graph, so the choice is made
    once per graph. Only for K >= 2048 (eight 16-byte pieces per lane, the unrolled loop full): a shorter row
    gives each lane too few loads to cover the memory latency (SmolLM2, K = 576 and 1536, ran slower than with
    cuBLAS: 681 vs 781 tok/s single-stream on an H200)."""
    if not small_batch_applies(x, weight, bias):
        return None
    out = torch.empty(x.shape[0], weight.shape[0] // 2 if gated else weight.shape[0], dtype=x.dtype, device=x.device)
    ops.small_batch_linear(out, x, weight, bias, gated)
    return out
