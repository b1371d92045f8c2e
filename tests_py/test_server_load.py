"""64 concurrent streaming clients, a quarter of which disconnect at random
points: every other request completes with the output it gets alone, and
afterwards nothing runs and no KV block is held."""

from __future__ import annotations

import asyncio
import random

import openai
import pytest

from server_process import ServerProcess

NUM_CLIENTS = 64
NUM_DISCONNECTING = NUM_CLIENTS // 4
MAX_TOKENS = 24
PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
           "The three primary colors are", "Water boils at", "My favourite book is",
           "The quick brown fox", "In 1969, the first person to walk on the Moon"]


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--max-num-seqs", str(NUM_CLIENTS)) as s:
        yield s


def completion_args(model: str, prompt: str) -> dict:
    return dict(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})


async def one_client(client: openai.AsyncOpenAI, model: str, prompt: str, leave_after: int | None) -> dict:
    """Streams one completion; with leave_after, disconnects after that many chunks."""
    stream = await client.completions.create(**completion_args(model, prompt))
    text, reason, usage, chunks = "", None, None, 0
    try:
        async for chunk in stream:
            chunks += 1
            usage = chunk.usage or usage
            for choice in chunk.choices:
                text += choice.text
                reason = choice.finish_reason or reason
            if leave_after is not None and chunks >= leave_after:
                break
    finally:
        await stream.close()  # closes the connection when the stream is not done
    return {"prompt": prompt, "text": text, "finish_reason": reason, "usage": usage, "left": leave_after is not None}


async def run_clients(server: ServerProcess) -> tuple[dict[str, str], list[dict]]:
    rng = random.Random(20261122)
    # The client's default pool allows far more than 64 connections: every stream gets its own.
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0,
                                  timeout=600) as client:
        model = (await client.models.list()).data[0].id
        references = {}
        for prompt in PROMPTS:  # each prompt alone first: the output it must get under load too
            alone = await one_client(client, model, prompt, None)
            references[prompt] = alone["text"]
        leaving = set(rng.sample(range(NUM_CLIENTS), NUM_DISCONNECTING))
        jobs = [one_client(client, model, PROMPTS[i % len(PROMPTS)],
                           rng.randint(1, MAX_TOKENS - 4) if i in leaving else None) for i in range(NUM_CLIENTS)]
        results = await asyncio.gather(*jobs)
    return references, results


def test_64_streaming_clients_with_disconnects(server):
    references, results = asyncio.run(run_clients(server))
    completed = [r for r in results if not r["left"]]
    assert len(completed) == NUM_CLIENTS - NUM_DISCONNECTING
    for r in completed:
        assert r["finish_reason"] == "length" and r["usage"].completion_tokens == MAX_TOKENS
        assert r["text"] == references[r["prompt"]], r["prompt"]
    for r in results:
        if r["left"]:
            assert references[r["prompt"]].startswith(r["text"])
    state = server.wait_idle(timeout=30)
    metrics = server.metrics()
    assert metrics["pagedserve:num_requests_running"] == 0 and metrics["pagedserve:num_requests_waiting"] == 0
    assert metrics["pagedserve:kv_cache_usage_perc"] == 0
    assert metrics["pagedserve:num_free_kv_blocks"] == metrics["pagedserve:num_kv_blocks"]
    assert set(state["block_states"]) <= {"0", "3"}, "only free and cached blocks may remain"
    assert metrics["pagedserve:e2e_request_latency_seconds_count"] >= len(PROMPTS) + len(completed)
