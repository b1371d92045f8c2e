"""The paged KV cache tensor: one allocation for the whole model, sized once, and its dtype.

Layout (cpp/ops/kv_cache_layout.h is the reference):
    [num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]
with keys at index 0 and values at 1 of the second dimension.

Dtype (EngineConfig.kv_cache_dtype, decided by kv_cache_dtype() and nowhere else):
  CUDA  the model's dtype; the kernels read the cache in the queries' dtype, so
        an explicit kv_cache_dtype must name it.
  CPU   "auto": bf16 where the model's arithmetic is already bf16-grade or coarser,
        that is where the resolved cpu_precision is "bfloat16", the model computes
        in bf16, or its linears keep their weights quantized (a GGUF file's blocks,
        quantization int8); the model's dtype otherwise, so the exact float32 mode
        stays exact (its outputs match transformers' float32 to 1e-4). A bf16 cache under a
        float32 model halves the bytes attention streams and the KV memory: keys
        and values are rounded to bf16 (nearest even) as they are written and
        widened back exactly as they are read; scores and sums stay float32.
        Measured on SmolLM2-135M (32 agreement prompts, 64 greedy tokens, float32
        model): 31/32 continuations identical with a bf16 and a float32 cache (the
        other diverges at token 62), sampled-token logprobs differ by 2.8e-3 on
        average (5.3e-2 at most); the first token matches transformers float32 on
        32/32 prompts either way (bench/perf/cpu_serving_bench.py --accuracy).
        With the default model's Q4_1 file, 32 prompts of 16 greedy tokens: 451 of
        512 tokens match transformers float32 with a float32 cache and 431 with a
        bf16 one (24 and 23 prompts identical; the exact mode: 512), so the 4-bit
        weights set most of the error, while the bf16 cache halves the KV memory
        (bench/results/cpu_serving_amd_zen5_accuracy.md).
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "bfloat16", "float32")
_BY_NAME = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, device_type: str,
                   cpu_precision: str = "float32", quantized_weights: bool = False) -> torch.dtype:
    """The KV cache's dtype for EngineConfig.kv_cache_dtype (see the module docstring).

    cpu_precision: EngineConfig.cpu_precision as resolved ("float32" or "bfloat16"; "auto" reads as float32).
    quantized_weights: the linear weights are kept quantized (GGUF blocks, quantization int8).
    """
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported; use one of {', '.join(KV_CACHE_DTYPES)}")
    if kv_cache_dtype == "auto":
        if device_type == "cpu" and (cpu_precision == "bfloat16" or model_dtype == torch.bfloat16 or quantized_weights):
            return torch.bfloat16
        return model_dtype
    wanted = _BY_NAME[kv_cache_dtype]
    model_name = str(model_dtype).removeprefix("torch.")
    if wanted == model_dtype:
        return wanted
    if device_type != "cpu":
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype} with a {model_name} model: on {device_type} the KV cache "
                         f"has the model's dtype; use kv_cache_dtype auto (or dtype {kv_cache_dtype})")
    if not (wanted == torch.bfloat16 and model_dtype == torch.float32):
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype} with a {model_name} model: on the CPU the KV cache has "
                         f"the model's dtype or, under a float32 model, bfloat16; use kv_cache_dtype auto")
    return wanted


def kv_cache_shape(num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int,
                   head_dim: int) -> tuple[int, ...]:
    return (num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim)


def bytes_per_block(num_layers: int, num_kv_heads: int, block_size: int, head_dim: int,
                    dtype: torch.dtype) -> int:
    """Over all layers, keys and values, in the cache's dtype."""
    element = torch.tensor([], dtype=dtype).element_size()
    return num_layers * 2 * num_kv_heads * block_size * head_dim * element


def allocate_kv_cache(num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Uninitialized on purpose: a slot is always written before any kernel reads it.
    return torch.empty(kv_cache_shape(num_layers, num_blocks, num_kv_heads, block_size, head_dim),
                       dtype=dtype, device=device)
