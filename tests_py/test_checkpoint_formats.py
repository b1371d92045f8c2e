"""Checkpoint file formats: PyTorch .bin/.pt (single and sharded), safetensors preferred, dtype casts on load."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from pagedserve import LLM, SamplingParams
from pagedserve.models import build_model
from pagedserve.models.checkpoint_files import checkpoint_files, checkpoint_format
from pagedserve.models.model_config import ModelConfig


def load(path, dtype="float32", load_format="auto"):
    config = ModelConfig.from_model_dir(path, dtype=dtype, device="cpu")
    return build_model(config, "cpu", load_format=load_format)


def state_of(model) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def assert_same_parameters(a, b) -> None:
    sa, sb = state_of(a), state_of(b)
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def hf_state(path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(path, "safetensors"):
        state.update(load_file(str(file)))
    return state


def write_bin(path, state: dict[str, torch.Tensor], num_shards: int = 1, name: str = "pytorch_model.bin",
              **save_kwargs) -> None:
    """Writes ``state`` as transformers 4 did with safe_serialization=False (sharded behind an index if asked)."""
    if num_shards == 1:
        torch.save(state, path / name, **save_kwargs)
        return
    names = sorted(state)
    weight_map = {}
    for shard in range(num_shards):
        file = f"pytorch_model-{shard + 1:05d}-of-{num_shards:05d}.bin"
        part = {n: state[n] for n in names[shard::num_shards]}
        torch.save(part, path / file)
        weight_map.update(dict.fromkeys(part, file))
    (path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def drop_safetensors(path) -> None:
    for file in [*path.glob("*.safetensors"), *path.glob("model.safetensors.index.json")]:
        file.unlink()


@pytest.mark.parametrize("layout", ["single", "sharded", "pt_file", "legacy_pickle"])
def test_pytorch_checkpoint_loads_like_safetensors(tiny_checkpoint, layout):
    _, path = tiny_checkpoint(tie_word_embeddings=False)
    reference = load(path)
    state = hf_state(path)
    drop_safetensors(path)
    if layout == "sharded":
        write_bin(path, state, num_shards=3)
    elif layout == "pt_file":
        write_bin(path, state, name="model.pt")
    elif layout == "legacy_pickle":  # torch < 1.6 format: cannot be memory-mapped, read into memory instead
        write_bin(path, state, _use_new_zipfile_serialization=False)
    else:
        write_bin(path, state)
    assert checkpoint_format(path) == "pt"
    assert len(checkpoint_files(path)) == (3 if layout == "sharded" else 1)
    assert_same_parameters(load(path), reference)
    assert_same_parameters(load(path, load_format="pt"), reference)


def test_safetensors_preferred_when_both_exist(tiny_checkpoint):
    _, path = tiny_checkpoint()
    state = hf_state(path)
    write_bin(path, {name: torch.zeros_like(t) for name, t in state.items()})
    auto = load(path)
    assert checkpoint_format(path) == "safetensors"
    assert torch.equal(auto.model.norm.weight, state["model.norm.weight"])
    assert torch.all(load(path, load_format="pt").model.norm.weight == 0)  # asked for explicitly


def test_asked_for_format_must_exist(tiny_checkpoint):
    _, path = tiny_checkpoint()
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin"):
        load(path, load_format="pt")
    write_bin(path, hf_state(path))
    drop_safetensors(path)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load(path, load_format="safetensors")


def test_index_naming_a_missing_shard_is_reported(tiny_checkpoint):
    _, path = tiny_checkpoint()
    state = hf_state(path)
    drop_safetensors(path)
    write_bin(path, state, num_shards=2)
    (path / "pytorch_model-00002-of-00002.bin").unlink()
    with pytest.raises(FileNotFoundError, match="pytorch_model-00002-of-00002.bin"):
        load(path)


def test_tied_embeddings_inferred_from_a_bin_checkpoint(tiny_checkpoint):
    _, path = tiny_checkpoint(tie_word_embeddings=True)
    config = json.loads((path / "config.json").read_text())
    config.pop("tie_word_embeddings")
    (path / "config.json").write_text(json.dumps(config))
    state = hf_state(path)
    state.pop("lm_head.weight", None)
    drop_safetensors(path)
    write_bin(path, state, num_shards=2)
    assert load(path).lm_head is None


@pytest.mark.parametrize("saved, engine", [(torch.bfloat16, "float32"), (torch.float16, "bfloat16"),
                                           (torch.float32, "float16"), (torch.bfloat16, "bfloat16")])
@pytest.mark.parametrize("file_format", ["safetensors", "pt"])
def test_checkpoint_dtype_is_cast_to_the_engine_dtype(tiny_checkpoint, saved, engine, file_format):
    hf_model, path = tiny_checkpoint()
    hf_model.to(saved).save_pretrained(path)  # config.json now says the saved dtype
    state = hf_state(path)
    assert all(t.dtype == saved for t in state.values())
    if file_format == "pt":
        drop_safetensors(path)
        write_bin(path, state)
    model = load(path, dtype=engine)
    want = getattr(torch, engine)
    assert model.config.checkpoint_dtype == saved
    for name, param in model.named_parameters():
        assert param.dtype == want, name
    expected = state["model.layers.1.mlp.down_proj.weight"].to(want)
    assert torch.equal(model.model.layers[1].mlp.down_proj.weight, expected)


def test_llm_on_a_sharded_bin_checkpoint_matches_transformers_greedy(tiny_checkpoint):
    hf_model, path = tiny_checkpoint()
    state = hf_state(path)
    drop_safetensors(path)
    write_bin(path, state, num_shards=2)
    prompts = [[5, 17, 33, 2, 99, 120], [7, 7, 200, 31]]
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=32, block_size=4, max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ids = torch.tensor([prompt])
            want = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                                     do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == want
