"""with_byte_level_decoder (models/tokenizer_json.py): the default model's tokenizer as transformers 5.17
writes it from the GGUF file (a byte-level BPE whose decoder is a SentencePiece-style Sequence) gets the
plain ByteLevel decoder back; the oracle is transformers decoding with the Sequence: the same text for
every token and for mixed JSON, and llguidance, which refused that tokenizer, now reads it as
transformers does. Tokenizers where the Sequence's other steps act are left alone."""

from __future__ import annotations

import copy
import json
import shutil

import pytest

from pagedserve.models.tokenizer_json import with_byte_level_decoder

SEQUENCE_DECODER = {"type": "Sequence", "decoders": [
    {"type": "ByteFallback"}, {"type": "Fuse"},
    {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
    {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}]}
PROBE = '{"name": "Zoë Ångström", "n": [1, 2.5e3], "emoji": "🙂"}\n\t- ok  '


def _as_517_writes_it(default_model_path, tmp_path) -> dict:
    for f in default_model_path.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name == "config.json":
            shutil.copy(f, tmp_path / f.name)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    spec["decoder"] = copy.deepcopy(SEQUENCE_DECODER)
    spec["model"]["byte_fallback"] = True
    return spec


def test_sequence_decoder_of_a_byte_level_bpe_becomes_byte_level(default_model_path, tmp_path):
    from transformers import AutoTokenizer

    old = _as_517_writes_it(default_model_path, tmp_path)
    (tmp_path / "tokenizer.json").write_text(json.dumps(old))
    before = AutoTokenizer.from_pretrained(str(tmp_path))
    fixed = with_byte_level_decoder(old)
    assert fixed["decoder"] == SEQUENCE_DECODER["decoders"][3] and fixed["model"]["byte_fallback"] is False
    assert old["decoder"] == SEQUENCE_DECODER  # the input is not modified
    (tmp_path / "tokenizer.json").write_text(json.dumps(fixed))
    after = AutoTokenizer.from_pretrained(str(tmp_path))
    ids = before.encode(PROBE, add_special_tokens=False)
    assert after.encode(PROBE, add_special_tokens=False) == ids
    assert after.decode(ids) == before.decode(ids)
    for token in range(len(before)):  # every token alone, special ones included
        assert after.decode([token]) == before.decode([token]), token
    llguidance = pytest.importorskip("llguidance")
    from pagedserve.engine.grammar_backends import LLGuidanceBackend

    LLGuidanceBackend(after, len(after), [after.eos_token_id])  # reads it as transformers does: no ValueError
    assert llguidance is not None


@pytest.mark.parametrize("change", ["sentencepiece_token", "byte_token", "other_replace", "strip", "byte_level_first"])
def test_decoders_whose_other_steps_act_are_left_alone(default_model_path, tmp_path, change):
    spec = _as_517_writes_it(default_model_path, tmp_path)
    if change == "sentencepiece_token":
        spec["model"]["vocab"]["\u2581the"] = len(spec["model"]["vocab"])
    elif change == "byte_token":
        spec["model"]["vocab"]["<0x0A>"] = len(spec["model"]["vocab"])
    elif change == "other_replace":
        spec["decoder"]["decoders"][2] = {"type": "Replace", "pattern": {"String": "x"}, "content": "y"}
    elif change == "strip":
        spec["decoder"]["decoders"].append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    else:  # the Replace would then act on decoded text
        spec["decoder"]["decoders"].insert(0, spec["decoder"]["decoders"].pop())
    assert with_byte_level_decoder(spec) is spec


def test_other_decoders_are_left_alone():
    spec = {"decoder": {"type": "ByteLevel"}, "model": {"type": "BPE", "vocab": {"a": 0}}}
    assert with_byte_level_decoder(spec) is spec
    spec = {"decoder": SEQUENCE_DECODER, "model": {"type": "Unigram", "vocab": []}}
    assert with_byte_level_decoder(spec) is spec


def test_conversions_save_the_byte_level_decoder(default_model_path, tmp_path):
    """save_tokenizer, which the default model's and users' GGUF conversions write with, applies it."""
    from transformers import AutoTokenizer

    from pagedserve.models.default_model import save_tokenizer

    source = tmp_path / "source"
    source.mkdir()
    (source / "tokenizer.json").write_text(json.dumps(_as_517_writes_it(default_model_path, source)))
    out = tmp_path / "out"
    out.mkdir()
    save_tokenizer(AutoTokenizer.from_pretrained(str(source)), out, 2048)
    written = json.loads((out / "tokenizer.json").read_text())
    assert written["decoder"]["type"] == "ByteLevel" and written["model"]["byte_fallback"] is False
    assert AutoTokenizer.from_pretrained(str(out)).decode([1000, 2000, 30000]) == \
        AutoTokenizer.from_pretrained(str(source)).decode([1000, 2000, 30000])
