"""The engine's rooms: who owns what, one request check, the KV plan, and which way imports flow."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from engine_helpers import finished_outputs
from pagedserve.engine.engine import LLMEngine
from pagedserve.engine.validation import EngineLimits, validate_request
from pagedserve.errors import RequestError
from pagedserve.sampling_params import DEFAULT_SAMPLING, SamplingParams
from pagedserve.worker.prefill_warmup import prefill_warmup_sizes, warm_up_prefills, warmup_steps
from pagedserve.worker.worst_case_step import worst_case_step

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "pagedserve"


@pytest.fixture
def engine(tiny_checkpoint):
    _, path = tiny_checkpoint()
    return LLMEngine(model=str(path), device="cpu", num_kv_blocks=16, block_size=4, max_num_seqs=4)


def _free_blocks(engine: LLMEngine) -> int:
    return engine.stats()["num_free_blocks"] + engine.stats()["num_evictable_blocks"]


# ---------------------------------------------------------------------------- one request check
@pytest.mark.parametrize("prompt, params, field, code", [
    ([], SamplingParams(), "prompt", "empty_prompt"),
    ([5, 300], SamplingParams(), "prompt", "invalid_token_id"),
    ([5, -1], SamplingParams(), "prompt", "invalid_token_id"),
    ([5, 2**31], SamplingParams(), "prompt", "invalid_token_id"),
    ([5, "7"], SamplingParams(), "prompt", "invalid_type"),
    ([5], SamplingParams(stop_token_ids=[2**31]), "stop_token_ids", "invalid_token_id"),
    (list(range(40)), SamplingParams(max_tokens=40), "max_tokens", "context_length_exceeded"),
    (list(range(64)), SamplingParams(max_tokens=None), "prompt", "context_length_exceeded"),
    ([5], SamplingParams(max_tokens=None, min_tokens=500), "min_tokens", "context_length_exceeded"),
    ([5], SamplingParams(n=5), "n", "too_many"),
    ([5], SamplingParams(logprobs=21), "logprobs", "too_many"),
])
def test_refused_requests_name_their_field_and_leave_nothing_behind(engine, prompt, params, field, code):
    free = _free_blocks(engine)
    with pytest.raises(RequestError) as info:
        engine.add_request("r", prompt, params)
    assert (info.value.field, info.value.code) == (field, code)
    # The same function answers the same for the server and the CLI.
    with pytest.raises(RequestError) as again:
        validate_request(prompt, params, engine.limits)
    assert str(again.value) == str(info.value)
    assert not engine.has_unfinished_requests() and _free_blocks(engine) == free


def test_text_with_a_lone_surrogate_is_a_request_error(default_model_path):
    from pagedserve.engine.tokenizer import load_tokenizer
    from pagedserve.engine.validation import check_text

    with pytest.raises(RequestError, match="surrogate") as info:
        check_text("a\ud800b")
    assert info.value.field == "prompt" and info.value.code == "invalid_text"
    load_tokenizer(default_model_path).encode(check_text("a\U0001F600b"))  # a paired surrogate is fine


def test_request_errors_are_value_errors_with_a_field():
    with pytest.raises(ValueError) as info:
        SamplingParams(top_p=2.0)
    assert isinstance(info.value, RequestError) and info.value.field == "top_p"
    # Before the model loads, the limits are unknown: only what needs no engine is checked.
    validate_request([1, 2, 3], SamplingParams(n=1000, max_tokens=10**6), EngineLimits())


# ---------------------------------------------------------------------------- engine behaviour
def test_abort_returns_the_final_outputs_and_frees_blocks(engine):
    engine.add_request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=20, temperature=0, n=2))
    engine.step()
    assert engine.stats()["num_used_blocks"] > 0
    finals = engine.abort_request(["a", "never-added"])
    assert [o.request_id for o in finals] == ["a"] and finals[0].finished
    assert sorted(c.finish_reason for c in finals[0].outputs) == ["abort", "abort"]
    assert not engine.has_unfinished_requests() and engine.stats()["num_used_blocks"] == 0
    assert engine.step() == []


def test_tokens_are_recorded_by_the_next_launch_and_an_abort_keeps_them(engine):
    engine.add_request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=20, temperature=0), stream=False)
    for _ in range(3):
        engine.step()
    request = engine.requests["a"]
    assert len(request.samples[0].token_ids) == 2  # the third step's token waits for the next launch
    engine.step()
    assert len(request.samples[0].token_ids) == 3
    final = engine.abort_request("a")[0].outputs[0]
    assert len(final.token_ids) == 4 and final.finish_reason == "abort"  # the fourth step's token too


def test_prefix_cache_hit_is_reported_as_cached_tokens(engine):
    prompt = list(range(10, 21))  # 11 tokens: two full blocks of 4 can be cached
    engine.add_request("first", prompt, SamplingParams(max_tokens=2, temperature=0))
    assert finished_outputs(engine)["first"].num_cached_tokens == 0
    engine.add_request("second", prompt, SamplingParams(max_tokens=2, temperature=0))
    assert finished_outputs(engine)["second"].num_cached_tokens == 8
    # 9 tokens: the cache holds 8, so the prefill is one token, scheduled among the decodes.
    engine.add_request("third", prompt[:9], SamplingParams(max_tokens=2, temperature=0))
    engine.add_request("busy", [7, 7, 7], SamplingParams(max_tokens=6, temperature=0))
    engine.step()
    finals = finished_outputs(engine)
    assert finals["third"].num_cached_tokens == 8 and finals["third"].metrics.first_scheduled_time is not None


def test_info_carries_limits_and_the_models_sampling_defaults(tiny_checkpoint):
    _, path = tiny_checkpoint()
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": 20, "max_length": 9}))
    engine = LLMEngine(model=str(path), device="cpu", num_kv_blocks=16, block_size=4, max_num_seqs=4)
    info = engine.info()
    assert info.limits == EngineLimits(max_model_len=64, max_num_seqs=4, max_logprobs=20, vocab_size=256)
    assert info.default_sampling == {**DEFAULT_SAMPLING, "temperature": 0.6, "top_k": 20}
    assert info.device == "cpu" and info.model_path == path
    assert engine.default_sampling_params(max_tokens=3).temperature == 0.6


def test_snapshot_shows_the_block_map_and_queues(engine):
    engine.add_request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4, temperature=0))
    engine.step()
    snap = engine.snapshot()
    assert len(snap["block_states"]) == 16 and set(snap["block_states"]) <= set("0123")
    assert [r["id"] for r in snap["running"]] == ["a"] and snap["num_unfinished_requests"] == 1
    finished_outputs(engine)


# ---------------------------------------------------------------------------- the KV plan and worst case
def test_the_scheduler_is_sized_from_the_workers_kv_plan(tiny_checkpoint):
    _, path = tiny_checkpoint()
    engine = LLMEngine(model=str(path), device="cpu", kv_cache_memory_gb=1e-5, block_size=4)
    plan = engine.worker.kv_plan
    cfg = engine.scheduler.config
    assert (cfg.num_blocks, cfg.block_size, cfg.max_model_len) == (plan.num_blocks, 4, plan.max_model_len)
    assert plan.num_blocks == int(1e-5 * 2**30 // plan.bytes_per_block)
    # The model allows 128 positions; the pool holds fewer tokens, so max_model_len was lowered to fit.
    assert plan.max_model_len == plan.num_blocks * 4 < 128 and engine.limits.max_model_len == plan.max_model_len
    with pytest.raises(ValueError, match="max_model_len=100 needs"):
        LLMEngine(model=str(path), device="cpu", kv_cache_memory_gb=1e-5, block_size=4, max_model_len=100)


def test_worst_case_step_is_a_valid_prefill_step():
    step = worst_case_step(num_tokens=50, max_model_len=20, block_size=8, num_logit_rows=7, vocab_size=99)
    assert step.num_tokens == 50 and list(step.seq_lens) == [20, 20, 10]
    assert list(step.query_start_loc) == [0, 20, 40, 50] and step.num_decodes == 0
    assert len(set(step.slot_mapping.tolist())) == 50  # every token its own slot
    for row in range(step.num_seqs):
        lo, hi = step.query_start_loc[row], step.query_start_loc[row + 1]
        assert list(step.positions[lo:hi]) == list(range(hi - lo))
        blocks = step.slot_mapping[lo:hi] // 8
        assert set(blocks.tolist()) <= set(step.block_tables[row].tolist())
    assert list(step.logits_indices) == list(range(7)) and step.input_ids.max() < 99


def test_worst_case_step_runs_through_the_runner_on_cpu(engine):
    # the GPU profile's step, through StepInputs
    engine.worker._run_worst_case_step(engine.config, engine.worker.kv_plan.dtype)


def test_prefill_warmup_covers_every_small_count_then_powers_of_two_within_every_limit():
    dense = list(range(1, 65))
    assert prefill_warmup_sizes(8192, 4096, 256, 10_000, 16) == dense + [128, 256, 512]
    assert prefill_warmup_sizes(100, 4096, 256, 10_000, 16) == dense  # the token budget
    assert prefill_warmup_sizes(8192, 40, 256, 10_000, 16) == list(range(1, 41))  # the model length
    assert prefill_warmup_sizes(8192, 4096, 2, 3, 4) == list(range(1, 13))  # the KV cache's 3 blocks of 4
    prompt, rows = warmup_steps(24, 64, 16, 99)  # a 24-token prompt; 24 one-token sequences
    assert prompt.num_seqs == 1 and prompt.num_tokens == 24 and len(prompt.logits_indices) == 1
    assert rows.num_seqs == 24 and rows.num_tokens == 24 and len(rows.logits_indices) == 24
    assert [s.num_seqs for s in warmup_steps(300, 64, 16, 99)] == [1] and prompt.input_ids.max() < 99


def test_a_prefill_warmup_leaves_the_engine_as_it_found_it(tiny_checkpoint):
    """The GPU start-up's ladder, run here on a CPU engine's own runner and KV cache: every size runs, and
    the requests after it get the tokens and logprobs of an engine that never ran it."""
    _, path = tiny_checkpoint()
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True)
    outputs = []
    for warm in (False, True):
        engine = LLMEngine(model=str(path), device="cpu", num_kv_blocks=16, block_size=4, max_num_seqs=4)
        if warm:
            sizes = prefill_warmup_sizes(64, 64, 4, 16, 4)
            assert sizes == list(range(1, 65))
            assert warm_up_prefills(engine.worker.runner, sizes, 4, 4, 256) > 0
        free = engine.stats()["num_free_blocks"]  # free or evictable
        engine.add_request("a", [5, 6, 7, 8, 9], params)
        engine.add_request("b", list(range(10, 30)), params)
        finals = finished_outputs(engine)
        outputs.append({rid: ([c.token_ids for c in out.outputs], [c.logprobs for c in out.outputs])
                        for rid, out in finals.items()})
        assert engine.stats()["num_free_blocks"] == free
    assert outputs[0] == outputs[1]


# ---------------------------------------------------------------------------- layout
LAYERS = {  # package -> packages it must never import
    "models": ("engine", "worker", "server", "sample", "llm", "cli"),
    "sample": ("engine", "worker", "server", "models", "llm", "cli"),
    "worker": ("engine", "server", "llm", "cli"),
    "engine": ("server", "llm", "cli"),
    "server": ("worker", "llm", "cli"),
}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {n for n in names if n.startswith("pagedserve.")}


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_imports_flow_one_way(layer):
    offenders = []
    for path in (PACKAGE / layer).rglob("*.py"):
        for name in _imports(path):
            top = name.split(".")[1]
            if top in LAYERS[layer]:
                offenders.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert not offenders


def test_the_server_uses_only_the_engine_client_interface():
    reach = re.compile(r"(?<![\w.])engine\.(worker|scheduler|requests|config|model_config|tokenizer)\b")
    reaching = [f"{path.name}: {m.group(0)}" for path in (PACKAGE / "server").rglob("*.py")
                for m in reach.finditer(path.read_text())]
    assert not reaching


def test_no_module_is_much_over_300_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 320}
    assert not long
