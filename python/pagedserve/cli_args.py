"""The `pagedserve` command's shared flags: sampling, -v, and the SamplingParams they make.

Sampling flags default to unset (None): an unset field takes the engine's
default, `LLMEngine.info().default_sampling` (the model's generation_config.json
over sampling_params.DEFAULT_SAMPLING), then SamplingParams' own default, the
same defaults the server and `LLM.generate` use. Importing this module stays
light (no torch), so `--help` and argument errors are quick.
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any, Mapping, Optional

from pagedserve.sampling_params import DEFAULT_SAMPLING, SamplingParams

# The keys a model's generation_config.json may set (models/model_config.py GENERATION_SAMPLING_KEYS;
# a test keeps the two equal without this module importing torch).
GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

# (SamplingParams field, type, help) of each sampling flag.
SAMPLING_FLAGS = (
    ("temperature", float, "randomness; 0 = greedy"),
    ("top_p", float, "sample from the smallest set of tokens whose probability reaches top_p"),
    ("top_k", int, "sample from the k most likely tokens; 0 = off"),
    ("min_p", float, "drop tokens less likely than min_p times the most likely one"),
    ("repetition_penalty", float, "above 1 discourages repeating any earlier token"),
    ("presence_penalty", float, "penalty for a token that appeared in the output at all"),
    ("frequency_penalty", float, "penalty per earlier occurrence of a token in the output"),
    ("n", int, "completions per prompt (parallel sampling)"),
)


def sampling_default(name: str) -> Any:
    """What an unset field becomes when the model sets nothing: DEFAULT_SAMPLING, else SamplingParams'."""
    if name in DEFAULT_SAMPLING:
        return DEFAULT_SAMPLING[name]
    return next(f.default for f in fields(SamplingParams) if f.name == name)


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    g = parser.add_argument_group("sampling", "Unset flags take the model's defaults, as the server and\n"
                                              "LLM.generate do.")
    g.add_argument("--max-tokens", type=int, default=max_tokens, metavar="N",
                   help=f"tokens to generate at most (default: {max_tokens})")
    for name, kind, text in SAMPLING_FLAGS:
        source = "the model's generation_config.json, else " if name in GENERATION_CONFIG_KEYS else ""
        g.add_argument("--" + name.replace("_", "-"), type=kind, default=None, metavar="N" if kind is int else "X",
                       help=f"{text} (default: {source}{sampling_default(name)})")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop when the output contains TEXT (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", default=None, help="keep generating past end-of-sequence")


def add_chat_template_arg(parser) -> None:
    """--chat-template FILE of `chat` and `serve` (`generate --chat-template` is a switch of its own)."""
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="Jinja chat template to use instead of the model's: a file, or the template text "
                             "itself (default: the model's)")


def read_chat_template(value: Optional[str]) -> Optional[str]:
    """The template text --chat-template names (a file, or inline Jinja); None when unset.
    Raises ValueError naming the flag for a file that cannot be read."""
    if value is None:
        return None
    from pathlib import Path

    path = Path(value).expanduser()
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"--chat-template: cannot read {value!r}: {err}") from None
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template: no such file {value!r} (and it is not a Jinja template)")


def add_verbose(parser: argparse.ArgumentParser, top_level: bool) -> None:
    """-v on the top-level parser and on each subcommand (`pagedserve generate -v ...`)."""
    parser.add_argument("-v", "--verbose", action="store_true", default=False if top_level else argparse.SUPPRESS,
                        help="log engine details to stderr")


def sampling_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The SamplingParams fields the command line sets (unset flags left out), with max_tokens and the seed."""
    names = ["max_tokens", "stop", "ignore_eos"] + [name for name, _, _ in SAMPLING_FLAGS]
    values = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    values["seed"] = args.seed
    return values


def build_sampling_params(overrides: Mapping[str, Any],
                          defaults: Optional[Mapping[str, Any]] = None) -> SamplingParams:
    """SamplingParams from the engine's defaults (DEFAULT_SAMPLING before it loads) under `overrides`.
    Raises RequestError (a ValueError) naming the flag at fault."""
    return SamplingParams(**{**(DEFAULT_SAMPLING if defaults is None else defaults), **overrides})
