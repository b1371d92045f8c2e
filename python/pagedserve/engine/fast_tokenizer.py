"""FastTokenizer: a model directory's tokenizer.json and chat template, without transformers.

Importing transformers and building its tokenizer costs seconds on a small
CPU, most of a command's start-up. For a directory saved as a plain
``PreTrainedTokenizerFast`` (tokenizer.json + tokenizer_config.json, as the
default model is) the `tokenizers` library does the same work: this class
wraps it with the part of the transformers tokenizer interface pagedserve
uses (encode, decode, ``__call__``, token <-> id, special tokens,
``apply_chat_template`` by transformers' own renderer,
``backend_tokenizer`` for the detokenizer). ``load_fast_tokenizer`` returns
None for any other directory, whose tokenizer class may change the pipeline:
load those with transformers.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

# tokenizer_config.json classes whose tokenizer is exactly tokenizer.json's pipeline.
PLAIN_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def can_load_fast(model_dir: Union[str, Path]) -> bool:
    """Whether ``model_dir``'s tokenizer is plain tokenizer.json (what FastTokenizer reproduces)."""
    path = Path(model_dir)
    if not (path / "tokenizer.json").is_file():
        return False
    config = _read_json(path / "tokenizer_config.json")
    return config.get("tokenizer_class", "PreTrainedTokenizerFast") in PLAIN_TOKENIZER_CLASSES


def load_fast_tokenizer(model_dir: Union[str, Path]) -> Optional["FastTokenizer"]:
    """The directory's tokenizer as a FastTokenizer, or None where only transformers can load it.

    Loads of an unchanged directory share one instance (the CLI tokenizes the prompt before the
    engine loads, then the engine asks again): treat it as read-only."""
    if not can_load_fast(model_dir):
        return None
    path = Path(model_dir).resolve()
    stamps = tuple(_mtime(path / name) for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"))
    return _load_cached(str(path), stamps)


@lru_cache(maxsize=4)
def _load_cached(path: str, stamps: tuple) -> "FastTokenizer":
    return FastTokenizer(path)


def _mtime(path: Path) -> Optional[int]:
    try:
        return path.stat().st_mtime_ns
    except FileNotFoundError:
        return None


class Encoding(dict):
    """What ``tokenizer(text)`` returns: a dict with attribute access (``.input_ids``)."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class FastTokenizer:
    def __init__(self, model_dir: Union[str, Path]):
        from tokenizers import Tokenizer

        path = Path(model_dir)
        self.name_or_path = str(path)
        self.backend_tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.backend_tokenizer.no_padding()
        self.backend_tokenizer.no_truncation()
        config = _read_json(path / "tokenizer_config.json")
        legacy_map = _read_json(path / "special_tokens_map.json")
        tokens = {name: _token_text(config.get(name, legacy_map.get(name))) for name in SPECIAL_TOKEN_NAMES}
        self._special = {name: text for name, text in tokens.items() if text is not None}
        extra = config.get("extra_special_tokens", config.get("additional_special_tokens", []))
        self._extra_special = [_token_text(t) for t in (extra.values() if isinstance(extra, dict) else extra or [])]
        self.model_max_length = config.get("model_max_length")
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        # BOS / EOS come from tokenizer.json's post-processor alone: with a tokenizer.json, transformers
        # ignores tokenizer_config.json's add_bos_token / add_eos_token too.
        template_file = path / "chat_template.jinja"
        self.chat_template: Optional[str] = (template_file.read_text(encoding="utf-8") if template_file.is_file()
                                             else config.get("chat_template"))
        if isinstance(self.chat_template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in self.chat_template}
            self.chat_template = named.get("default")

    # ------------------------------------------------------------------ special tokens
    def __getattr__(self, name: str) -> Any:
        # bos_token, eos_token_id, ... (None when the tokenizer has none)
        if name in SPECIAL_TOKEN_NAMES:
            return self.__dict__.get("_special", {}).get(name)
        if name.endswith("_id") and name[:-3] in SPECIAL_TOKEN_NAMES:
            text = self.__dict__.get("_special", {}).get(name[:-3])
            return None if text is None else self.convert_tokens_to_ids(text)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return dict(self._special)

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys([*self._special.values(), *self._extra_special]))

    @property
    def all_special_ids(self) -> list[int]:
        return [self.convert_tokens_to_ids(t) for t in self.all_special_tokens]

    # ------------------------------------------------------------------ vocabulary
    @property
    def vocab_size(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens: Union[str, Sequence[str]]) -> Union[Optional[int], list[Optional[int]]]:
        if isinstance(tokens, str):
            return self.backend_tokenizer.token_to_id(tokens)
        return [self.backend_tokenizer.token_to_id(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: Union[int, Iterable[int]],
                              skip_special_tokens: bool = False) -> Union[Optional[str], list[Optional[str]]]:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        special = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids if int(i) not in special]

    # ------------------------------------------------------------------ text <-> ids
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def __call__(self, text: str, add_special_tokens: bool = True) -> Encoding:
        ids = self.encode(text, add_special_tokens=add_special_tokens)
        return Encoding(input_ids=ids, attention_mask=[1] * len(ids))

    def decode(self, token_ids: Union[int, Sequence[int]], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: Optional[bool] = None) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else [int(t) for t in token_ids]
        text = self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        clean = self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None else clean_up_tokenization_spaces
        if clean and type(self.backend_tokenizer.model).__name__ != "BPE":  # transformers skips it for BPE too
            text = _clean_up_tokenization(text)
        return text

    def batch_decode(self, sequences: Iterable[Sequence[int]], **kwargs) -> list[str]:
        return [self.decode(ids, **kwargs) for ids in sequences]

    # ------------------------------------------------------------------ chat
    def apply_chat_template(self, conversation: Sequence[Mapping[str, Any]], tokenize: bool = True,
                            add_generation_prompt: bool = False, chat_template: Optional[str] = None,
                            tools: Optional[list] = None, documents: Optional[list] = None,
                            continue_final_message: bool = False, **kwargs) -> Union[str, list[int]]:
        """Rendered by transformers' own template renderer (the same sandbox, helpers and tool-schema
        handling; importing just that module costs ~0.7 s, the whole tokenizer stack seconds)."""
        from transformers.utils.chat_template_utils import render_jinja_template

        template = chat_template or self.chat_template
        if template is None:
            raise ValueError(f"the tokenizer {self.name_or_path!r} has no chat template")
        rendered, _ = render_jinja_template(
            conversations=[list(conversation)], tools=tools, documents=documents, chat_template=template,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            **{**self._special, **kwargs})
        text = rendered[0]
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def __repr__(self) -> str:
        return f"FastTokenizer({self.name_or_path!r}, vocab={len(self)})"


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}


def _token_text(token: Any) -> Optional[str]:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(token, dict):
        return token.get("content")
    return token


def _clean_up_tokenization(text: str) -> str:
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


__all__ = ["FastTokenizer", "can_load_fast", "load_fast_tokenizer"]
