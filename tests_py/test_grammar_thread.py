"""The grammar thread (engine/grammar_thread.py) against the engine's own thread: the same tokens, texts and
finish reasons for greedy requests under llguidance grammars, with steps run ahead, rows joining and
leaving, xgrammar rows beside them (those steps keep the engine's thread), stop strings, a grammar that
ends its sequence with EOS ignored, preemptions in a small pool and an abort; every block back after.

The thread takes a step's tokens as they reach the host, has each matcher consume its token and fills
the next masks while the engine records and schedules; the next draw, queued after its forward, waits for
them on its device (ops.wait_for_flag). On the CPU nothing overlaps, but the code is the one CUDA runs.
"""

from __future__ import annotations

import json

import pytest
import torch

from engine_helpers import finished_outputs
from pagedserve import LLM, SamplingParams, StructuredOutputsParams, _core

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
FRUITS = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 2, "maxItems": 4}


def workload() -> tuple[list[str], list[SamplingParams]]:
    prompts, params = [], []
    for i in range(14):
        kind = i % 7
        schema = PERSON if i % 2 else FRUITS
        so = StructuredOutputsParams(json=schema, disable_any_whitespace=i % 3 == 0)
        p = dict(structured_outputs=so, max_tokens=20 + 3 * i, temperature=0.0)
        if kind == 1:
            p.update(stop=['",'])  # a stop string ends it mid-grammar, found on the host a step later
        elif kind == 2:
            p.update(structured_outputs=None)  # unconstrained rows in the same steps
        elif kind == 3:
            p.update(ignore_eos=True, max_tokens=80)  # the grammar, not the scheduler, ends it at EOS
        elif kind == 4 and i < 7:
            # xgrammar's (a choice): the steps it is in keep the engine's thread
            p.update(structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"]), max_tokens=4)
        prompts.append(f"Describe person {i} as JSON:" if i % 2 else f"List {i} fruits as JSON:")
        params.append(SamplingParams(**p))
    return prompts, params


def outcome(output) -> tuple:
    c = output.outputs[0]
    return list(c.token_ids), c.text, c.finish_reason, c.stop_reason


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and _core.has_cuda else [])


@pytest.fixture(scope="module", params=DEVICES)
def engines(request, default_model_path):
    # CPU: 20 blocks of 16 tokens for 14 requests of up to ~100 tokens: preemptions while they run. CUDA: the
    # loops' batches differ, so products must not depend on the batch (batch_invariant, whole prompts, no
    # prefix cache, the default pool; as tests_py/test_async_scheduling.py).
    if request.param == "cpu":
        setting = dict(num_kv_blocks=20)
    else:
        setting = dict(batch_invariant=True, enable_prefix_caching=False, max_num_batched_tokens=2048,
                       gpu_memory_utilization=0.2)
    options = dict(model=str(default_model_path), device=request.param, max_model_len=256, max_num_seqs=16,
                   **setting)
    made = {name: LLM(**options, async_scheduling=ahead, structured_outputs_thread=thread)
            for name, ahead, thread in (("thread", "on", "on"), ("ahead", "on", "off"), ("plain", "off", "off"))}
    # The thread takes the steps whose masks are not dear; on a 2-core CPU it shares the cores with the forward,
    # and a step's masks may look dear there: the tests pin the choice.
    made["thread"].llm_engine.grammars.policy.threshold = float("inf")
    yield made
    for llm in made.values():
        llm.shutdown()


def test_same_outputs_on_the_grammar_thread(engines):
    prompts, params = workload()
    results = {name: [outcome(o) for o in llm.generate(prompts, params, use_tqdm=False)]
               for name, llm in engines.items()}
    for i, want in enumerate(results["plain"]):
        assert results["thread"][i] == want, f"request {i} ({params[i]})"
        assert results["ahead"][i] == want, f"request {i} ({params[i]})"
    thread = engines["thread"].llm_engine
    assert thread.grammars.stats.thread_seconds > 0  # the thread took steps ...
    assert thread.grammars.stats.steps_waited_on_device > 0  # ... and draws read its masks where they were
    assert thread.stats()["num_steps_run_ahead"] > engines["ahead"].llm_engine.stats()["num_steps_run_ahead"] + 10
    if thread.worker.device.type == "cpu":
        assert thread.stats()["num_preemptions"] > 0  # ... and the small pool preempted
    for i, (tokens, text, reason, _) in enumerate(results["plain"]):
        if params[i].ignore_eos and params[i].structured_outputs is not None:
            assert reason == "stop" and len(tokens) < params[i].max_tokens  # the grammar ended it
            json.loads(text)
    for llm in engines.values():
        assert llm.llm_engine.stats()["num_used_blocks"] == 0


