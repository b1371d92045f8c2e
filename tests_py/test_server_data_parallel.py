"""The real server with --data-parallel-size 2 (two replica processes of the default model on CPU), through
the official openai client: 32 concurrent chat and completions calls get the greedy outputs one offline
engine gives; requests sharing a long prefix stay on one replica (its prefix-cache hit counter in
/metrics grows, the other's does not); a disconnect storm leaves every replica's KV blocks free; and a
replica killed mid-run turns /health 503 within 5 s and ends the server with status 1, its log naming
the replica, no process left behind. Then, each with a server of its own: a frozen replica (SIGSTOP) is
found by its silence, replicas leave a server killed with SIGKILL, and a replica that cannot load the
model fails the start with its reason.

The first server is shared by the first four tests; the kill test ends it, so it comes fourth.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import openai
import psutil
import pytest

from server_process import ServerProcess

NUM_REPLICAS = 2
MAX_TOKENS = 8
BLOCK_SIZE = 16  # the engine's default
TOPICS = ["the sea", "a mountain", "bread", "the moon", "a violin", "winter", "a library", "rivers"]


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--data-parallel-size", str(NUM_REPLICAS), "--kv-cache-memory-gb", "0.25") as s:
        yield s


@pytest.fixture(scope="module")
def model(server) -> str:
    return openai.OpenAI(base_url=server.base_url, api_key="unused").models.list().data[0].id


def replica_metrics(server: ServerProcess, name: str) -> dict[int, float]:
    """replica index -> value of one per-replica metric in /metrics."""
    values = {}
    for line in server.get("/metrics").text.splitlines():
        if line.startswith(f"pagedserve:{name}{{") and 'replica="' in line:
            labels, value = line.rsplit(" ", 1)
            values[int(labels.split('replica="', 1)[1].split('"', 1)[0])] = float(value)
    return values


# ---------------------------------------------------------------------------------------- outputs


async def one_call(client: openai.AsyncOpenAI, model: str, i: int) -> tuple[str, str]:
    """("chat" | "completion", text) of call i, greedy."""
    topic = TOPICS[i % len(TOPICS)]
    if i % 2:
        r = await client.chat.completions.create(model=model, max_tokens=MAX_TOKENS, temperature=0,
                                                 messages=[{"role": "user", "content": f"Say a word about {topic}."}])
        return "chat", r.choices[0].message.content
    r = await client.completions.create(model=model, prompt=f"A short note about {topic}:", max_tokens=MAX_TOKENS,
                                        temperature=0)
    return "completion", r.choices[0].text


async def concurrent_calls(server: ServerProcess, model: str, n: int) -> list[tuple[str, str]]:
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=600) as client:
        return await asyncio.gather(*[one_call(client, model, i) for i in range(n)])


def offline_reference(server: ServerProcess, model: str, n: int) -> list[str]:
    """The texts one engine in this process gives for the same prompt token ids (the server's /tokenize
    renders the chat template exactly as its chat API does)."""
    from pagedserve import LLM

    prompts = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        body = {"model": model, "messages": [{"role": "user", "content": f"Say a word about {topic}."}]} if i % 2 \
            else {"model": model, "prompt": f"A short note about {topic}:"}
        prompts.append({"prompt_token_ids": server.post("/tokenize", json=body).json()["tokens"]})
    llm = LLM(device="cpu", max_model_len=1024, kv_cache_memory_gb=0.25)
    try:
        # The server's defaults too (the model's sampling defaults, e.g. repetition_penalty), greedy.
        params = llm.llm_engine.default_sampling_params(max_tokens=MAX_TOKENS, temperature=0)
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    return [o.outputs[0].text for o in outs]


def test_32_concurrent_calls_match_one_engine_and_use_both_replicas(server, model):
    results = asyncio.run(concurrent_calls(server, model, 32))
    reference = offline_reference(server, model, 32)
    for i, ((kind, text), expected) in enumerate(zip(results, reference)):
        assert text.strip() == expected.strip(), (i, kind, text, expected)
    state = server.wait_idle(timeout=30)
    assert len(state["replicas"]) == NUM_REPLICAS
    prompt_tokens = [r["stats"]["num_prompt_tokens_total"] for r in state["replicas"]]
    assert all(t > 0 for t in prompt_tokens), f"both replicas serve: {prompt_tokens}"
    assert sum(prompt_tokens) == state["stats"]["num_prompt_tokens_total"]
    assert state["stats"]["num_blocks"] == sum(r["stats"]["num_blocks"] for r in state["replicas"])
    assert len(state["block_states"]) == state["stats"]["num_blocks"]


# ---------------------------------------------------------------------------------------- prefix affinity


def test_requests_sharing_a_prefix_stay_on_one_replica(server, model):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)
    document = "Notes: " + " ".join(f"item {i} is {TOPICS[i % len(TOPICS)]};" for i in range(60))
    prefix_tokens = server.post("/tokenize", json={"model": model, "prompt": document}).json()["count"]
    assert prefix_tokens > 10 * BLOCK_SIZE

    queried0, hits0 = replica_metrics(server, "prefix_cache_queried_blocks_total"), \
        replica_metrics(server, "prefix_cache_hit_blocks_total")
    cached = []
    for question in ("Which item is bread?", "Which item is winter?", "Which item is a violin?",
                     "How many items are there?"):
        r = client.completions.create(model=model, prompt=f"{document}\nQ: {question}\nA:", max_tokens=2,
                                      temperature=0)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
    queried = replica_metrics(server, "prefix_cache_queried_blocks_total")
    hits = replica_metrics(server, "prefix_cache_hit_blocks_total")
    d_queried = {i: queried[i] - queried0[i] for i in range(NUM_REPLICAS)}
    d_hits = {i: hits[i] - hits0[i] for i in range(NUM_REPLICAS)}
    home = max(d_queried, key=d_queried.get)
    whole_blocks = prefix_tokens // BLOCK_SIZE - 1  # the prefix's whole blocks, less one for tokenizer seams
    assert d_hits[home] >= 3 * whole_blocks, (d_hits, whole_blocks)
    assert all(d_queried[i] == 0 for i in range(NUM_REPLICAS) if i != home), d_queried
    assert cached[0] < BLOCK_SIZE * whole_blocks <= min(cached[1:]), cached

    # The control: prompts with nothing in common take the replicas in turn.
    queried0 = queried
    for topic in TOPICS[:4]:
        client.completions.create(model=model, prompt=f"{topic} " * 40, max_tokens=1, temperature=0)
    queried = replica_metrics(server, "prefix_cache_queried_blocks_total")
    assert all(queried[i] > queried0[i] for i in range(NUM_REPLICAS)), (queried0, queried)


# ---------------------------------------------------------------------------------------- disconnects


def test_a_disconnect_storm_leaves_every_replica_with_all_blocks_free(server, model):
    async def leave_early(client: openai.AsyncOpenAI, i: int) -> None:
        stream = await client.completions.create(model=model, prompt=f"Tell a long story about {TOPICS[i % 8]}.",
                                                 max_tokens=200, stream=True, extra_body={"ignore_eos": True})
        try:
            async for _ in stream:
                if i % 3 == 0:
                    break  # gone after the first token; the others leave mid-prefill or soon after
                await asyncio.sleep(0.01 * (i % 5))
                break
        finally:
            await stream.close()

    async def storm() -> None:
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0,
                                      timeout=300) as client:
            await asyncio.gather(*[leave_early(client, i) for i in range(24)])

    asyncio.run(storm())
    deadline = time.monotonic() + 30
    state = server.wait_idle(timeout=30)
    while any(r["stats"]["num_used_blocks"] for r in state["replicas"]) and time.monotonic() < deadline:
        time.sleep(0.2)
        state = server.engine_state()
    for r in state["replicas"]:
        assert r["stats"]["num_used_blocks"] == 0, r
        assert r["stats"]["num_free_blocks"] == r["stats"]["num_blocks"], r
        assert set(state["block_states"][slice(*r["block_range"])]) <= {"0", "3"}
    while time.monotonic() < deadline:  # /metrics reads the stats the loop last published
        free, total = replica_metrics(server, "num_free_kv_blocks"), replica_metrics(server, "num_kv_blocks")
        if free == total:
            break
        time.sleep(0.2)
    assert free == total and len(total) == NUM_REPLICAS
    assert replica_metrics(server, "num_requests_running") == {i: 0.0 for i in range(NUM_REPLICAS)}


# ---------------------------------------------------------------------------------------- a replica dies


def stream_until_end(server: ServerProcess, out: dict, started: threading.Event) -> None:
    body = {"prompt": "Count to one thousand:", "max_tokens": 500, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.setdefault("events", []).append(line[6:])
                started.set()


def test_a_killed_replica_turns_health_503_and_ends_the_server_with_status_1(server):
    state = server.engine_state()
    pids = [r["pid"] for r in state["replicas"]]
    children = psutil.Process(server.process.pid).children(recursive=True)
    assert set(pids) <= {c.pid for c in children}
    results = [{} for _ in range(4)]
    started = [threading.Event() for _ in results]
    readers = [threading.Thread(target=stream_until_end, args=(server, out, ev)) for out, ev in zip(results, started)]
    for t in readers:
        t.start()
    assert all(ev.wait(120) for ev in started)

    os.kill(pids[1], signal.SIGKILL)
    killed_at = time.monotonic()
    health = None
    while time.monotonic() - killed_at < 5:
        try:
            response = httpx.get(server.url + "/health", timeout=2)
        except httpx.TransportError:
            break
        if response.status_code == 503:
            health = response.json()
            break
        time.sleep(0.05)
    assert health is not None, "/health did not answer 503 within 5 s"
    assert "replica 1" in health["error"] and "SIGKILL" in health["error"], health
    assert server.wait(timeout=10) == 1, server.log()
    assert time.monotonic() - killed_at < 6
    for t in readers:
        t.join(10)
    assert "engine failed: replica 1 failed: the process was killed by SIGKILL" in server.log()
    for out in results:
        events = out["events"]
        assert events[-1] == "[DONE]"
        assert "replica 1" in json.loads(events[-2])["error"]["message"]
    deadline = time.monotonic() + 10
    while any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [c.pid for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"processes outlived the server: {left}"


def test_a_frozen_replica_turns_health_503_and_ends_the_server_with_status_1():
    """SIGSTOP: the process lives but sends nothing, not even its heartbeat (checked while idle)."""
    with ServerProcess("--data-parallel-size", str(NUM_REPLICAS), "--kv-cache-memory-gb", "0.25") as server:
        pids = [r["pid"] for r in server.engine_state()["replicas"]]
        children = psutil.Process(server.process.pid).children(recursive=True)
        os.kill(pids[0], signal.SIGSTOP)
        stopped_at = time.monotonic()
        health = None
        while health is None and time.monotonic() - stopped_at < 6:
            response = httpx.get(server.url + "/health", timeout=2)
            health = response.json() if response.status_code == 503 else None
            time.sleep(0.05)
        assert health is not None and time.monotonic() - stopped_at < 5, health
        assert "replica 0 failed: no sign of life" in health["error"], health
        assert server.wait(timeout=10) == 1, server.log()
        deadline = time.monotonic() + 10
        while any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children) and \
                time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [c.pid for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


def wait_gone(processes: list, timeout: float) -> list[int]:
    """The pids among `processes` still alive (zombies count as gone) after up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p.pid for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def test_replicas_leave_when_the_server_is_killed():
    with ServerProcess("--data-parallel-size", str(NUM_REPLICAS), "--kv-cache-memory-gb", "0.25") as server:
        replicas = [psutil.Process(r["pid"]) for r in server.engine_state()["replicas"]]
        server.process.kill()  # no shutdown runs: each replica sees its command pipe end
        server.process.wait(10)
        assert not wait_gone(replicas, 10)


def test_a_replica_that_cannot_load_fails_the_start_with_its_reason():
    server = ServerProcess("--data-parallel-size", str(NUM_REPLICAS), "--model", "/nonexistent/model-dir")
    server.start(wait=False)
    try:
        assert server.wait(timeout=120) == 1
    finally:
        server.stop()
    log = server.log()
    assert "pagedserve: error: the model failed to load:" in log and "/nonexistent/model-dir" in log, log
