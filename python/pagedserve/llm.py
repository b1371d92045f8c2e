"""LLM: offline batched generation, the vLLM way.

    from pagedserve import LLM, SamplingParams
    llm = LLM()                                  # the default model
    outs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

from pagedserve.engine import LLMEngine, PromptType
from pagedserve.engine_config import EngineConfig
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.tokenizer import apply_chat_template

Messages = list[dict]


class LLM:
    def __init__(self, model: Optional[str] = None, *, dtype: str = "auto", max_model_len: Optional[int] = None,
                 block_size: int = 16, enable_prefix_caching: bool = True, max_num_seqs: Optional[int] = None,
                 max_num_batched_tokens: Optional[int] = None, seed: int = 0, load_format: str = "auto",
                 device: Optional[str] = None, gpu_memory_utilization: float = 0.9,
                 kv_cache_memory_gb: Optional[float] = None, num_kv_blocks: Optional[int] = None,
                 enforce_eager: bool = False, max_logprobs: int = 20, cpu_weight_dtype: str = "auto"):
        config = EngineConfig(model=model, dtype=dtype, device=device, load_format=load_format, seed=seed,
                              max_model_len=max_model_len, block_size=block_size,
                              enable_prefix_caching=enable_prefix_caching, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens,
                              gpu_memory_utilization=gpu_memory_utilization, kv_cache_memory_gb=kv_cache_memory_gb,
                              num_kv_blocks=num_kv_blocks, enforce_eager=enforce_eager, max_logprobs=max_logprobs,
                              cpu_weight_dtype=cpu_weight_dtype)
        self.llm_engine = LLMEngine(config)
        self._counter = 0

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
        if sampling_params is None:
            sampling_params = SamplingParams()
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
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Applies the model's chat template to each conversation, then generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.get_tokenizer()
        prompts = [{"prompt_token_ids": apply_chat_template(tok, conv, add_generation_prompt=add_generation_prompt)}
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
