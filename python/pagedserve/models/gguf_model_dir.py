"""A GGUF file as the engine sees a model: a small directory made once from the file's metadata.

The engine reads a model directory (config.json, generation_config.json, the
tokenizer with its chat template). For ``--model file.gguf`` those come from the
GGUF metadata: the config from the ``<arch>.*`` keys, mapped here; the tokenizer
and chat template built by transformers from ``tokenizer.ggml.*``
(``AutoTokenizer.from_pretrained(dir, gguf_file=...)``, some seconds for a large
vocabulary, hence the cache). The directory also names the GGUF file
(``GGUF_SOURCE_FILE``), which is where weights.load_weights reads the weights
from, blocks kept as they are (gguf_weights.py). No weights are copied.

Cache: ``<cache_dir>/gguf/<key>/<file stem>``, key = hash of the file's absolute
path, size and mtime, so an edited or replaced file gets a fresh directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

from pagedserve.models.gguf_file import GGUF_ARCHITECTURES, GgufFile, check_is_gguf

GGUF_SOURCE_FILE = "pagedserve_gguf_source.json"
_VERSION = 2  # 2: the tokenizer's decoder made canonical (models/tokenizer_json.py)


def gguf_model_dir(gguf_path: Path, cache_root: Path) -> Path:
    """The model directory of ``gguf_path`` under ``cache_root``, made on first use."""
    gguf_path = Path(gguf_path).expanduser().resolve()
    check_is_gguf(gguf_path)
    target = cache_root / "gguf" / _cache_key(gguf_path) / gguf_path.stem
    if _is_complete(target, gguf_path):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    gguf = GgufFile(gguf_path)  # validates architecture and tensor types before any slow work
    with tempfile.TemporaryDirectory(prefix=".work-", dir=target.parent) as work:
        staging = Path(work) / gguf_path.stem
        staging.mkdir()
        write_model_files(gguf, staging)
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(staging, target)
        except OSError:  # another process finished first
            if not _is_complete(target, gguf_path):
                raise
    return target


def gguf_source(model_dir: Path) -> Optional[Path]:
    """The GGUF file a directory made by gguf_model_dir stands for; None for an ordinary HF directory."""
    marker = Path(model_dir) / GGUF_SOURCE_FILE
    if not marker.is_file():
        return None
    return Path(json.loads(marker.read_text())["gguf"])


def write_model_files(gguf: GgufFile, out_dir: Path) -> None:
    (out_dir / "config.json").write_text(json.dumps(hf_config(gguf), indent=2, sort_keys=True) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps(generation_config(gguf), indent=2) + "\n")
    _write_tokenizer(gguf, out_dir)
    source = {"version": _VERSION, "gguf": str(gguf.path), "size": gguf.path.stat().st_size}
    (out_dir / GGUF_SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")


def hf_config(gguf: GgufFile) -> dict[str, Any]:
    """config.json from the GGUF's ``<arch>.*`` metadata (llama.cpp's names for the HF fields)."""
    num_heads = int(gguf.arch_value("attention.head_count"))
    hidden = int(gguf.arch_value("embedding_length"))
    tokens = gguf.value("tokenizer.ggml.tokens")
    vocab = gguf.arch_value("vocab_size") or (len(tokens) if tokens is not None else None)
    if vocab is None:
        vocab = len(gguf.tensors["token_embd.weight"].data)
    _reject_rope_scaling(gguf)
    config: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[gguf.architecture]],
        "model_type": gguf.architecture,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(gguf.arch_value("feed_forward_length")),
        "num_hidden_layers": int(gguf.arch_value("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(gguf.arch_value("attention.head_count_kv", num_heads)),
        "head_dim": int(gguf.arch_value("attention.key_length", hidden // num_heads)),
        "max_position_embeddings": int(gguf.arch_value("context_length", 2048)),
        "rms_norm_eps": float(gguf.arch_value("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(gguf.arch_value("rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "attention_bias": "blk.0.attn_q.bias" in gguf.tensors,
        "dtype": "float32",
    }
    for key, gguf_key in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                          ("eos_token_id", "tokenizer.ggml.eos_token_id")):
        if gguf.value(gguf_key) is not None:
            config[key] = int(gguf.value(gguf_key))
    return config


def generation_config(gguf: GgufFile) -> dict[str, Any]:
    config = {key: value for key, value in hf_config(gguf).items() if key in ("bos_token_id", "eos_token_id")}
    return config


def _reject_rope_scaling(gguf: GgufFile) -> None:
    scaling = gguf.arch_value("rope.scaling.type")
    if (scaling not in (None, "none")) or "rope_freqs.weight" in gguf.tensors:
        raise ValueError(f"{gguf.path.name} uses rope scaling ({scaling or 'rope_freqs'}), which pagedserve does "
                         "not read from GGUF files yet; use the model's Hugging Face directory instead")


def _write_tokenizer(gguf: GgufFile, out_dir: Path) -> None:
    """tokenizer.json + tokenizer_config.json (with the chat template) built by transformers from the metadata."""
    if gguf.value("tokenizer.ggml.model") is None:
        return  # no tokenizer in the file: the engine runs on token ids
    from transformers import AutoTokenizer

    from pagedserve.models.default_model import hub_offline, save_tokenizer

    with hub_offline():
        tokenizer = AutoTokenizer.from_pretrained(gguf.path.parent, gguf_file=gguf.path.name,
                                                  local_files_only=True)
    save_tokenizer(tokenizer, out_dir, int(gguf.arch_value("context_length", 2048)))


def _cache_key(path: Path) -> str:
    stat = path.stat()
    return hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]


def _is_complete(model_dir: Path, gguf_path: Path) -> bool:
    try:
        return gguf_source(model_dir) == gguf_path and (model_dir / "config.json").is_file()
    except (OSError, ValueError, KeyError):
        return False


__all__ = ["GGUF_SOURCE_FILE", "generation_config", "gguf_model_dir", "gguf_source", "hf_config"]
