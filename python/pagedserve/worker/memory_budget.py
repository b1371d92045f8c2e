"""Sizing the KV cache on a GPU from a memory budget, as vLLM does.

The engine may use `gpu_memory_utilization` of the card. Whatever the weights,
the worst-case step's activations (profiled by running it) and memory outside
torch's allocator (CUDA context, library workspaces) leave of that goes to the
KV cache, allocated once: peak memory then does not grow with concurrency.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable

import torch

logger = logging.getLogger("pagedserve")

# CUDA graphs' private pool and the sampler's scratch beyond the profiled step.
GRAPH_RESERVE_BYTES = 512 << 20


def kv_cache_budget_bytes(run_worst_case_step: Callable[[], None], gpu_memory_utilization: float,
                          device: torch.device, baseline_bytes: int = 0) -> int:
    """baseline_bytes: what torch held before this engine loaded its weights
    (another engine in the process, say), which is not this engine's."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    allocated = torch.cuda.memory_allocated(device)
    resident = allocated - baseline_bytes  # this engine's weights and long-lived tensors
    run_worst_case_step()
    torch.cuda.synchronize(device)
    activations = torch.cuda.max_memory_allocated(device) - allocated
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = max(0, total - free - torch.cuda.memory_reserved(device))
    budget = int(total * gpu_memory_utilization) - resident - activations - outside_torch - GRAPH_RESERVE_BYTES
    # Never more than is actually free (other engines or processes on the card).
    budget = min(budget, free - activations - GRAPH_RESERVE_BYTES)
    logger.info("GPU memory: %.2f GiB total, weights %.2f GiB, peak activations %.2f GiB, outside torch %.2f GiB "
                "-> KV cache %.2f GiB", total / 2**30, resident / 2**30, activations / 2**30,
                outside_torch / 2**30, budget / 2**30)
    if budget <= 0:
        raise ValueError(f"no GPU memory left for the KV cache at gpu_memory_utilization={gpu_memory_utilization}: "
                         "raise it, or lower max_num_batched_tokens / max_num_seqs")
    return budget


@dataclass(frozen=True)
class KVPlan:
    """The KV cache the worker allocates, and the context limit it can hold; the engine sizes
    its scheduler from it."""

    num_blocks: int
    block_size: int
    max_model_len: int
    bytes_per_block: int  # over all layers, keys and values, in `dtype`
    dtype: torch.dtype = torch.float32  # the cache's (worker/kv_cache.py: kv_cache_dtype)

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def plan_kv_cache(config, max_position_embeddings: int, bytes_per_block: int,
                  profile_budget: Callable[[], int], kv_window: int = 0,
                  dtype: torch.dtype = torch.float32) -> KVPlan:
    """How many blocks to allocate and the max_model_len they allow.

    config: a resolved EngineConfig. profile_budget() is called only on a GPU without an explicit size:
    it returns the bytes gpu_memory_utilization leaves for the cache (kv_cache_budget_bytes). kv_window:
    every layer slides over this many positions (ModelConfig.kv_window), so a sequence holds at most the
    blocks of its window (the scheduler frees the rest) and max_model_len is not bounded by the pool.
    """
    block_size, max_model_len = config.block_size, config.max_model_len
    blocks_per_seq = math.ceil(max_model_len / block_size)
    if kv_window:
        blocks_per_seq = min(blocks_per_seq, math.ceil((kv_window - 1) / block_size) + 1)
    if config.num_kv_blocks:
        num_blocks = config.num_kv_blocks
    elif config.kv_cache_memory_gb is not None:
        # No point holding more than every sequence at full length needs.
        num_blocks = min(int(config.kv_cache_memory_gb * 2**30 // bytes_per_block), config.max_num_seqs * blocks_per_seq)
    else:
        num_blocks = int(profile_budget() // bytes_per_block)  # a GPU keeps every spare block for the prefix cache
    num_blocks = max(1, num_blocks)
    capacity = num_blocks * block_size
    if blocks_per_seq * block_size > capacity:
        if max_model_len == max_position_embeddings:  # the model's own limit: serve what fits
            logger.warning("lowering max_model_len from %d to %d to fit the KV cache", max_model_len, capacity)
            max_model_len = capacity
        else:  # a limit the user asked for
            raise ValueError(f"max_model_len={max_model_len} needs {blocks_per_seq} KV blocks, the cache holds "
                             f"{num_blocks}: raise the KV memory or lower max_model_len")
    return KVPlan(num_blocks, block_size, max_model_len, bytes_per_block, dtype)
