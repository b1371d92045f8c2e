"""ModelConfig: the few numbers the engine needs from a Hugging Face checkpoint.

Parsed once from ``config.json`` (+ ``generation_config.json``) into a frozen
dataclass, validated up front so an unsupported checkpoint fails here with a
clear message instead of producing wrong tokens later. Both the transformers 4
spelling of rope settings (``rope_theta`` + ``rope_scaling``) and the
transformers 5 one (``rope_parameters``, which 5.23 writes) are understood.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch

from pagedserve.models import config_fields as fields
from pagedserve.models.config_fields import DTYPES_BY_NAME, GENERATION_SAMPLING_KEYS
from pagedserve.models.moe_config import MoeConfig, parse_moe
from pagedserve.models.families import FULL, SLIDING, SUPPORTED_ARCHITECTURES, ArchitectureTraits, layer_types
from pagedserve.models.rope_config import parse_rope, parse_sliding_rope, partial_rotary_factor

DTypeLike = Union[str, torch.dtype]
DeviceLike = Union[str, torch.device, None]


_ENGINE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# On a CPU "auto" means float32, decided by bench/perf/cpu_dtype_bench.py on the 2-core
# AMX/avx512_bf16 dev machine (bench/results/cpu_dtype.md): bf16 is 1.2-1.45x faster for
# a 512-token prefill and a 16-sequence decode step, no faster for a single decode, and
# not equally correct (logits drift ~1e-2 relative; ~2% of greedy tokens flip on natural text).
_CPU_AUTO_DTYPE = torch.float32


@dataclass(frozen=True)
class ModelConfig:
    model_dir: Optional[Path]
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float  # the norms' epsilon (Phi-2's LayerNorm: layer_norm_eps)
    rope_theta: float
    # The (full attention layers') rope scaling as transformers' rope_parameters hold it, less rope_theta:
    # rope_type (linear, dynamic, yarn, longrope, llama3) and its parameters; None for plain rope.
    rope_scaling: Optional[dict[str, Any]]
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # q/k/v projections carry a bias
    o_bias: bool  # the attention output projection carries a bias
    mlp_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: Optional[int]
    checkpoint_dtype: torch.dtype
    dtype: torch.dtype  # the dtype the engine computes in
    device: torch.device
    # Sampling settings generation_config.json sets (a subset of GENERATION_SAMPLING_KEYS), as vLLM reads them.
    generation_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # Per-family numbers (defaults: plain Llama). The network's shape choices live in the family modules.
    hidden_act: str = "silu"
    partial_rotary_factor: float = 1.0  # Phi-4-mini: rope rotates only the first rotary_dim of each head
    layer_types: tuple[str, ...] = ()  # per layer FULL or SLIDING; () = all full
    sliding_window: int = 0  # window of the SLIDING layers (0: none shorter than the context)
    # Gemma 3: the sliding layers' own (theta, scaling); None = they use rope_theta/rope_scaling too.
    sliding_rope: Optional[tuple[float, Optional[dict[str, Any]]]] = None
    rope_layers: tuple[bool, ...] = ()  # SmolLM3: False for layers without rope; () = all rope
    attention_scale: Optional[float] = None  # softmax scale; None = head_dim ** -0.5
    attn_logit_softcap: float = 0.0  # Gemma 2: cap * tanh(score / cap); 0 = off
    final_logit_softcap: float = 0.0
    embedding_multiplier: float = 1.0  # Granite (Gemma's sqrt(hidden) is the family's own)
    residual_multiplier: float = 1.0  # Granite: residual + sublayer(x) * multiplier
    logits_scaling: float = 1.0  # Granite: logits / logits_scaling
    moe: Optional[MoeConfig] = None  # Mixture-of-Experts settings (Mixtral, Qwen2/3-MoE); None: dense

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_type(self, index: int) -> str:
        return self.layer_types[index] if self.layer_types else FULL

    @property
    def kv_window(self) -> int:
        """The window every layer slides over, so KV blocks behind it can be freed (Mistral, Phi-3 with
        sliding_window); 0 when any layer attends the whole context (Gemma 2/3 keep every block)."""
        windows = {self.layer_window(i) for i in range(self.num_layers)}
        return windows.pop() if len(windows) == 1 else 0

    def layer_window(self, index: int) -> int:
        """The attention window of layer ``index`` (0: full causal attention)."""
        return self.sliding_window if self.layer_type(index) == SLIDING else 0

    def layer_uses_rope(self, index: int) -> bool:
        return self.rope_layers[index] if self.rope_layers else True

    def prefix_cache_salt(self, prompt_len: int) -> int:
        """The prefix cache's salt for a prompt (cpp/block_hash.h): longrope rotates a prompt longer than
        original_max_position_embeddings with its long factors and a shorter one with its short factors
        (layers.RotaryEmbedding), so equal tokens on either side of that length must not share KV."""
        scaling = self.rope_scaling
        if scaling is None or scaling.get("rope_type") != "longrope":
            return 0
        return int(prompt_len > scaling["original_max_position_embeddings"])

    @classmethod
    def from_model_dir(cls, model_dir: Union[str, Path], dtype: DTypeLike = "auto",
                       device: DeviceLike = None) -> "ModelConfig":
        """Reads ``config.json`` (and ``generation_config.json`` when present) from a HF model directory."""
        model_dir = Path(model_dir)
        config_path = model_dir / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"model_dir {str(model_dir)!r} has no config.json")
        hf_config = json.loads(config_path.read_text())
        generation_path = model_dir / "generation_config.json"
        generation = json.loads(generation_path.read_text()) if generation_path.is_file() else {}
        return cls.from_hf_config(hf_config, dtype=dtype, device=device, generation_config=generation,
                                  model_dir=model_dir)

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any], dtype: DTypeLike = "auto", device: DeviceLike = None,
                       generation_config: Optional[Mapping[str, Any]] = None,
                       model_dir: Optional[Path] = None) -> "ModelConfig":
        """Parses an already loaded ``config.json`` dict (``model_dir`` only helps resolve tied embeddings)."""
        architecture = fields.architecture(hf_config)
        traits = SUPPORTED_ARCHITECTURES[architecture]
        num_heads = fields.required_int(hf_config, "num_attention_heads")
        num_kv_heads = int(hf_config.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of "
                             f"num_key_value_heads ({num_kv_heads})")
        hidden_size = fields.required_int(hf_config, "hidden_size")
        head_dim = int(hf_config.get("head_dim") or hidden_size // num_heads)
        num_layers = fields.required_int(hf_config, "num_hidden_layers")
        max_positions = fields.required_int(hf_config, "max_position_embeddings")
        rope_theta, rope_scaling = parse_rope(hf_config, max_positions)
        qkv_bias, o_bias = fields.attention_biases(hf_config, traits)
        kinds = layer_types(hf_config, traits, num_layers)
        checkpoint_dtype = fields.checkpoint_dtype(hf_config)
        resolved_device = resolve_device(device)
        generation_config = generation_config or {}
        return cls(
            model_dir=model_dir,
            architecture=architecture,
            vocab_size=fields.required_int(hf_config, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=fields.required_int(hf_config, "intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf_config.get("rms_norm_eps") or hf_config.get("layer_norm_eps") or 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=fields.tie_word_embeddings(hf_config, model_dir),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(traits.mlp_bias_key and hf_config.get(traits.mlp_bias_key, False)),
            qk_norm=traits.qk_norm,
            eos_token_ids=fields.eos_token_ids(hf_config, generation_config),
            bos_token_id=fields.bos_token_id(hf_config, generation_config),
            checkpoint_dtype=checkpoint_dtype,
            dtype=resolve_dtype(dtype, checkpoint_dtype, resolved_device),
            device=resolved_device,
            generation_defaults=fields.generation_defaults(generation_config),
            hidden_act=fields.activation(hf_config, architecture, traits),
            partial_rotary_factor=partial_rotary_factor(hf_config),
            layer_types=kinds,
            sliding_window=fields.sliding_window(hf_config, kinds, max_positions),
            sliding_rope=parse_sliding_rope(hf_config, max_positions),
            rope_layers=fields.rope_layers(hf_config, num_layers),
            attention_scale=_attention_scale(hf_config),
            attn_logit_softcap=fields.optional_float(hf_config, "attn_logit_softcapping", 0.0),
            final_logit_softcap=fields.optional_float(hf_config, "final_logit_softcapping", 0.0),
            embedding_multiplier=fields.optional_float(hf_config, "embedding_multiplier", 1.0),
            residual_multiplier=fields.optional_float(hf_config, "residual_multiplier", 1.0),
            logits_scaling=fields.optional_float(hf_config, "logits_scaling", 1.0),
            moe=parse_moe(hf_config, architecture, num_layers),
        )


def resolve_device(device: DeviceLike) -> torch.device:
    """None: the GPU when torch sees one and the extension has CUDA kernels, else the CPU.
    An explicit device is taken as named (parsing a config needs no GPU); check_device_usable checks it."""
    from pagedserve import _core

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() and _core.has_cuda else "cpu")
    return torch.device(device)


def check_device_usable(device: torch.device) -> torch.device:
    """The device, if this process can run the engine on it."""
    from pagedserve import _core

    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for but torch sees no CUDA GPU")
        if not _core.has_cuda:
            raise ValueError("device='cuda' needs the extension built with CUDA: "
                             "pip install -C cmake.define.USE_CUDA=ON .")
    return device


def resolve_dtype(dtype: DTypeLike, checkpoint_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """"auto" -> the checkpoint's dtype on CUDA, float32 on CPU; explicit choices always win."""
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif dtype == "auto":
        resolved = checkpoint_dtype if device.type == "cuda" else _CPU_AUTO_DTYPE
    elif dtype in DTYPES_BY_NAME:
        resolved = DTYPES_BY_NAME[dtype]
    else:
        raise ValueError(f"dtype {dtype!r} is not supported; use 'auto', 'float32', 'bfloat16' or 'float16'")
    if resolved not in _ENGINE_DTYPES:
        raise ValueError(f"dtype {resolved} is not supported; use float32, bfloat16 or float16")
    return resolved


def _attention_scale(hf_config: Mapping[str, Any]) -> Optional[float]:
    """Gemma 2/3: query_pre_attn_scalar ** -0.5; Granite: attention_multiplier; else None (head_dim ** -0.5)."""
    if hf_config.get("query_pre_attn_scalar") is not None:
        return float(hf_config["query_pre_attn_scalar"]) ** -0.5
    if hf_config.get("attention_multiplier") is not None:
        return float(hf_config["attention_multiplier"])
    return None


__all__ = ["GENERATION_SAMPLING_KEYS", "SUPPORTED_ARCHITECTURES", "ArchitectureTraits", "ModelConfig",
           "check_device_usable", "resolve_device", "resolve_dtype"]
