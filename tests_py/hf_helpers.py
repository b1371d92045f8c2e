"""Tiny random-weight Hugging Face checkpoints for tests."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

# A 2-layer GQA Llama small enough to build in milliseconds.
TINY_LLAMA = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, tie_word_embeddings=False)


def make_hf_model(config_cls, seed: int = 0, **config_kwargs):
    """A transformers model with fresh random weights at scales where every parameter matters.

    HF's own init sets norm weights to 1 and biases to 0, which would hide a
    norm or bias we forgot to load; everything is redrawn here instead.
    """
    from transformers import AutoModelForCausalLM

    config = config_cls(**config_kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                param.copy_(0.1 * noise)
            elif "embed_tokens" in name:
                param.copy_(noise)
            else:
                param.copy_(0.08 * noise)
    return model


def save_hf_checkpoint(model, out_dir: Path, max_shard_size: Optional[str] = None,
                       generation_eos: Optional[object] = None) -> Path:
    """save_pretrained into out_dir (sharded when max_shard_size is given); returns out_dir."""
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    if generation_eos is not None:
        model.generation_config.eos_token_id = generation_eos
        model.generation_config.save_pretrained(out_dir)
    return out_dir


def round_to_bf16(model):
    """The model with every parameter rounded to bf16 values (kept float32), as real bf16 checkpoints are: the
    CPU path then keeps its matrices as exact bf16 tiles."""
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    return model
