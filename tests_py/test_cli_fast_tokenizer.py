"""FastTokenizer (tokenizers + jinja2, no transformers) gives what transformers' tokenizer gives for the
same directory: ids, text, special tokens, chat templates; directories it cannot mirror fall back."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from pagedserve.engine.fast_tokenizer import FastTokenizer, can_load_fast, load_fast_tokenizer

TEXTS = ["The capital of France is", "", " leading space", "a\nb  c\t", "<|im_start|>user\nhi<|im_end|>",
         "héllo 😀 日本語", "x" * 300, "1, 2, 3, 4,"]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "And Germany?"}],
]


@pytest.fixture(scope="module")
def pair(default_model_path):
    from transformers import AutoTokenizer
    return load_fast_tokenizer(default_model_path), AutoTokenizer.from_pretrained(str(default_model_path))


@pytest.mark.parametrize("text", TEXTS)
def test_ids_and_text_match_transformers(pair, text):
    fast, hf = pair
    assert fast.encode(text) == hf.encode(text)
    assert fast.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
    assert fast(text).input_ids == hf(text).input_ids
    ids = hf.encode("<|im_start|>" + text + "<|im_end|>")
    for skip in (False, True):
        assert fast.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert fast.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(pair, chat, add_generation_prompt):
    fast, hf = pair
    kw = dict(add_generation_prompt=add_generation_prompt)
    assert fast.apply_chat_template(chat, tokenize=False, **kw) == hf.apply_chat_template(chat, tokenize=False, **kw)
    from pagedserve.engine.tokenizer import apply_chat_template
    assert apply_chat_template(fast, chat, **kw) == apply_chat_template(hf, chat, **kw)


def test_special_tokens_and_sizes_match_transformers(pair):
    fast, hf = pair
    for name in ("bos_token", "bos_token_id", "eos_token", "eos_token_id", "pad_token_id", "unk_token",
                 "all_special_ids", "all_special_tokens", "special_tokens_map", "vocab_size", "chat_template"):
        assert getattr(fast, name) == getattr(hf, name), name
    assert len(fast) == len(hf)
    assert fast.convert_tokens_to_ids(["<|im_end|>"]) == hf.convert_tokens_to_ids(["<|im_end|>"])
    assert fast.sep_token is None and fast.mask_token_id is None


@pytest.mark.parametrize("add_bos_token", [True, False])
def test_bos_comes_from_tokenizer_json_as_in_transformers(default_model_path, tmp_path, add_bos_token):
    from transformers import AutoTokenizer
    tokenizer_json = json.loads((default_model_path / "tokenizer.json").read_text())
    tokenizer_json["post_processor"] = {"type": "TemplateProcessing",
                                        "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                                                   {"Sequence": {"id": "A", "type_id": 0}}],
                                        "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                                                 {"Sequence": {"id": "B", "type_id": 1}}],
                                        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0],
                                                                             "tokens": ["<|endoftext|>"]}}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    config = json.loads((default_model_path / "tokenizer_config.json").read_text())
    config.update(add_bos_token=add_bos_token, bos_token="<|endoftext|>")  # transformers ignores the flag here
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    fast, hf = FastTokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS[:4]:
        assert fast.encode(text) == hf.encode(text)
        assert fast.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
    assert fast.encode("Hi")[0] == 0
    from pagedserve.engine.tokenizer import encode_prompt
    assert encode_prompt(fast, "<|endoftext|>Hi") == encode_prompt(hf, "<|endoftext|>Hi")  # one BOS


def test_directories_it_cannot_mirror_are_left_to_transformers(default_model_path, tmp_path):
    assert can_load_fast(default_model_path)
    assert load_fast_tokenizer(tmp_path) is None  # no tokenizer.json
    shutil.copy(default_model_path / "tokenizer.json", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    assert load_fast_tokenizer(tmp_path) is None


def test_loading_it_imports_neither_transformers_nor_torch(default_model_path):
    code = ("import sys\nfrom pagedserve.engine.fast_tokenizer import load_fast_tokenizer\n"
            f"tok = load_fast_tokenizer({str(default_model_path)!r})\n"
            "tok.decode(tok.encode('Hi there'))\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
            "tok.apply_chat_template([{'role': 'user', 'content': 'Hi'}], add_generation_prompt=True)\n"
            "print(sorted(m for m in ('torch', 'transformers.models') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    # A chat template takes transformers' renderer module only, not its tokenizer stack or torch.
    assert result.stdout.split() == ["[]", "[]"], result.stderr


def test_an_unchanged_directory_loads_once(default_model_path, tmp_path):
    assert load_fast_tokenizer(default_model_path) is load_fast_tokenizer(str(default_model_path))
    shutil.copy(default_model_path / "tokenizer.json", tmp_path)
    first = load_fast_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    second = load_fast_tokenizer(tmp_path)
    assert second is not first and second.eos_token == "<|im_end|>" and first.eos_token is None