def test_sampled_outputs_hold_their_grammar_on_the_thread(engines):
    llm = engines["thread"]
    so = StructuredOutputsParams(json=PERSON)
    outs = llm.generate([f"Person {i} as JSON:" for i in range(12)],
                        SamplingParams(structured_outputs=so, temperature=1.0, max_tokens=60), use_tqdm=False)
    for o in outs:
        if o.outputs[0].finish_reason == "stop":
            assert set(json.loads(o.outputs[0].text)) >= {"name", "age"}
    assert sum(o.outputs[0].finish_reason == "stop" for o in outs) >= 6
    assert llm.llm_engine.stats()["num_used_blocks"] == 0


def test_abort_while_a_grammar_step_is_advanced(engines):
    engine = engines["thread"].llm_engine
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=FRUITS), temperature=0.0, max_tokens=40)
    for i in range(6):
        engine.add_request(f"abort-{i}", f"List {i} fruits as JSON:", params, stream=False)
    for _ in range(12):
        engine.step()
    assert engine.scheduler.has_advanced
    finals = engine.abort_request(["abort-0", "abort-3"])
    assert [f.outputs[0].finish_reason for f in finals] == ["abort", "abort"]
    done = finished_outputs(engine)
    assert sorted(done) == ["abort-1", "abort-2", "abort-4", "abort-5"]
    assert all(o.outputs[0].finish_reason in ("stop", "length") for o in done.values())
    assert engine.stats()["num_used_blocks"] == 0


def test_draws_that_are_not_plain_join_a_threaded_batch(engines):
    """A steady JSON batch on the thread, then requests asking for logprobs or top-p join it (unconstrained
    ones first: the grammar rows stay the thread's newest job's): their steps' draws are not plain, so the
    thread does not take them; the engine's thread accepts those steps' tokens and fills their masks once the
    jobs settle (the masks themselves: test_a_draw_the_thread_does_not_take_reads_settled_masks); outputs as
    the plain loop's."""
    fruits = StructuredOutputsParams(json=FRUITS)
    first = SamplingParams(structured_outputs=fruits, temperature=0.0, max_tokens=40)
    later = [SamplingParams(temperature=0.0, max_tokens=30, logprobs=1),  # no grammar: the pairs stay the job's
             SamplingParams(temperature=0.0, max_tokens=30, top_p=0.5),
             SamplingParams(structured_outputs=StructuredOutputsParams(json=PERSON), temperature=0.0, max_tokens=30,
                            logprobs=1)]
    results = {}
    for name, llm in engines.items():
        engine, finals = llm.llm_engine, {}
        for i in range(4):
            engine.add_request(f"first-{i}", f"List {i} fruits as JSON:", first, stream=False)
        for _ in range(6):
            finals.update((o.request_id, o) for o in engine.step() if o.finished)
        for i, params in enumerate(later):
            engine.add_request(f"later-{i}", f"Describe person {i} as JSON:", params, stream=False)
        finals.update(finished_outputs(engine))
        results[name] = {rid: outcome(o) for rid, o in finals.items()}
        assert len(results[name]) == 7 and engine.stats()["num_used_blocks"] == 0
    assert results["thread"] == results["plain"]
    assert results["ahead"] == results["plain"]


@pytest.mark.parametrize("kind", ["regex", "grammar"])
def test_llguidance_kinds_on_the_thread(default_model_path, kind):
    spec = (StructuredOutputsParams(regex=r"(yes|no), because [a-z ]{5,30}\.") if kind == "regex" else
            StructuredOutputsParams(grammar='start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,4}/'))
    prompts = [f"Question {i}: is this true? Answer:" for i in range(6)]
    params = SamplingParams(structured_outputs=spec, temperature=0.0, max_tokens=40)
    got = {}
    for thread in ("on", "off"):
        llm = LLM(model=str(default_model_path), device="cpu", max_model_len=256, async_scheduling="on",
                  structured_outputs_backend="llguidance", structured_outputs_thread=thread)
        llm.llm_engine.grammars.policy.threshold = float("inf")  # as in engines()
        got[thread] = [outcome(o) for o in llm.generate(prompts, params, use_tqdm=False)]
        if thread == "on":
            assert llm.llm_engine.grammars.stats.thread_seconds > 0
        llm.shutdown()
    assert got["on"] == got["off"]
    assert all(reason == "stop" for _, _, reason, _ in got["on"])


