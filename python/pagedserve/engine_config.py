"""EngineConfig: every knob of the engine, with the defaults vLLM users expect,
and the command-line flags that set them (shared by generate, chat and serve)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Optional


@dataclass
class EngineConfig:
    model: Optional[str] = None  # a local HF-format directory; None = the default model
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32
    device: Optional[str] = None  # cuda | cpu; None = cuda when available
    load_format: str = "auto"  # auto | safetensors | dummy
    seed: int = 0
    max_model_len: Optional[int] = None  # None = the model's max_position_embeddings (capped by the KV pool)
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_num_seqs: Optional[int] = None  # None = 256 on CUDA, 64 on CPU
    max_num_batched_tokens: Optional[int] = None  # None = max(8192, max_num_seqs) on CUDA, 2048 on CPU
    gpu_memory_utilization: float = 0.9  # fraction of the card the engine may use (weights + activations + KV)
    kv_cache_memory_gb: Optional[float] = None  # CPU KV budget; None = 1 GiB (CPU) or from the card (CUDA)
    num_kv_blocks: Optional[int] = None  # force the pool size (tests, preemption demos)
    enforce_eager: bool = False  # CUDA: no CUDA graphs
    cpu_weight_dtype: str = "auto"  # CPU float32 models: auto (bf16 tiles when lossless) | bfloat16 | float32
    max_logprobs: int = 20
    max_num_waiting: int = 4096  # server: the queue length at which new requests are refused

    def with_updates(self, **kw) -> "EngineConfig":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        unknown = set(kw) - set(values)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
        values.update(kw)
        return EngineConfig(**values)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="local HF-format model directory (default: SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    g.add_argument("--device", default=None, choices=["cuda", "cpu"], help="default: cuda when available")
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"],
                   help="dummy = random weights for the model's config (benchmarking)")
    g.add_argument("--seed", type=int, default=0, help="random seed (sampling is reproducible for a given seed)")
    g.add_argument("--max-model-len", type=int, default=None, help="context limit (prompt + output tokens)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="turn automatic prefix caching off")
    g.add_argument("--max-num-seqs", type=int, default=None, help="most sequences in one batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget per step")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--kv-cache-memory-gb", type=float, default=None, help="KV cache size on CPU")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="force the number of KV blocks")
    g.add_argument("--enforce-eager", action="store_true", help="CUDA: do not capture CUDA graphs")
    g.add_argument("--cpu-weight-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="CPU, float32 models: store linear weights as bf16 tiles (auto: when that is lossless, "
                        "as for a bf16 checkpoint; bfloat16: always, rounding; float32: never)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = {f.name for f in fields(EngineConfig)}
    return EngineConfig(**{k: v for k, v in vars(args).items() if k in names})
