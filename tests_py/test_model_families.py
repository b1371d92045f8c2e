"""Every family (dense and MoE) and every RoPE type through pagedserve.LLM against transformers (float32, CPU).

Each case is a tiny random checkpoint built with transformers' own config class (no hub), saved once per
module; transformers' reference for each prompt (its generate() for 32 greedy tokens with the raw logits of
every step, and one forward over the prompt) is computed once and reused. Per case, one engine per
configuration, several checks per engine:

  whole prefill   7 prompts batched (1 to 45 tokens, longer than the sliding windows of 8), 32 greedy tokens:
                  token-identical to generate(); prompt and sampled logprobs within 1e-4 of transformers.
                  Blocks of 4 tokens, so every sequence's decode crosses several block boundaries.
  prefix cache    the same engine again on a repeated prompt and on one sharing its first 28 tokens:
                  cached tokens > 0, logprobs as the uncached run and as transformers.
  chunked         a 8-token step budget: prompts prefilled in chunks of at most 8, then decoded.
  preemption      a KV pool too small for three concurrent long requests: they are preempted and recomputed;
                  outputs equal the unpreempted run's and transformers'.
  longrope        sequences crossing original_max_position_embeddings while decoding, prompts longer than it
                  (whole and chunked), and the prefix cache across it; Phi-3 against its cached forward
                  (its generate() recomputes the cache at the crossing, see pagedserve/models/rope.py).

The README's table of supported architectures is checked against the model registry and these cases.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from hf_helpers import make_hf_model, round_to_bf16
from pagedserve import LLM, SamplingParams
from pagedserve.models.layers import Linear
from test_moe_families import CASES as MOE_CASES
from test_moe_families import hf_moe_model

TOL = 1e-4  # absolute, float32 logprobs against transformers
SAME_ENGINE_TOL = 1e-5  # the engine against itself (another batch, cache state): absolute, plus 1e-6 relative
NEW_TOKENS = 32
BLOCK = 4
COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, vocab_size=256, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)
WINDOW = 8
ORIGINAL = 32  # original_max_position_embeddings of the scaled ropes
PHI3_ORIGINAL = 80  # Phi-3 longrope: every prompt + 32 tokens stays below it (no crossing, see above)
LONGROPE = dict(rope_type="longrope", short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 3.5],
                long_factor=[1.0, 1.5, 2.5, 4.0, 6.0, 8.0, 10.0, 12.0], original_max_position_embeddings=ORIGINAL)
PHI4_LONGROPE = dict(LONGROPE, short_factor=LONGROPE["short_factor"][:6], long_factor=LONGROPE["long_factor"][:6],
                     partial_rotary_factor=0.75, original_max_position_embeddings=PHI3_ORIGINAL)
GEMMA3_ROPE = {"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
               "full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1e6)}

# name -> (transformers config class name, overrides)
DENSE_CASES = {
    "gemma": ("GemmaConfig", dict(hidden_act="gelu_pytorch_tanh")),
    "gemma2": ("Gemma2Config", dict(query_pre_attn_scalar=24, sliding_window=WINDOW, attn_logit_softcapping=2.0,
                                    final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3TextConfig", dict(query_pre_attn_scalar=24, sliding_window=WINDOW, rope_parameters=GEMMA3_ROPE,
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "phi3": ("Phi3Config", dict(tie_word_embeddings=False)),
    "phi3_window": ("Phi3Config", dict(sliding_window=WINDOW)),
    "phi4_mini_partial_longrope": ("Phi3Config", dict(rope_parameters=PHI4_LONGROPE,
                                                      original_max_position_embeddings=PHI3_ORIGINAL)),
    "phi2_parallel_partial": ("PhiConfig", dict(partial_rotary_factor=0.5, hidden_act="gelu_new")),
    "mistral_window": ("MistralConfig", dict(sliding_window=WINDOW)),
    "qwen2_window_layers": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "qwen3_qk_norm_bias": ("Qwen3Config", dict(attention_bias=True)),
    "olmo2": ("Olmo2Config", dict()),
    "granite": ("GraniteConfig", dict(embedding_multiplier=4.0, attention_multiplier=0.1, residual_multiplier=0.5,
                                      logits_scaling=2.0)),
    "smollm3_nope_layers": ("SmolLM3Config", dict(num_hidden_layers=4, no_rope_layer_interval=2)),
    "llama_rope_linear": ("LlamaConfig", dict(rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=1e4))),
    "llama_rope_dynamic": ("LlamaConfig", dict(rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=1e4))),
    "llama_rope_yarn": ("LlamaConfig", dict(rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=1e4,
                                                                 original_max_position_embeddings=ORIGINAL))),
    "llama_rope_longrope": ("LlamaConfig", dict(rope_parameters=dict(LONGROPE, rope_theta=1e4))),
    "llama_rope_llama3": ("LlamaConfig", dict(rope_parameters=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                                   high_freq_factor=4.0, rope_theta=5e5,
                                                                   original_max_position_embeddings=ORIGINAL))),
}
CASES = list(DENSE_CASES) + list(MOE_CASES)  # every family case the battery below runs
WINDOWED = ("gemma2", "gemma3", "phi3_window", "mistral_window", "qwen2_window_layers")
# The rope types covered: default everywhere else; gemma3's global layers take "linear" too.
ROPE_TYPE_CASES = {"default": "gemma", "linear": "llama_rope_linear", "dynamic": "llama_rope_dynamic",
                   "yarn": "llama_rope_yarn", "longrope": "llama_rope_longrope", "llama3": "llama_rope_llama3"}
# longrope case -> its original_max_position_embeddings
LONGROPE_CASES = {"llama_rope_longrope": ORIGINAL, "phi4_mini_partial_longrope": PHI3_ORIGINAL}

PROMPT_LENGTHS = (23, 5, 40, 1, 17, 36, 45)
PREEMPT_LENGTHS = (40, 36, 45)  # all longer than ORIGINAL and, with 32 tokens, shorter than PHI3_ORIGINAL
PREEMPT_KV_BLOCKS = 32  # the three prompts fit (31 blocks of 4); their 32 tokens each (24 more blocks) do not
CHUNK_BUDGET = 8
CHUNKED_TOKENS = 8  # the chunked run checks its prefills and the first decode steps


def hf_family_model(name: str, bf16_exact: bool = False):
    if name in MOE_CASES:
        return hf_moe_model(name, bf16_exact=bf16_exact)
    import transformers

    class_name, overrides = DENSE_CASES[name]
    model = make_hf_model(getattr(transformers, class_name), seed=zlib.crc32(name.encode()) % 1000,
                          **{**COMMON, **overrides})
    return round_to_bf16(model) if bf16_exact else model


def prompts() -> list[list[int]]:
    """Token ids from 0 (the pad id, see hf_generate) to 255, some lengths over the windows and ORIGINAL."""
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(0, 256, (length,), generator=generator).tolist() for length in PROMPT_LENGTHS]


def prompt_of_length(n: int) -> list[int]:
    return next(p for p in prompts() if len(p) == n)


@dataclass
class Reference:
    tokens: list[int]  # generate()'s greedy continuation
    prompt_logprobs: torch.Tensor  # [len(prompt) - 1]: logprob of prompt token i given tokens [0, i)
    step_logprobs: torch.Tensor  # [steps, vocab]: log_softmax of generate()'s raw logits at each step


def hf_generate(hf_model, prompt: list[int], num_tokens: int = NEW_TOKENS) -> Reference:
    with torch.no_grad():
        ids = torch.tensor([prompt])  # an explicit mask: generate would mask a prompt token equal to pad_token_id
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_tokens,
                                min_new_tokens=num_tokens, do_sample=False, pad_token_id=0, output_logits=True,
                                return_dict_in_generate=True)
        prompt_lp = hf_model(ids).logits[0, :-1].float().log_softmax(-1)
    return Reference(out.sequences[0, len(prompt):].tolist(),
                     prompt_lp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:], dtype=torch.long)],
                     torch.stack([step[0].float().log_softmax(-1) for step in out.logits]))


@dataclass
class Case:
    name: str
    hf_model: object
    path: Path
    _references: dict = field(default_factory=dict)

    def reference(self, prompt: list[int]) -> Reference:
        """transformers' reference for a prompt, computed once per case."""
        key = tuple(prompt)
        if key not in self._references:
            self._references[key] = hf_generate(self.hf_model, prompt)
        return self._references[key]


