"""The command line and LLM(**options) without a model: flags generated from EngineConfig, defaults shown
once, arguments rejected before anything heavy loads, --version and -v."""

from __future__ import annotations

import argparse
import inspect
import re
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

import pytest

from pagedserve import LLM, __version__
from pagedserve.cli import build_parser, main
from pagedserve.cli_args import GENERATION_CONFIG_KEYS, SAMPLING_FLAGS
from pagedserve.engine_config import EngineConfig, add_engine_args, engine_config_from_args

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "pagedserve"
HEAVY = ("torch", "transformers", "fastapi", "uvicorn", "numpy")


def engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser


def run_python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------------------- EngineConfig -> flags
def test_every_field_has_help_and_a_flag():
    parser = engine_parser()
    flags = {opt for action in parser._actions for opt in action.option_strings}
    for f in fields(EngineConfig):
        assert f.metadata.get("help"), f"{f.name} has no help text"
        assert "--" + f.name.replace("_", "-") in flags


def test_flag_defaults_are_the_config_defaults():
    assert engine_config_from_args(engine_parser().parse_args([])) == EngineConfig()


def test_help_shows_defaults_and_choices():
    text = " ".join(engine_parser().format_help().split())
    assert "(default: 16)" in text and "(default: 0.9)" in text and "(default: 20)" in text
    assert "{auto,bfloat16,float16,float32}" in text and "{cuda,cpu}" in text
    assert "{auto,safetensors,pt,dummy}" in text and "{auto,bfloat16,float32}" in text
    assert "(default: 256 on CUDA, 64 on CPU)" in text  # a device-dependent default says so


def test_boolean_flags_come_in_pairs_and_the_old_spelling_works():
    parser = engine_parser()
    assert engine_config_from_args(parser.parse_args(["--no-enable-prefix-caching"])).enable_prefix_caching is False
    assert engine_config_from_args(parser.parse_args(["--no-prefix-caching"])).enable_prefix_caching is False
    assert engine_config_from_args(parser.parse_args(["--enable-prefix-caching"])).enable_prefix_caching is True
    assert engine_config_from_args(parser.parse_args(["--enforce-eager"])).enforce_eager is True
    assert engine_config_from_args(parser.parse_args(["--no-enforce-eager"])).enforce_eager is False


def test_bad_choice_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        engine_parser().parse_args(["--dtype", "int8"])
    assert exit_info.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_every_config_field_is_read_somewhere():
    sources = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py") if p.name != "engine_config.py")
    unread = [f.name for f in fields(EngineConfig) if not re.search(rf"\.{f.name}\b", sources)]
    assert not unread, f"config nothing reads: {unread}"


# ---------------------------------------------------------------------------- LLM(**options)
def test_llm_rejects_unknown_options_before_loading():
    start = time.perf_counter()
    with pytest.raises(TypeError, match="max_num_sequences"):
        LLM(max_num_sequences=4)
    assert time.perf_counter() - start < 5  # no model was loaded


def test_llm_signature_lists_every_option_with_its_default():
    params = inspect.signature(LLM).parameters
    assert list(params)[0] == "model"
    for f in fields(EngineConfig):
        assert params[f.name].default == f.default
    assert set(LLM.options()) == {f.name for f in fields(EngineConfig)} - {"model"}


# ---------------------------------------------------------------------------- sampling flags
def test_sampling_flags_default_to_unset_and_say_where_defaults_come_from():
    args = build_parser().parse_args(["generate", "hi"])
    for name, _, _ in SAMPLING_FLAGS:
        assert getattr(args, name) is None, name
    assert args.stop is None and args.ignore_eos is None
    help_text = " ".join(subprocess.run([sys.executable, "-m", "pagedserve.cli", "generate", "--help"],
                                        capture_output=True, text=True, timeout=60).stdout.split())
    assert "--temperature X randomness; 0 = greedy (default: the model's generation_config.json, else 0.7)" \
        in help_text


def test_generation_config_keys_match_the_model_config():
    from pagedserve.models.model_config import GENERATION_SAMPLING_KEYS
    assert GENERATION_CONFIG_KEYS == GENERATION_SAMPLING_KEYS


# ---------------------------------------------------------------------------- --version, -v
def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"pagedserve {__version__}"


@pytest.mark.parametrize("argv", [["-v", "generate", "hi"], ["generate", "-v", "hi"], ["generate", "hi", "-v"],
                                  ["chat", "--verbose"], ["serve", "-v"]])
def test_verbose_before_or_after_the_subcommand(argv):
    assert build_parser().parse_args(argv).verbose is True


def test_not_verbose_by_default():
    assert build_parser().parse_args(["generate", "hi"]).verbose is False


def test_serve_takes_the_server_flags():
    args = build_parser().parse_args(["serve", "--port", "9000", "--api-key", "k", "--max-num-seqs", "4"])
    assert (args.port, args.api_key, args.max_num_seqs) == (9000, "k", 4)


# ---------------------------------------------------------------------------- quick paths
def test_help_imports_nothing_heavy():
    code = ("import sys\nfrom pagedserve.cli import build_parser\n"
            "for argv in ([], ['generate'], ['chat'], ['serve']):\n"
            "    try:\n        build_parser().parse_args(argv + ['--help'])\n    except SystemExit:\n        pass\n"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def _generate_before_loading(argv: list[str]):
    """Runs `pagedserve generate ARGV` in a fresh interpreter; asserts it failed with status 2 having
    imported nothing heavy, and returns the result."""
    code = ("import sys\nfrom pagedserve.cli import main\n"
            f"rc = main(['generate', *{argv!r}])\n"
            f"print(rc, sorted(m for m in {HEAVY!r} if m in sys.modules))")
    result = run_python(code)
    assert result.stdout.strip() == "2 []", result.stdout + result.stderr
    return result


@pytest.mark.parametrize("argv, message", [
    (["--max-tokens", "-1"], "argument --max-tokens: max_tokens must be at least 1, got -1"),
    (["--n", "0"], "argument --n: n must be at least 1, got 0"),
    (["--top-p", "2"], "argument --top-p: top_p must be in (0, 1], got 2.0"),
    (["--temperature", "-1"], "argument --temperature: temperature must be non-negative"),
])
def test_bad_sampling_flags_are_rejected_before_anything_loads(argv, message):
    result = _generate_before_loading(["Hi", *argv])
    assert result.stderr.strip() == f"pagedserve: error: {message}" or message in result.stderr


@pytest.mark.parametrize("prompt, message", [("", "the prompt is empty"), ("a\ud800b", "unpaired UTF-16 surrogate")])
def test_bad_prompts_are_rejected_before_anything_loads(prompt, message):
    result = _generate_before_loading([prompt])
    assert result.stderr.startswith("pagedserve: error: ") and message in result.stderr


def test_a_bad_model_directory_is_a_line_of_its_own(tmp_path):
    result = subprocess.run([sys.executable, "-m", "pagedserve.cli", "generate", "Hi", "--model", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    last = result.stderr.splitlines()[-1]
    assert last.startswith("pagedserve: error: ") and "config.json" in last  # on a line of its own
    assert "Traceback" not in result.stderr