def test_which_steps_the_thread_takes(default_model_path):
    from pagedserve.engine.grammar import Grammars

    grammars = Grammars(default_model_path, 49152, [2], max_rows=8, thread=True)
    json_ = grammars.compile(StructuredOutputsParams(json=PERSON))
    assert json_.backend == "llguidance"
    choice = grammars.compile(StructuredOutputsParams(choice=["yes", "no"]))  # xgrammar's
    pairs = [(0, json_.new_matcher()), (1, json_.new_matcher())]
    assert grammars.step(pairs).threaded and not grammars.step(pairs).check_first
    assert not grammars.step(pairs + [(2, choice.new_matcher())]).threaded  # a row the thread cannot take
    grammars.policy.row_fill_seconds = 1e-3  # 2 rows: 2 ms a step, the threshold: checking draws pays
    assert not grammars.step(pairs).threaded
    grammars.policy.row_fill_seconds = 1e-5
    assert grammars.step(pairs).threaded
    assert not Grammars(default_model_path, 49152, [2], max_rows=8).step(pairs).threaded  # no thread
    grammars.close()


def test_a_draw_the_thread_does_not_take_reads_settled_masks(default_model_path):
    """A threaded step's plain draw may read the newest job's masks before they are in (the device waits);
    any other draw (logprobs, top-p: GrammarStep.mask) gets them once the jobs settle. Either way the masks
    are those of matchers that took the step's tokens."""
    from pagedserve.engine.grammar import Grammars
    from pagedserve.sample.pending import PendingSamples

    grammars = Grammars(default_model_path, 49152, [2], max_rows=8, thread=True)
    compiled = grammars.compile(StructuredOutputsParams(json=FRUITS))
    pairs = [(0, compiled.new_matcher()), (1, compiled.new_matcher())]
    token = grammars._hf_tokenizer().encode('["apple', add_special_tokens=False)[0]
    first = grammars.step(pairs)
    assert first.threaded and first.threaded_mask().ready is None  # no job yet: filled here
    first.drawn(PendingSamples.copy(torch.tensor([token, token], dtype=torch.int32), lambda host: None))
    second = grammars.step(pairs)
    ahead = second.threaded_mask()
    assert ahead.ready is not None  # the job's own buffer, waited for by the draw's device
    ahead.ready(torch.device("cpu"))
    settled = second.mask()  # what a draw that is not plain takes
    assert settled.ready is None and grammars._thread.newest is None
    oracle = compiled.new_matcher()
    assert oracle.accept_token(token)
    want = torch.zeros((1, settled.bitmask.shape[1]), dtype=torch.int32)
    oracle.fill_next_token_bitmask(want, 0)
    for row in (0, 1):
        assert torch.equal(settled.bitmask[row], want[0]) and torch.equal(ahead.bitmask[row], want[0])
    grammars.close()


def test_the_thread_is_on_where_steps_run_ahead():
    from pagedserve.engine_config import EngineConfig, resolve_defaults

    def thread(device: str, **options) -> str:
        return resolve_defaults(EngineConfig(**options), device, 2048).structured_outputs_thread

    assert thread("cuda") == "on"
    assert thread("cpu") == "off"  # nothing overlaps there
    assert thread("cuda", async_scheduling="off") == "off"
    assert thread("cuda", tensor_parallel_size=2) == "off"  # the ranks run the plain order
    assert thread("cpu", structured_outputs_thread="on") == "on"
    assert thread("cuda", structured_outputs_thread="off") == "off"


