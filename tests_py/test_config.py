"""ModelConfig parsing against configs that transformers itself writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from pagedserve.models.model_config import SUPPORTED_ARCHITECTURES, ModelConfig

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0}


def write_config(tmp_path: Path, hf_config, architecture: str, dtype: str = "float32") -> Path:
    """Saves an HF config like save_pretrained does for a model (architectures + dtype filled in)."""
    hf_config.architectures = [architecture]
    hf_config.dtype = dtype
    hf_config.save_pretrained(tmp_path)
    return tmp_path


def small(config_cls, **overrides):
    kwargs = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=300, max_position_embeddings=256)
    kwargs.update(overrides)
    return config_cls(**kwargs)


def test_llama_fields(tmp_path):
    write_config(tmp_path, small(LlamaConfig, rms_norm_eps=1e-5, bos_token_id=7, eos_token_id=9),
                 "LlamaForCausalLM", dtype="bfloat16")
    config = ModelConfig.from_model_dir(tmp_path, device="cpu")
    assert config.architecture == "LlamaForCausalLM"
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (300, 64, 96)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (2, 4, 2, 16)
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert config.rope_theta == 10000.0 and config.rope_scaling is None
    assert config.max_position_embeddings == 256
    assert not config.tie_word_embeddings
    assert not (config.qkv_bias or config.o_bias or config.mlp_bias or config.qk_norm)
    assert config.eos_token_ids == (9,) and config.bos_token_id == 7
    assert config.checkpoint_dtype == torch.bfloat16
    assert config.dtype == torch.float32  # "auto" on CPU
    assert config.device == torch.device("cpu")
    assert config.model_dir == tmp_path


def test_llama3_rope_parameters_written_by_transformers5(tmp_path):
    write_config(tmp_path, small(LlamaConfig, rope_parameters=dict(LLAMA3_ROPE)), "LlamaForCausalLM")
    written = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in written  # what transformers 5 writes
    config = ModelConfig.from_model_dir(tmp_path, device="cpu")
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64}


@pytest.mark.parametrize("type_key", ["rope_type", "type"])
def test_legacy_rope_keys(type_key):
    raw = base_raw("LlamaForCausalLM")
    raw["rope_theta"] = 123456.0
    raw["rope_scaling"] = {type_key: "llama3", "factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                           "original_max_position_embeddings": 32}
    config = ModelConfig.from_hf_config(raw, device="cpu")
    assert config.rope_theta == 123456.0
    assert config.rope_scaling == {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                                   "original_max_position_embeddings": 32}


def test_legacy_rope_theta_without_scaling():
    raw = base_raw("LlamaForCausalLM")
    raw["rope_theta"] = 5e5
    config = ModelConfig.from_hf_config(raw, device="cpu")
    assert config.rope_theta == 5e5 and config.rope_scaling is None


def test_unsupported_rope_type():
    raw = base_raw("LlamaForCausalLM")
    raw["rope_parameters"] = {"rope_type": "mrope", "factor": 4.0, "rope_theta": 1e4}
    with pytest.raises(ValueError, match="rope type 'mrope'"):
        ModelConfig.from_hf_config(raw, device="cpu")


def test_qwen2_has_qkv_bias_only(tmp_path):
    write_config(tmp_path, small(Qwen2Config, tie_word_embeddings=True), "Qwen2ForCausalLM")
    config = ModelConfig.from_model_dir(tmp_path, device="cpu")
    assert config.qkv_bias and not config.o_bias and not config.qk_norm
    assert config.tie_word_embeddings


def test_qwen3_head_dim_and_qk_norm(tmp_path):
    write_config(tmp_path, small(Qwen3Config, head_dim=32), "Qwen3ForCausalLM")
    config = ModelConfig.from_model_dir(tmp_path, device="cpu")
    assert config.head_dim == 32 and config.q_size == 128 and config.kv_size == 64
    assert config.qk_norm and not config.qkv_bias


def test_llama_attention_and_mlp_bias(tmp_path):
    write_config(tmp_path, small(LlamaConfig, attention_bias=True, mlp_bias=True), "LlamaForCausalLM")
    config = ModelConfig.from_model_dir(tmp_path, device="cpu")
    assert config.qkv_bias and config.o_bias and config.mlp_bias


def test_eos_ids_merge_config_and_generation_config(tmp_path):
    write_config(tmp_path, small(LlamaConfig, eos_token_id=2), "LlamaForCausalLM")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 2, 11], "bos_token_id": 1}))
    config = ModelConfig.from_model_dir(tmp_path, device="cpu")
    assert config.eos_token_ids == (2, 5, 11)


def test_bos_falls_back_to_generation_config():
    raw = base_raw("LlamaForCausalLM")
    raw["bos_token_id"] = None
    config = ModelConfig.from_hf_config(raw, device="cpu", generation_config={"bos_token_id": 4, "eos_token_id": 3})
    assert config.bos_token_id == 4 and config.eos_token_ids == (2, 3)


@pytest.mark.parametrize("requested, expected", [
    ("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16),
    (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_explicit_dtype_always_honored(requested, expected, device):
    raw = base_raw("LlamaForCausalLM", dtype="float16")
    assert ModelConfig.from_hf_config(raw, dtype=requested, device=device).dtype == expected


@pytest.mark.parametrize("checkpoint_key", ["dtype", "torch_dtype"])
def test_auto_dtype(checkpoint_key):
    raw = base_raw("LlamaForCausalLM")
    raw.pop("dtype")
    raw[checkpoint_key] = "bfloat16"
    assert ModelConfig.from_hf_config(raw, device="cuda").dtype == torch.bfloat16  # no GPU needed to parse
    assert ModelConfig.from_hf_config(raw, device="cpu").dtype == torch.float32


def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype 'int8'"):
        ModelConfig.from_hf_config(base_raw("LlamaForCausalLM"), dtype="int8", device="cpu")


def test_unsupported_architecture_lists_supported():
    with pytest.raises(ValueError) as error:
        ModelConfig.from_hf_config(base_raw("GPT2LMHeadModel"), device="cpu")
    message = str(error.value)
    assert "GPT2LMHeadModel" in message
    for name in SUPPORTED_ARCHITECTURES:
        assert name in message


def test_mistral_sliding_window_applies_to_every_layer(tmp_path):
    write_config(tmp_path, small(MistralConfig, sliding_window=64), "MistralForCausalLM")
    config = ModelConfig.from_model_dir(tmp_path, device="cpu")
    assert config.sliding_window == 64 and [config.layer_window(i) for i in range(2)] == [64, 64]


@pytest.mark.parametrize("window", [None, 256, 4096])
def test_mistral_without_effective_window_is_llama(tmp_path, window):
    write_config(tmp_path, small(MistralConfig, sliding_window=window), "MistralForCausalLM")
    config = ModelConfig.from_model_dir(tmp_path, device="cpu")
    assert config.architecture == "MistralForCausalLM" and not config.qkv_bias
    assert config.sliding_window == 0  # a window as long as the context is full attention


def test_qwen2_layers_from_max_window_layers_slide(tmp_path):
    write_config(tmp_path, small(Qwen2Config, use_sliding_window=True, sliding_window=32, max_window_layers=1),
                 "Qwen2ForCausalLM")
    config = ModelConfig.from_model_dir(tmp_path, device="cpu")
    assert [config.layer_window(i) for i in range(2)] == [0, 32]


def test_qwen2_legacy_config_without_layer_types():
    raw = base_raw("Qwen2ForCausalLM")
    raw.update(use_sliding_window=True, sliding_window=16, max_window_layers=1)
    assert [ModelConfig.from_hf_config(raw, device="cpu").layer_window(i) for i in range(2)] == [0, 16]
    raw["use_sliding_window"] = False
    assert ModelConfig.from_hf_config(raw, device="cpu").sliding_window == 0


def test_non_silu_activation_is_rejected():
    raw = base_raw("LlamaForCausalLM")
    raw["hidden_act"] = "gelu"
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        ModelConfig.from_hf_config(raw, device="cpu")


def test_heads_must_divide():
    raw = base_raw("LlamaForCausalLM")
    raw["num_key_value_heads"] = 3
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelConfig.from_hf_config(raw, device="cpu")


def test_missing_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_model_dir(tmp_path)


def test_tie_inferred_from_checkpoint_when_config_is_silent(tmp_path):
    from safetensors.torch import save_file

    raw = base_raw("LlamaForCausalLM")
    raw.pop("tie_word_embeddings")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    save_file({"model.embed_tokens.weight": torch.randn(300, 64)}, str(tmp_path / "model.safetensors"))
    assert ModelConfig.from_model_dir(tmp_path, device="cpu").tie_word_embeddings
    save_file({"model.embed_tokens.weight": torch.randn(300, 64), "lm_head.weight": torch.randn(300, 64)},
              str(tmp_path / "model.safetensors"))
    assert not ModelConfig.from_model_dir(tmp_path, device="cpu").tie_word_embeddings


def base_raw(architecture: str, dtype: str = "float32") -> dict:
    return {"architectures": [architecture], "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 256,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
            "dtype": dtype}


# ---------------------------------------------------------------------------- families and their legacy spellings
def test_gemma3_written_by_transformers4():
    """rope_theta + rope_scaling for the global layers, rope_local_base_freq for the sliding ones,
    sliding_window_pattern instead of layer_types."""
    raw = base_raw("Gemma3ForCausalLM")
    raw.update(num_hidden_layers=6, head_dim=16, rope_theta=1e6, rope_local_base_freq=1e4, sliding_window=32,
               sliding_window_pattern=3, rope_scaling={"rope_type": "linear", "factor": 8.0},
               query_pre_attn_scalar=64, hidden_activation="gelu_pytorch_tanh")
    config = ModelConfig.from_hf_config(raw, device="cpu")
    assert config.rope_theta == 1e6 and config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert config.sliding_rope == (1e4, None)
    assert [config.layer_window(i) for i in range(6)] == [32, 32, 0, 32, 32, 0]
    assert config.attention_scale == 64 ** -0.5 and config.qk_norm and config.hidden_act == "gelu_pytorch_tanh"


def test_gemma2_without_layer_types_alternates():
    raw = base_raw("Gemma2ForCausalLM")
    raw.update(num_hidden_layers=4, sliding_window=16, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
               hidden_act="gelu_pytorch_tanh")
    config = ModelConfig.from_hf_config(raw, device="cpu")
    assert [config.layer_window(i) for i in range(4)] == [16, 0, 16, 0]
    assert (config.attn_logit_softcap, config.final_logit_softcap) == (50.0, 30.0)


def test_phi3_legacy_su_rope_and_partial_rotary():
    raw = base_raw("Phi3ForCausalLM")
    raw.update(max_position_embeddings=131072, original_max_position_embeddings=4096, partial_rotary_factor=0.75,
               rope_scaling={"type": "su", "short_factor": [1.0] * 6, "long_factor": [2.0] * 6})
    config = ModelConfig.from_hf_config(raw, device="cpu")
    assert config.rope_scaling == {"rope_type": "longrope", "short_factor": [1.0] * 6, "long_factor": [2.0] * 6,
                                   "original_max_position_embeddings": 4096}
    assert config.partial_rotary_factor == 0.75 and config.rotary_dim == 12  # of head_dim 16


def test_granite_multipliers_and_smollm3_rope_layers():
    raw = base_raw("GraniteForCausalLM")
    raw.update(embedding_multiplier=12.0, attention_multiplier=0.015625, residual_multiplier=0.22, logits_scaling=8.0)
    config = ModelConfig.from_hf_config(raw, device="cpu")
    assert (config.embedding_multiplier, config.attention_scale, config.residual_multiplier,
            config.logits_scaling) == (12.0, 0.015625, 0.22, 8.0)
    raw = base_raw("SmolLM3ForCausalLM")
    raw.update(num_hidden_layers=8, no_rope_layer_interval=4)
    assert ModelConfig.from_hf_config(raw, device="cpu").rope_layers == (True, True, True, False) * 2


def test_gelu_is_refused_for_llama_but_not_gemma():
    raw = base_raw("GemmaForCausalLM")
    raw["hidden_act"] = "gelu"
    assert ModelConfig.from_hf_config(raw, device="cpu").hidden_act == "gelu"
    raw["hidden_act"] = "relu"
    with pytest.raises(ValueError, match="hidden_act 'relu'"):
        ModelConfig.from_hf_config(raw, device="cpu")
