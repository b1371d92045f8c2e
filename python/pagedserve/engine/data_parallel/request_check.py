"""What a replica could refuse, checked in the server process before a request is routed, so that
add_request raises its RequestError at once (the server's 400) rather than from another process a
step later: the prompt's form and limits (validation.validate_request) and a structured-outputs spec
that does not compile (compiled here too, once per spec: the compiled grammars are cached)."""

from __future__ import annotations

from typing import Optional

from pagedserve.engine.grammar import Grammars
from pagedserve.engine.info import EngineInfo
from pagedserve.engine.tokenizer import encode_prompt
from pagedserve.engine.validation import check_text, validate_request
from pagedserve.errors import RequestError
from pagedserve.sampling_params import SamplingParams


class RequestCheck:
    def __init__(self, info: EngineInfo, eos_token_ids: list[int]):
        self._info = info
        self._eos = list(eos_token_ids)
        self._grammars: Optional[Grammars] = None  # built on the first structured request

    def prompt(self, prompt: dict, params: SamplingParams) -> tuple[Optional[str], list[int]]:
        """(text, token ids) of a prompt dict ({"prompt": text | None, "prompt_token_ids": [...]}, or
        {"prompt": text} to tokenize here), checked against the engine's limits with its params."""
        if not isinstance(prompt, dict) or ("prompt_token_ids" not in prompt and "prompt" not in prompt):
            raise RequestError("a prompt is a dict with 'prompt_token_ids' (or 'prompt' text)", "prompt")
        text = prompt.get("prompt")
        if "prompt_token_ids" in prompt:
            ids = list(prompt["prompt_token_ids"])
        elif self._info.tokenizer is None:
            raise RequestError("this model directory has no tokenizer: pass prompt token ids", "prompt",
                               "no_tokenizer")
        else:
            ids = encode_prompt(self._info.tokenizer, check_text(text))
        ids = validate_request(ids, params, self._info.limits)
        self._grammar(params)
        return text, ids

    def _grammar(self, params: SamplingParams) -> None:
        spec = params.structured_outputs
        if spec is None:
            return
        if self._info.tokenizer is None:
            raise RequestError("structured_outputs needs the model's tokenizer", "structured_outputs",
                               "no_tokenizer")
        if self._grammars is None:
            self._grammars = Grammars(self._info.model_path, self._info.limits.vocab_size, self._eos, max_rows=1,
                                     backend=self._info.structured_outputs_backend)
        self._grammars.compile(spec)  # RequestError when it does not