@pytest.mark.parametrize("device", DEVICES)
def test_a_process_exits_cleanly_with_the_thread_running(default_model_path, device):
    """The engine is not shut down: the thread (which on CUDA waited on the draws' events) must stop before
    the interpreter finalizes. A daemon thread did not: the process aborted after its results on an H200."""
    import subprocess
    import sys

    script = f"""
from pagedserve import LLM, SamplingParams, StructuredOutputsParams
llm = LLM(model={str(default_model_path)!r}, device={device!r}, max_model_len=256, async_scheduling="on",
          structured_outputs_thread="on", gpu_memory_utilization=0.9)  # beside the module's engines on a card
llm.llm_engine.grammars.policy.threshold = float("inf")
so = StructuredOutputsParams(json={{"type": "array", "items": {{"type": "string"}}}})
llm.generate(["List fruits as JSON:"] * 4, SamplingParams(structured_outputs=so, temperature=0.7, max_tokens=16),
             use_tqdm=False)
assert llm.llm_engine.grammars.stats.thread_seconds > 0
print("generated")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "generated" in done.stdout and "terminate" not in done.stderr


def test_a_steady_batch_does_not_wait_for_its_masks_on_the_host(default_model_path):
    """Eight requests of one schema and length, so the rows stay put: after the first steps every draw
    reads the job's masks where the thread left them (the device, here the CPU op, waits for them), and the
    engine's thread settles a job only to record its tokens (the newest job stays in flight)."""
    llm = LLM(model=str(default_model_path), device="cpu", max_model_len=256, async_scheduling="on",
              structured_outputs_thread="on", max_num_seqs=8)
    grammars = llm.llm_engine.grammars
    grammars.policy.threshold = float("inf")  # as in engines()
    so = StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"}})
    params = SamplingParams(structured_outputs=so, temperature=0.8, max_tokens=24, ignore_eos=True, seed=None)
    outs = llm.generate([f"List {i} numbers as JSON:" for i in range(8)], params, use_tqdm=False)
    steps = grammars.stats.steps_waited_on_device
    assert steps >= 15, steps  # 24 tokens: the first draws (no job yet) and the tail fill on the host
    for o in outs:  # the grammar ends a sequence at its end (EOS ignored), or 24 tokens do
        c = o.outputs[0]
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), list)
        else:
            assert len(c.token_ids) == 24
    assert llm.llm_engine.stats()["num_used_blocks"] == 0
    llm.shutdown()


def _drawn(ids: list[int]):
    """A draw whose ids are on the host already."""
    from pagedserve.sample.pending import PendingSamples

    return PendingSamples.copy(torch.tensor(ids, dtype=torch.int32), lambda host: None)


def test_a_job_of_the_same_matchers_in_another_order_keeps_its_own_rows(default_model_path):
    """A steady batch's job shares the last job's lists; the same matchers on swapped rows get their own."""
    from transformers import AutoTokenizer

    from pagedserve.engine.grammar_backends import LLGuidanceBackend
    from pagedserve.engine.grammar_thread import GrammarThread, lines_up

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_path), local_files_only=True)
    vocab = len(tokenizer)
    spec = StructuredOutputsParams(regex=r"(yes|no)[.!]")
    compiled = LLGuidanceBackend(tokenizer, vocab, [tokenizer.eos_token_id]).compile(spec)
    m0, m1 = compiled.new_matcher(), compiled.new_matcher()
    yes, no, dot = (tokenizer.encode(w, add_special_tokens=False)[0] for w in ("yes", "no", "."))
    thread = GrammarThread(4, (vocab + 31) // 32, False, _core.grammar.GrammarPool(1))
    try:
        first = thread.submit([(0, m0), (1, m1)], _drawn([yes, no]))
        assert lines_up(first, [(1, m1), (0, m0)]) and not lines_up(first, [(0, m1), (1, m0)])
        again = thread.submit([(0, m0), (1, m1)], _drawn([dot, dot]))
        assert again.row_of is first.row_of  # shared: the same pairs
        swapped = thread.submit([(0, m1), (1, m0)], _drawn([dot, dot]))
        assert swapped.row_of == {id(m1): 0, id(m0): 1} and swapped.rows == [0, 1]
        jobs = thread.settle()
        assert [job.outcomes for job in jobs][:2] == [[1, 1], [2, 2]]  # LIVE, then STOPPED
        assert jobs[2].ended == [m1, m0]  # stopped matchers refuse "." again
    finally:
        thread.close()
