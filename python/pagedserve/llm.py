"""LLM: offline batched generation, the vLLM way.

    from pagedserve import LLM, SamplingParams
    llm = LLM()                                  # the default model
    outs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Optional, Sequence, Union

from pagedserve.engine.engine import LLMEngine
from pagedserve.engine_config import EngineConfig, option_help
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.engine.tokenizer import PromptType, apply_chat_template

Messages = list[dict]


class LLM:
    """Offline generation over one LLMEngine.

    LLM(model=None, **options): `model` is a local HF-format directory (None: the default model); every
    option is an EngineConfig field (dtype, device, max_model_len, ...; see `LLM.options()`), with the same
    defaults as the command line's flags. An unknown option is a TypeError naming it.
    """

    def __init__(self, model: Optional[str] = None, **options: Any):
        config = EngineConfig(model=model).with_updates(**options)  # TypeError for an unknown option
        self.llm_engine = LLMEngine(config)
        self._counter = 0

    @staticmethod
    def options() -> dict[str, str]:
        """Every option LLM(**options) takes, with its help text and default."""
        return {f.name: option_help(f) for f in fields(EngineConfig) if f.name != "model"}

    def shutdown(self) -> None:
        """Frees the engine's device memory now (see LLMEngine.shutdown)."""
        self.llm_engine.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. A prompt is a string, a list of
        token ids, or {"prompt_token_ids": [...]}."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and
                                                isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:  # the model's defaults (generation_config.json), as vLLM does
            sampling_params = SamplingParams(**self.llm_engine.info().default_sampling)
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else \
            [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        engine = self.llm_engine
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                rid = str(self._counter)
                self._counter += 1
                engine.add_request(rid, prompt, p, stream=False)
                ids.append(rid)
        except Exception:
            engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: Union[Messages, Sequence[Messages]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, chat_template: Optional[str] = None,
             continue_final_message: bool = False,
             chat_template_kwargs: Optional[dict[str, Any]] = None,
             tools: Optional[list[dict[str, Any]]] = None) -> list[RequestOutput]:
        """Applies the model's chat template (or `chat_template`, its text) to each conversation, then
        generates. continue_final_message (with add_generation_prompt=False) continues the last
        assistant message; chat_template_kwargs become template variables (e.g. enable_thinking);
        tools (OpenAI function tools) are given to the template, as vLLM's LLM.chat does (the reply is
        text: the server's tool_choice and parsers are the API's)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.get_tokenizer()
        prompts = [{"prompt_token_ids": apply_chat_template(
            tok, conv, add_generation_prompt=add_generation_prompt, chat_template=chat_template,
            continue_final_message=continue_final_message, chat_template_kwargs=chat_template_kwargs, tools=tools)}
            for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        pending = set(request_ids)
        finals: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while pending:
                for out in engine.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        finals[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            engine.abort_request(list(pending))
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finals[rid] for rid in request_ids]


def _signature():
    """LLM's signature as help() and IDEs show it: model, then every EngineConfig option with its default."""
    import inspect

    options = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default)
               for f in fields(EngineConfig) if f.name != "model"]
    return inspect.Signature([inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None),
                              *options])


LLM.__signature__ = _signature()
