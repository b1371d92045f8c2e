"""Weight loading (safetensors, sharded, tied, merged projections, errors) and dummy weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from paged_helpers import PagedBatchRunner
from pagedserve.models.model_config import ModelConfig
from pagedserve.models import build_model
from pagedserve.models.weights import MissingTensorError, checkpoint_files, init_dummy_weights


def load(path, dtype="float32", load_format="auto"):
    config = ModelConfig.from_model_dir(path, dtype=dtype, device="cpu")
    return build_model(config, "cpu", load_format=load_format)


def rewrite_single_file(path, edit) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("max_shard_size", [None, "40KB"])
def test_parameters_equal_checkpoint_with_merged_projections(tiny_checkpoint, max_shard_size):
    hf_model, path = tiny_checkpoint(max_shard_size=max_shard_size)
    assert (len(checkpoint_files(path)) > 1) == bool(max_shard_size)
    model = load(path)
    hf = hf_model.state_dict()
    ours = dict(model.named_parameters())
    for layer in range(hf_model.config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        qkv = torch.cat([hf[f"{prefix}self_attn.{p}_proj.weight"] for p in "qkv"])
        gate_up = torch.cat([hf[f"{prefix}mlp.gate_proj.weight"], hf[f"{prefix}mlp.up_proj.weight"]])
        assert torch.equal(ours[f"{prefix}self_attn.qkv_proj.weight"], qkv)
        assert torch.equal(ours[f"{prefix}mlp.gate_up_proj.weight"], gate_up)
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
                     "post_attention_layernorm.weight"):
            assert torch.equal(ours[f"{prefix}{name}"], hf[prefix + name])
    assert torch.equal(ours["model.embed_tokens.weight"], hf["model.embed_tokens.weight"])
    assert torch.equal(ours["model.norm.weight"], hf["model.norm.weight"])
    assert torch.equal(ours["lm_head.weight"], hf["lm_head.weight"])


def test_qkv_biases_are_merged(tiny_checkpoint):
    from transformers import Qwen2Config

    hf_model, path = tiny_checkpoint(Qwen2Config)
    model = load(path)
    hf = hf_model.state_dict()
    bias = torch.cat([hf[f"model.layers.1.self_attn.{p}_proj.bias"] for p in "qkv"])
    assert torch.equal(model.model.layers[1].self_attn.qkv_proj.bias, bias)
    assert model.model.layers[1].self_attn.o_proj.bias is None


def test_tied_embeddings_share_the_embedding_matrix(tiny_checkpoint):
    hf_model, path = tiny_checkpoint(tie_word_embeddings=True)
    model = load(path)
    assert model.lm_head is None
    hidden = torch.randn(3, hf_model.config.hidden_size)
    expected = hidden @ hf_model.state_dict()["model.embed_tokens.weight"].T
    torch.testing.assert_close(model.compute_logits(hidden), expected)


def test_tied_model_ignores_a_saved_lm_head(tiny_checkpoint):
    _, path = tiny_checkpoint(tie_word_embeddings=True)
    rewrite_single_file(path, lambda t: t.update({"lm_head.weight": torch.randn_like(t["model.embed_tokens.weight"])}))
    model = load(path)
    hidden = torch.randn(2, 64)
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ model.model.embed_tokens.weight.T)


def test_cast_to_target_dtype(tiny_checkpoint):
    hf_model, path = tiny_checkpoint()
    model = load(path, dtype="bfloat16")
    for param in model.parameters():
        assert param.dtype == torch.bfloat16
    expected = hf_model.state_dict()["model.layers.0.mlp.down_proj.weight"].to(torch.bfloat16)
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight, expected)


def test_missing_tensor_names_tensor_and_files(tiny_checkpoint):
    _, path = tiny_checkpoint()
    rewrite_single_file(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(MissingTensorError) as error:
        load(path)
    message = str(error.value)
    assert "model.layers.1.self_attn.k_proj.weight" in message and "model.safetensors" in message


def test_missing_tensor_in_sharded_checkpoint_lists_every_shard(tiny_checkpoint):
    _, path = tiny_checkpoint(max_shard_size="40KB")
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = index["weight_map"].pop("model.norm.weight")
    tensors = load_file(str(path / shard))
    tensors.pop("model.norm.weight")
    save_file(tensors, str(path / shard), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))
    with pytest.raises(MissingTensorError) as error:
        load(path)
    for file in checkpoint_files(path):
        assert file.name in str(error.value)
    assert "model.norm.weight" in str(error.value)


def test_harmless_extra_tensors_are_ignored(tiny_checkpoint):
    _, path = tiny_checkpoint()
    rewrite_single_file(path, lambda t: t.update({
        "model.layers.0.self_attn.rotary_emb.inv_freq": torch.randn(8),
        "some_auxiliary_head.weight": torch.randn(4, 4)}))
    load(path)


@pytest.mark.parametrize("extra", ["model.layers.0.self_attn.q_proj.bias", "model.layers.1.self_attn.q_norm.weight",
                                   "model.layers.0.mlp.down_proj.qweight", "model.layers.0.mlp.experts.0.w1.weight"])
def test_extra_tensors_that_change_the_math_are_rejected(tiny_checkpoint, extra):
    _, path = tiny_checkpoint()
    rewrite_single_file(path, lambda t: t.update({extra: torch.randn(16)}))
    with pytest.raises(ValueError, match="unsupported feature") as error:
        load(path)
    assert extra in str(error.value)


def test_shape_mismatch_is_reported(tiny_checkpoint):
    _, path = tiny_checkpoint()
    rewrite_single_file(path, lambda t: t.update({"model.layers.0.self_attn.v_proj.weight": torch.randn(16, 64)}))
    with pytest.raises(ValueError, match="v_proj.weight.*shape"):
        load(path)


def test_no_checkpoint_files(tiny_checkpoint):
    _, path = tiny_checkpoint()
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load(path)


def test_unknown_load_format(tiny_checkpoint):
    _, path = tiny_checkpoint()
    with pytest.raises(ValueError, match="load_format 'gguf'"):
        load(path, load_format="gguf")


def dummy_config(dtype: str, **overrides) -> ModelConfig:
    raw = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 128, "intermediate_size": 256,
           "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
           "vocab_size": 500, "max_position_embeddings": 256, "tie_word_embeddings": False, "attention_bias": True}
    raw.update(overrides)
    return ModelConfig.from_hf_config(raw, dtype=dtype, device="cpu")


def test_dummy_weights_are_seeded():
    config = dummy_config("float32")
    first = build_model(config, "cpu", load_format="dummy", seed=5)
    again = build_model(config, "cpu", load_format="dummy", seed=5)
    other = build_model(config, "cpu", load_format="dummy", seed=6)
    for (name, a), b, c in zip(first.named_parameters(), again.parameters(), other.parameters()):
        assert torch.equal(a, b), name
        if name.endswith("norm.weight"):
            assert torch.all(a == 1), name
        else:
            assert not torch.equal(a, c), name
            assert 0.01 < a.float().std().item() < 0.04, name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dummy_model_gives_finite_logits(dtype):
    model = build_model(dummy_config(dtype), "cpu", load_format="dummy", seed=0)
    runner = PagedBatchRunner(model, block_size=8, num_blocks=32)
    generator = torch.Generator().manual_seed(0)
    runner.add("a", torch.randint(0, 500, (40,), generator=generator).tolist())
    runner.add("b", torch.randint(0, 500, (20,), generator=generator).tolist())
    prefill = runner.step([("a", 39), ("b", 19)])
    decode = runner.step([("a", 1), ("b", 1)])
    for logits in [*prefill.values(), *decode.values()]:
        assert torch.isfinite(logits).all()
        assert logits.std() > 0


def test_dummy_init_touches_every_parameter():
    model = build_model(dummy_config("float32"), "cpu", load_format="dummy")
    for param in model.parameters():
        param.data.fill_(float("nan"))
    init_dummy_weights(model, seed=1)
    for name, param in model.named_parameters():
        assert torch.isfinite(param).all(), name
