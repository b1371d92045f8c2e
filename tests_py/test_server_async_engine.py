"""The server's engine loop against a scripted engine (no model): routing of
concurrent outputs, refusals, aborts, the waiting limit, engine failures and
shutdown. The real-model server tests are in test_server_api.py and friends."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from fake_engine import FakeEngine, ProtocolOnly, expected_text
from pagedserve.server.async_engine import AsyncEngine, EngineOverloaded, EngineStepError, EngineUnavailable
from pagedserve.server.engine_commands import AddCommand, StopCommand, WaitingCount
from pagedserve.server.engine_loop import EngineLoop
from pagedserve.server.engine_state import read_engine_state
from pagedserve.errors import RequestError
from pagedserve.sampling_params import SamplingParams
from pagedserve.server.metrics import ServerMetrics


def params(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, max_tokens=max_tokens)


def prompt(text: str) -> dict:
    return {"prompt": text, "prompt_token_ids": list(text.encode())}


async def collect(stream) -> dict[tuple[int, int], tuple[str, str]]:
    """(prompt index, sample index) -> (text, finish_reason)."""
    texts: dict[tuple[int, int], str] = {}
    reasons: dict[tuple[int, int], str] = {}
    async for prompt_index, out in stream:
        for c in out.outputs:
            key = (prompt_index, c.index)
            texts[key] = texts.get(key, "") + c.text
            if c.finish_reason:
                reasons[key] = c.finish_reason
    return {k: (texts[k], reasons.get(k)) for k in texts}


def run(engine: FakeEngine, body, max_num_waiting: int = 100, metrics=None, on_dead=None):
    """Starts an AsyncEngine over `engine`, runs `body(async_engine)`, shuts down."""

    async def main():
        async_engine = AsyncEngine(max_num_waiting)
        async_engine.start(ProtocolOnly(engine), asyncio.get_running_loop(), metrics, on_dead=on_dead)
        try:
            return await body(async_engine)
        finally:
            assert await asyncio.to_thread(async_engine.join, 10)
    return asyncio.run(main())


def test_concurrent_requests_get_their_own_outputs_from_one_engine_thread():
    rng = random.Random(1234)
    cases = [("x" * rng.randint(1, 20), rng.randint(1, 12), rng.randint(1, 3)) for _ in range(24)]
    engine = FakeEngine(max_model_len=64, max_num_seqs=5)

    async def body(async_engine):
        async def one(i, text, max_tokens, n):
            await asyncio.sleep(rng.random() * 0.01)  # arrive while others are mid-generation
            stream = await async_engine.generate([prompt(text)], params(max_tokens, n), f"r{i}")
            return await collect(stream)
        return await asyncio.gather(*(one(i, *case) for i, case in enumerate(cases)))

    results = run(engine, body)
    for (text, max_tokens, n), got in zip(cases, results, strict=True):
        assert got == {(0, j): (expected_text(len(text), j, max_tokens), "length") for j in range(n)}
    assert len(engine.thread_ids) == 1 and threading.get_ident() not in engine.thread_ids
    assert not engine.has_unfinished_requests()


def test_several_prompts_in_one_call_are_indexed_in_order():
    engine = FakeEngine()

    async def body(async_engine):
        stream = await async_engine.generate([prompt("ab"), prompt("abcdef")], params(3, n=2), "multi")
        return await collect(stream)

    got = run(engine, body)
    assert got == {(p, j): (expected_text(length, j, 3), "length") for p, length in ((0, 2), (1, 6))
                   for j in range(2)}


def test_a_refused_request_raises_and_the_engine_keeps_serving():
    engine = FakeEngine(max_model_len=16)

    async def body(async_engine):
        with pytest.raises(ValueError, match="max_model_len"):
            await async_engine.generate([prompt("abcdefgh")], params(9), "too-long")
        # one good and one bad prompt in the same call: nothing of it stays in the engine
        with pytest.raises(ValueError):
            await async_engine.generate([prompt("ab"), prompt("a" * 15)], params(4), "mixed")
        stream = await async_engine.generate([prompt("abc")], params(4), "ok")
        return await collect(stream), async_engine.num_waiting

    got, waiting = run(engine, body)
    assert got == {(0, 0): (expected_text(3, 0, 4), "length")}
    assert waiting == 0 and not engine.has_unfinished_requests()


def test_closing_a_stream_early_aborts_its_request_and_frees_its_blocks():
    engine = FakeEngine(step_seconds=0.002)

    async def body(async_engine):
        stream = await async_engine.generate([prompt("hello")], params(40), "leaver")
        other = await async_engine.generate([prompt("hi")], params(30), "stayer")
        async for _ in stream:
            break  # the client went away after the first token
        stream.close()
        other_result = await collect(other)
        state = await async_engine.read(read_engine_state)
        return other_result, state

    other_result, state = run(engine, body)
    assert other_result == {(0, 0): (expected_text(2, 0, 30), "length")}
    assert state["running"] == [] and state["waiting"] == []
    assert set(state["block_states"]) == {"0"} and state["stats"]["num_used_blocks"] == 0


def test_cancelling_the_consumer_aborts_the_request():
    engine = FakeEngine(step_seconds=0.002)

    async def body(async_engine):
        stream = await async_engine.generate([prompt("abc")], params(60), "cancelled")

        async def consume():
            try:
                async for _ in stream:
                    pass
            finally:
                stream.close()  # what the SSE generator's cleanup does
        task = asyncio.create_task(consume())
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await async_engine.read(
            lambda engine, loop: (engine.snapshot()["num_unfinished_requests"], loop.state.num_steps))

    unfinished, steps = run(engine, body)
    assert unfinished == 0 and 0 < steps < 60


def test_a_full_waiting_queue_refuses_requests_until_it_drains():
    engine = FakeEngine(max_num_seqs=1, step_seconds=0.005)

    async def body(async_engine):
        streams = [await async_engine.generate([prompt("a")], params(8), f"q{i}") for i in range(3)]
        state = await async_engine.read(read_engine_state)  # also lets the loop publish its waiting count
        assert async_engine.num_waiting == 2  # one running, two waiting
        assert [r["id"] for r in state["running"]] == ["q0"] and [r["id"] for r in state["waiting"]] == ["q1", "q2"]
        assert state["running"][0]["prompt_tokens"] == 1 and state["waiting"][0]["output_tokens"] == 0
        with pytest.raises(EngineOverloaded, match="max-num-waiting"):
            await async_engine.generate([prompt("b")], params(8), "refused")
        results = [await collect(s) for s in streams]
        late = await collect(await async_engine.generate([prompt("c")], params(2), "late"))
        return results, late

    results, late = run(engine, body, max_num_waiting=2)
    assert all(r == {(0, 0): (expected_text(1, 0, 8), "length")} for r in results)
    assert late == {(0, 0): (expected_text(1, 0, 2), "length")}


def test_an_engine_failure_fails_the_requests_in_flight_and_serving_goes_on():
    engine = FakeEngine(step_seconds=0.002)

    async def body(async_engine):
        stream = await async_engine.generate([prompt("abc")], params(50), "victim")
        engine.fail_next_step = True
        with pytest.raises(EngineStepError, match="injected step failure"):
            await collect(stream)
        after = await collect(await async_engine.generate([prompt("abc")], params(3), "after"))
        return after, async_engine.loop_state.num_step_failures

    after, failures = run(engine, body)
    assert after == {(0, 0): (expected_text(3, 0, 3), "length")} and failures == 1
    assert not engine.has_unfinished_requests()


def test_an_unexpected_error_in_add_request_fails_that_request_only():
    engine = FakeEngine()
    real_add = engine.add_request

    def add_request(request_id, prompt_dict, request_params, arrival_time=None):
        if request_id == "cursed":
            raise RuntimeError("Overflow when unpacking long")
        real_add(request_id, prompt_dict, request_params, arrival_time)
    engine.add_request = add_request

    async def body(async_engine):
        with pytest.raises(EngineStepError, match="Overflow"):
            await async_engine.generate([prompt("abc")], params(3), "cursed")
        return await collect(await async_engine.generate([prompt("abc")], params(3), "fine"))

    assert run(engine, body) == {(0, 0): (expected_text(3, 0, 3), "length")}


def test_a_dead_loop_fails_its_requests_and_reports_itself():
    engine = FakeEngine(step_seconds=0.002)

    async def body(async_engine):
        stream = await async_engine.generate([prompt("abc")], params(50), "orphan")
        engine.stats = None  # the loop's next publish raises TypeError: a bug in the loop, not in a step
        with pytest.raises(EngineStepError, match="loop died"):
            await asyncio.wait_for(collect(stream), 5)
        await asyncio.to_thread(async_engine._loop_thread.join, 5)
        assert async_engine.failed and not async_engine.ready
        with pytest.raises(EngineUnavailable, match="stopped"):
            await async_engine.generate([prompt("x")], params(2), "after")

    run(engine, body)
    assert not engine.has_unfinished_requests()


def test_shutdown_aborts_streams_in_flight_and_refuses_new_requests():
    engine = FakeEngine(step_seconds=0.01)

    async def body(async_engine):
        streams = [await async_engine.generate([prompt("abc")], params(50, n=2), f"s{i}") for i in range(3)]
        await asyncio.sleep(0.03)
        async_engine.begin_shutdown()
        results = [await asyncio.wait_for(collect(s), 5) for s in streams]
        with pytest.raises(EngineUnavailable, match="shutting down"):
            await async_engine.generate([prompt("x")], params(2), "too-late")
        return results

    results = run(engine, body)
    for got in results:
        assert set(got) == {(0, 0), (0, 1)}
        for text, reason in got.values():
            assert reason == "abort" and 0 < len(text) < 50
    assert not engine.has_unfinished_requests()


def test_adds_queued_behind_a_stop_are_refused_not_lost():
    engine = FakeEngine()

    class Router:
        delivered: list = []

        def deliver(self, outputs):
            self.delivered.extend(outputs)

        def fail(self, request_ids, error):
            raise AssertionError("nothing should fail")

    async def main():
        event_loop = asyncio.get_running_loop()
        loop = EngineLoop(ProtocolOnly(engine), event_loop, Router(), WaitingCount())
        before, after = event_loop.create_future(), event_loop.create_future()
        # all three are taken in one batch once the thread starts
        loop.submit(AddCommand("before", prompt("abc"), params(5), 0.0, before))
        loop.submit(StopCommand())
        loop.submit(AddCommand("after", prompt("abc"), params(5), 0.0, after))
        loop.start()
        await asyncio.wait_for(before, 5)
        with pytest.raises(EngineUnavailable):
            await asyncio.wait_for(after, 5)
        await asyncio.to_thread(loop.join, 5)
        await asyncio.sleep(0)  # let the loop's last deliveries run
        return [(o.request_id, o.outputs[0].finish_reason) for o in Router.delivered]

    assert asyncio.run(main()) == [("before", "abort")]
    assert not engine.has_unfinished_requests()


def test_metrics_count_tokens_and_finished_requests():
    engine = FakeEngine(step_seconds=0.002)

    async def body(async_engine):
        for i, (text, max_tokens) in enumerate((("abcd", 5), ("xy", 3))):
            await collect(await async_engine.generate([prompt(text)], params(max_tokens, n=2), f"m{i}"))
        stream = await async_engine.generate([prompt("abc")], params(40), "left")
        async for _ in stream:
            break
        stream.close()
        await async_engine.read(lambda engine, loop: None)  # the abort has been applied
        return metrics.render().decode()

    metrics = ServerMetrics("fake", lambda: None)
    text = run(engine, body, metrics=metrics)
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
               for line in text.splitlines() if line and not line.startswith("#")}
    label = '{model_name="fake"}'
    assert samples["pagedserve:prompt_tokens_total" + label] == 4 + 2 + 3
    assert samples["pagedserve:generation_tokens_total" + label] >= 2 * (5 + 3) + 1
    assert samples['pagedserve:request_success_total{finished_reason="length",model_name="fake"}'] == 2
    assert samples['pagedserve:request_success_total{finished_reason="abort",model_name="fake"}'] == 1
    # latencies describe the two completed requests only
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert samples[f"pagedserve:{name}_count" + label] == 2
    assert samples["pagedserve:e2e_request_latency_seconds_sum" + label] > 0


def test_the_waiting_bound_counts_sequences_and_refuses_calls_that_can_never_fit():
    engine = FakeEngine(max_num_seqs=2, step_seconds=0.01)

    async def body(async_engine):
        running = await async_engine.generate([prompt("a"), prompt("a")], params(50), "running")  # both slots
        waiting = [await async_engine.generate([prompt("b")], params(4, n=2), f"w{i}") for i in range(2)]
        await async_engine.read(lambda engine, loop: None)  # the loop has published its count
        assert async_engine.num_waiting == 4  # two requests of n = 2: four sequences
        with pytest.raises(EngineOverloaded):
            await async_engine.generate([prompt("c")], params(2), "one-too-many")
        # more sequences than the bound, on any load: a request error (400), not "retry later"
        with pytest.raises(RequestError, match="max-num-waiting") as info:
            await async_engine.generate([prompt("d")] * 5, params(2), "five-prompts")
        assert info.value.field == "prompt" and info.value.code == "too_many_sequences"
        with pytest.raises(RequestError) as info:
            await async_engine.generate([prompt("d")], params(2, n=5), "n-five")
        assert info.value.field == "n"
        running.close()
        return [await collect(s) for s in waiting]

    results = run(engine, body, max_num_waiting=4)
    assert all(r == {(0, j): (expected_text(1, j, 4), "length") for j in range(2)} for r in results)
    assert not engine.has_unfinished_requests()


def test_the_idle_loop_asks_the_engine_health_and_a_dead_engine_ends_it():
    from pagedserve.errors import EngineDeadError

    engine = FakeEngine()
    deaths = []

    async def body(async_engine):
        await collect(await async_engine.generate([prompt("ab")], params(3), "r"))
        # the last outputs reach us before the loop records their step: a reader runs after that
        await async_engine.read(lambda engine, loop: None)
        steps = len(async_engine.loop_state.steps)
        await asyncio.sleep(2.5)  # two idle health checks: they record no step
        assert len(async_engine.loop_state.steps) == steps and async_engine.ready
        engine.dead = EngineDeadError("rank 1", "gone")
        for _ in range(40):
            await asyncio.sleep(0.1)
            if async_engine.dead_error is not None:
                break
        assert async_engine.dead_error is engine.dead and deaths == [engine.dead]
        assert async_engine.failed and not async_engine.ready
        with pytest.raises(EngineUnavailable, match="engine failed: rank 1 failed: gone"):
            await async_engine.generate([prompt("ab")], params(3), "late")

    run(engine, body, on_dead=deaths.append)
    assert engine.shut_down, "the loop shuts its engine down when it ends"
