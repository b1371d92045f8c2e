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

from pagedserve.models.rope_config import parse_rope

DTypeLike = Union[str, torch.dtype]
DeviceLike = Union[str, torch.device, None]


@dataclass(frozen=True)
class ArchitectureTraits:
    """How one supported HF architecture differs from plain Llama."""

    qkv_bias_key: Optional[str]  # config key switching q/k/v (and o) biases on; None = fixed below
    fixed_qkv_bias: bool = False  # Qwen2: q/k/v always have a bias, o_proj never
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before rope
    mlp_bias_key: Optional[str] = None


SUPPORTED_ARCHITECTURES: dict[str, ArchitectureTraits] = {
    "LlamaForCausalLM": ArchitectureTraits(qkv_bias_key="attention_bias", mlp_bias_key="mlp_bias"),
    "MistralForCausalLM": ArchitectureTraits(qkv_bias_key=None),
    "Qwen2ForCausalLM": ArchitectureTraits(qkv_bias_key=None, fixed_qkv_bias=True),
    "Qwen3ForCausalLM": ArchitectureTraits(qkv_bias_key="attention_bias", qk_norm=True),
}

_DTYPES_BY_NAME: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}
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
    rms_norm_eps: float
    rope_theta: float
    # Llama-3 frequency scaling as pagedserve.ops.rope_cos_sin_cache takes it (rope_type "llama3",
    # factor, low_freq_factor, high_freq_factor, original_max_position_embeddings), or None.
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

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

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
        architecture = _architecture(hf_config)
        traits = SUPPORTED_ARCHITECTURES[architecture]
        _check_activation(hf_config)
        _check_no_sliding_window(hf_config, architecture)
        num_heads = _required_int(hf_config, "num_attention_heads")
        num_kv_heads = int(hf_config.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of "
                             f"num_key_value_heads ({num_kv_heads})")
        hidden_size = _required_int(hf_config, "hidden_size")
        max_positions = _required_int(hf_config, "max_position_embeddings")
        rope_theta, rope_scaling = parse_rope(hf_config, max_positions)
        qkv_bias, o_bias = _attention_biases(hf_config, traits)
        checkpoint_dtype = _checkpoint_dtype(hf_config)
        resolved_device = resolve_device(device)
        generation_config = generation_config or {}
        return cls(
            model_dir=model_dir,
            architecture=architecture,
            vocab_size=_required_int(hf_config, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_required_int(hf_config, "intermediate_size"),
            num_layers=_required_int(hf_config, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(hf_config.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=_tie_word_embeddings(hf_config, model_dir),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(traits.mlp_bias_key and hf_config.get(traits.mlp_bias_key, False)),
            qk_norm=traits.qk_norm,
            eos_token_ids=_eos_token_ids(hf_config, generation_config),
            bos_token_id=_bos_token_id(hf_config, generation_config),
            checkpoint_dtype=checkpoint_dtype,
            dtype=resolve_dtype(dtype, checkpoint_dtype, resolved_device),
            device=resolved_device,
            generation_defaults=_generation_defaults(generation_config),
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
    elif dtype in _DTYPES_BY_NAME:
        resolved = _DTYPES_BY_NAME[dtype]
    else:
        raise ValueError(f"dtype {dtype!r} is not supported; use 'auto', 'float32', 'bfloat16' or 'float16'")
    if resolved not in _ENGINE_DTYPES:
        raise ValueError(f"dtype {resolved} is not supported; use float32, bfloat16 or float16")
    return resolved



def _architecture(hf_config: Mapping[str, Any]) -> str:
    architectures = hf_config.get("architectures") or []
    for name in architectures:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    shown = ", ".join(architectures) if architectures else "<none listed>"
    raise ValueError(f"unsupported architecture {shown}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def _check_activation(hf_config: Mapping[str, Any]) -> None:
    act = hf_config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")


def _uses_sliding_window(hf_config: Mapping[str, Any], architecture: str) -> bool:
    layer_types = hf_config.get("layer_types")
    if layer_types is not None:
        return "sliding_attention" in layer_types
    if architecture == "MistralForCausalLM":
        return hf_config.get("sliding_window") is not None
    num_layers = int(hf_config.get("num_hidden_layers", 0))
    return bool(hf_config.get("use_sliding_window")) and int(hf_config.get("max_window_layers", 0)) < num_layers


def _check_no_sliding_window(hf_config: Mapping[str, Any], architecture: str) -> None:
    """A window at least as long as the context is full attention; anything shorter we cannot run."""
    window = hf_config.get("sliding_window")
    if window is None or not _uses_sliding_window(hf_config, architecture):
        return
    max_positions = int(hf_config.get("max_position_embeddings", 0))
    if int(window) < max_positions:
        raise ValueError(f"{architecture} with sliding_window={window} < max_position_embeddings={max_positions} "
                         "is not supported (sliding-window attention is not implemented)")


def _attention_biases(hf_config: Mapping[str, Any], traits: ArchitectureTraits) -> tuple[bool, bool]:
    if traits.fixed_qkv_bias:
        return True, False
    enabled = bool(traits.qkv_bias_key and hf_config.get(traits.qkv_bias_key, False))
    return enabled, enabled  # Llama/Qwen3 attention_bias covers q, k, v and o alike


def _checkpoint_dtype(hf_config: Mapping[str, Any]) -> torch.dtype:
    name = hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"
    name = str(name).removeprefix("torch.")
    if name not in _DTYPES_BY_NAME:
        raise ValueError(f"checkpoint dtype {name!r} is not supported; expected float32, bfloat16 or float16")
    return _DTYPES_BY_NAME[name]


def _tie_word_embeddings(hf_config: Mapping[str, Any], model_dir: Optional[Path]) -> bool:
    """The config decides; when it is silent, a checkpoint without lm_head.weight is tied."""
    if "tie_word_embeddings" in hf_config:
        return bool(hf_config["tie_word_embeddings"])
    if model_dir is None:
        return False
    from pagedserve.models.weights import checkpoint_tensor_names  # local: weights imports this module

    try:
        return "lm_head.weight" not in checkpoint_tensor_names(model_dir)
    except FileNotFoundError:
        return False


# generation_config.json keys that set a sampling default; greedy files (do_sample false) set temperature 0.
GENERATION_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _generation_defaults(generation_config: Mapping[str, Any]) -> dict[str, Any]:
    defaults = {k: generation_config[k] for k in GENERATION_SAMPLING_KEYS if generation_config.get(k) is not None}
    if generation_config.get("do_sample") is False:
        defaults = {"temperature": 0.0}
    return defaults


def _eos_token_ids(hf_config: Mapping[str, Any], generation_config: Mapping[str, Any]) -> tuple[int, ...]:
    merged: list[int] = []
    for source in (hf_config.get("eos_token_id"), generation_config.get("eos_token_id")):
        for token in _as_int_list(source):
            if token not in merged:
                merged.append(token)
    return tuple(merged)


def _bos_token_id(hf_config: Mapping[str, Any], generation_config: Mapping[str, Any]) -> Optional[int]:
    for source in (hf_config.get("bos_token_id"), generation_config.get("bos_token_id")):
        if source is not None:
            return int(source)
    return None


def _as_int_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _required_int(hf_config: Mapping[str, Any], key: str) -> int:
    if hf_config.get(key) is None:
        raise ValueError(f"config.json lacks required key {key!r}")
    return int(hf_config[key])