# min_tokens masks EOS exactly as transformers' min_new_tokens does.
def greedy(num_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=num_tokens, min_tokens=num_tokens, prompt_logprobs=0,
                          logprobs=0)


def make_llm(path, **options) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", **{"block_size": BLOCK, "max_num_seqs": 8,
                                                            "num_kv_blocks": 128, **options})


def run(llm: LLM, batch: list[list[int]], num_tokens: int = NEW_TOKENS):
    return llm.generate([{"prompt_token_ids": p} for p in batch], greedy(num_tokens), use_tqdm=False)


def engine_logprobs(out) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt logprobs [len(prompt) - 1], logprobs of the sampled tokens), float64."""
    prompt = out.prompt_token_ids
    got_prompt = [out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))] \
        if out.prompt_logprobs else []
    completion = out.outputs[0]
    got_steps = [entry[token].logprob for token, entry in zip(completion.token_ids, completion.logprobs)]
    return torch.tensor(got_prompt, dtype=torch.float64), torch.tensor(got_steps, dtype=torch.float64)


def check_against_transformers(case: Case, outs, tol: float = TOL, prompt_logprobs: bool = True) -> float:
    """Token-identical to generate(), logprobs (prompt_logprobs: the prompt's too) within tol of transformers;
    returns the largest difference."""
    worst = 0.0
    for out in outs:
        prompt, completion = out.prompt_token_ids, out.outputs[0]
        ref = case.reference(prompt)
        steps = len(completion.token_ids)
        assert completion.token_ids == ref.tokens[:steps], f"{case.name}: prompt of {len(prompt)} tokens"
        got_prompt, got_steps = engine_logprobs(out)
        want_steps = ref.step_logprobs[torch.arange(steps), torch.tensor(completion.token_ids)].double()
        for what, got, want in (("prompt", got_prompt, ref.prompt_logprobs.double()), ("decode", got_steps,
                                                                                         want_steps)):
            if len(got) and (prompt_logprobs or what == "decode"):
                error = (got - want).abs().max().item()
                assert error < tol, f"{case.name}: {what} logprob error {error:.2e}, prompt of {len(prompt)} tokens"
                worst = max(worst, error)
    return worst


def check_same_outputs(outs, baseline) -> None:
    """The same requests through another engine state: identical tokens, logprobs within SAME_ENGINE_TOL."""
    for out, base in zip(outs, baseline):
        assert out.prompt_token_ids == base.prompt_token_ids
        assert out.outputs[0].token_ids == base.outputs[0].token_ids[:len(out.outputs[0].token_ids)]
        (a_prompt, a_steps), (b_prompt, b_steps) = engine_logprobs(out), engine_logprobs(base)
        torch.testing.assert_close(a_prompt, b_prompt, rtol=1e-6, atol=SAME_ENGINE_TOL)
        torch.testing.assert_close(a_steps, b_steps[:len(a_steps)], rtol=1e-6, atol=SAME_ENGINE_TOL)


@pytest.fixture(scope="module", params=CASES)
def case(request, tmp_path_factory) -> Case:
    hf_model = hf_family_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(path)
    return Case(request.param, hf_model, path)


@pytest.fixture(scope="module")
def whole(case):
    """One engine per case (blocks of 4, prefix caching on) and its outputs for every prompt."""
    llm = make_llm(case.path)
    return llm, run(llm, prompts())


def test_whole_prefill_and_32_greedy_tokens(case, whole):
    llm, outs = whole
    assert all(len(o.outputs[0].token_ids) == NEW_TOKENS for o in outs)
    assert NEW_TOKENS >= 4 * BLOCK, "each sequence's decode crosses several block boundaries"
    if case.name in WINDOWED:
        assert sum(len(p) > WINDOW for p in prompts()) >= 4, "prompts longer than the window"
    worst = check_against_transformers(case, outs)
    stats = llm.llm_engine.stats()
    assert stats["num_preemptions"] == 0, "the unpreempted baseline"
    print(f"\n{case.name} whole: max |logprob - transformers| = {worst:.2e}")


def test_prefix_cache_hit(case, whole):
    llm, first = whole
    repeated = prompt_of_length(40)
    shared = repeated[:28] + prompt_of_length(23)[:10]  # 7 blocks of the first, then its own (38 > ORIGINAL)
    if llm.llm_engine.model_config.kv_window:
        # Every layer slides: KV behind the window is freed, so a request asking prompt logprobs computes its
        # prompt anew (no cache hit); the others take the hit as usual.
        assert run(llm, [repeated])[0].num_cached_tokens == 0
        plain = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=0)
        again = llm.generate([{"prompt_token_ids": p} for p in (repeated, shared)], plain, use_tqdm=False)
        assert again[0].num_cached_tokens >= 36 and again[1].num_cached_tokens >= 28
        check_against_transformers(case, again, prompt_logprobs=False)
        return
    again = run(llm, [repeated, shared])
    assert again[0].num_cached_tokens >= 36 and again[1].num_cached_tokens >= 28, \
        [o.num_cached_tokens for o in again]
    check_same_outputs(again[:1], [first[PROMPT_LENGTHS.index(40)]])
    # Longrope too: the recomputed prefix-cached positions take the rope rows of the whole prompt's length
    # (AttentionMetadata.prompt_lens), as the uncached prefill and transformers' forward do.
    check_against_transformers(case, again)


def test_chunked_prefill(case, whole):
    batch = prompts()  # with longrope (Llama's ORIGINAL 32) prompts of 36 to 45 tokens: every chunk takes the long
    # rows, as transformers' one forward over the prompt does (AttentionMetadata.prompt_lens)
    llm = make_llm(case.path, block_size=16, max_num_batched_tokens=CHUNK_BUDGET, enable_prefix_caching=False)
    steps = [0]
    step = llm.llm_engine.step

    def counted_step():
        steps[0] += 1
        return step()

    llm.llm_engine.step = counted_step
    outs = run(llm, batch, CHUNKED_TOKENS)
    assert steps[0] >= sum(map(len, batch)) // CHUNK_BUDGET, "prompts prefilled in chunks"
    by_prompt = {tuple(o.prompt_token_ids): o for o in whole[1]}
    check_same_outputs(outs, [by_prompt[tuple(p)] for p in batch])
    worst = check_against_transformers(case, outs)
    print(f"\n{case.name} chunked: max |logprob - transformers| = {worst:.2e}")


def test_forced_preemption(case, whole):
    batch = [prompt_of_length(n) for n in PREEMPT_LENGTHS]
    llm = make_llm(case.path, num_kv_blocks=PREEMPT_KV_BLOCKS)
    if llm.llm_engine.model_config.kv_window:
        # Every layer slides, so a sequence holds at most its window's blocks (3 here): only a pool of less than
        # two windows, filled 4 tokens a step, forces preemption.
        llm = make_llm(case.path, num_kv_blocks=5, max_num_batched_tokens=4, max_num_seqs=4)
    outs = run(llm, batch)
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "the pool was meant to force preemption"
    stats = llm.llm_engine.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"], "every block returns to the pool"
    by_prompt = {tuple(o.prompt_token_ids): o for o in whole[1]}
    check_same_outputs(outs, [by_prompt[tuple(p)] for p in batch])
    check_against_transformers(case, outs)


def hf_cached_greedy(hf_model, prompt: list[int], num_tokens: int = NEW_TOKENS) -> Reference:
    """transformers' greedy decode through its model forward and a DynamicCache, one token a step: each step's
    rope follows that forward's own length rule, with none of a generate() override's extras (Phi-3's
    prepare_inputs_for_generation drops the cache where a sequence first exceeds the original length)."""
    from transformers import DynamicCache

    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = hf_model(ids, past_key_values=DynamicCache(config=hf_model.config), use_cache=True)
        prompt_lp = out.logits[0, :-1].float().log_softmax(-1)
        tokens, steps = [], []
        for i in range(num_tokens):
            steps.append(out.logits[0, -1].float().log_softmax(-1))
            choice = steps[-1].clone()
            choice[COMMON["eos_token_id"]] = -float("inf")  # generate()'s min_new_tokens: EOS is never chosen
            tokens.append(int(choice.argmax()))
            out = hf_model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True,
                           position_ids=torch.tensor([[len(prompt) + i]]))
    return Reference(tokens, prompt_lp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:], dtype=torch.long)],
                     torch.stack(steps))


@pytest.mark.parametrize("name", list(LONGROPE_CASES))
def test_longrope_across_original_length(name, tmp_path):
    """Longrope on both sides of original_max_position_embeddings, against transformers:
    - prompts that cross it while decoding: new tokens take the long factors, cached ones stay short (the
      rule of transformers' cached forward; for Phi-3 whose generate() recomputes its cache at the crossing,
      compared with that forward one step at a time, hf_cached_greedy);
    - a prompt longer than the limit, whole and prefilled in chunks of 8: every position long;
    - the prefix cache never hands a long prompt's blocks to a short prompt sharing its tokens (salted hash)."""
    original = LONGROPE_CASES[name]
    hf_model = hf_family_model(name)
    hf_model.save_pretrained(tmp_path)
    case = Case(name, hf_model, tmp_path)
    generator = torch.Generator().manual_seed(5)
    long_prompt = torch.randint(0, 256, (original + 5,), generator=generator).tolist()
    crossing = [long_prompt[:original - 10], long_prompt[:original - 1], long_prompt[:original]]
    for prompt in crossing:
        case._references[tuple(prompt)] = hf_cached_greedy(hf_model, prompt)
    check_against_transformers(case, run(make_llm(tmp_path), crossing + [long_prompt]))
    chunked = make_llm(tmp_path, block_size=16, max_num_batched_tokens=CHUNK_BUDGET, enable_prefix_caching=False)
    check_against_transformers(case, run(chunked, [long_prompt, crossing[0]], CHUNKED_TOKENS))
    cached = make_llm(tmp_path)
    run(cached, [long_prompt], 1)
    short = run(cached, [crossing[1]], 4)  # shares the long prompt's first blocks token for token
    assert short[0].num_cached_tokens == 0, "a long prompt's (long-rope) blocks served a short prompt"
    again = run(cached, [long_prompt[:-1]], 4)
    assert again[0].num_cached_tokens > 0, "long prompts share their blocks with each other"
    check_against_transformers(case, short + again)


FUSED_CASES = ("phi4_mini_partial_longrope", "qwen3_qk_norm_bias", "qwen2_window_layers", "smollm3_nope_layers")


@pytest.mark.parametrize("name", ["gemma2", "olmo2", "granite", "phi2_parallel_partial", *FUSED_CASES])
def test_packed_bf16_cpu_path(name, tmp_path):
    """bf16-exact weights: "auto" packs every linear as bf16 tiles; results as transformers' float32. The
    pre-norm gated-MLP families run every layer as one C++ call (models/fused_layers.py), the others per op."""
    hf_model = hf_family_model(name, bf16_exact=True)
    hf_model.save_pretrained(tmp_path)
    llm = make_llm(tmp_path)
    model = llm.llm_engine.worker.model
    assert all(m.kernel is not None for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head)
    assert (model.model.fused is not None) is (name in FUSED_CASES)
    check_against_transformers(Case(name, hf_model, tmp_path), run(llm, prompts()[:3], 6))


# -- the README's table of supported architectures -------------------------------------------------------------

README = Path(__file__).resolve().parents[1] / "README.md"


def case_architecture(name: str) -> str:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if name in MOE_CASES:
        from test_moe_families import _config_classes

        config_cls = _config_classes()[MOE_CASES[name][0]]
    else:
        config_cls = getattr(transformers, DENSE_CASES[name][0])
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config_cls.model_type]


def readme_architectures() -> dict[str, list[str]]:
    """The README's table: architecture -> the test cases its last column names."""
    rows = {}
    for line in README.read_text().splitlines():
        match = re.match(r"\|\s*`(\w+ForCausalLM)`\s*\|.*\|\s*([^|]*)\|\s*$", line)
        if match:
            rows[match.group(1)] = re.findall(r"`(\w+)`", match.group(2))
    return rows


def test_readme_table_equals_the_registry_and_the_cases():
    from pagedserve.models import MODEL_REGISTRY

    table = readme_architectures()
    assert list(table) == list(MODEL_REGISTRY), "README table rows: one per registered architecture, in order"
    by_architecture: dict[str, list[str]] = {}
    for name in CASES:
        by_architecture.setdefault(case_architecture(name), []).append(name)
    assert set(by_architecture) == set(MODEL_REGISTRY), "every architecture has a case here"
    for architecture, names in table.items():
        assert sorted(names) == sorted(by_architecture[architecture]), architecture
    assert set(ROPE_TYPE_CASES.values()) <= set(CASES)
