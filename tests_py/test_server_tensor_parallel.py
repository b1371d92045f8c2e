"""The real server with tensor parallelism (gloo ranks of the default model on CPU), through the official
openai client: --tensor-parallel-size 2 serves the greedy text one offline TP=1 engine gives; a rank killed
mid-run turns /health 503 within 5 s and ends the server with status 1, its log naming the rank, no
process left behind; and --data-parallel-size 2 --tensor-parallel-size 2 runs four ranks (two replicas of
two) that serve the same text.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import psutil
import pytest

from server_process import ServerProcess

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def reference_texts(default_model_path):
    from pagedserve import LLM

    llm = LLM(str(default_model_path), device="cpu", dtype="float32", max_model_len=256)
    try:
        # The server's defaults too (the model's sampling defaults, e.g. repetition_penalty), greedy.
        params = llm.llm_engine.default_sampling_params(max_tokens=MAX_TOKENS, temperature=0)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        llm.shutdown()
    return [o.outputs[0].text for o in outs]


def completions(server: ServerProcess) -> list[str]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    return [client.completions.create(model=model, prompt=p, max_tokens=MAX_TOKENS, temperature=0.0).choices[0].text
            for p in PROMPTS]


def rank_processes(server: ServerProcess) -> list[psutil.Process]:
    """The server's spawned rank processes (not multiprocessing's resource tracker)."""
    return [c for c in psutil.Process(server.process.pid).children(recursive=True)
            if "spawn_main" in " ".join(c.cmdline())]


def health_503_within(server: ServerProcess, seconds: float) -> dict:
    """/health's 503 body, which must come within `seconds` from now."""
    start, health = time.monotonic(), None
    while health is None and time.monotonic() - start < seconds + 1:
        try:
            response = httpx.get(server.url + "/health", timeout=2)
        except httpx.TransportError:
            break
        health = response.json() if response.status_code == 503 else None
        time.sleep(0.05)
    assert health is not None and time.monotonic() - start < seconds, f"/health did not answer 503 within {seconds} s"
    return health


def alive(processes: list[psutil.Process]) -> list[int]:
    return [p.pid for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_tp2_serves_tp1_text_and_a_killed_rank_ends_the_server(reference_texts):
    with ServerProcess("--tensor-parallel-size", "2", "--dtype", "float32", "--max-model-len", "256") as server:
        assert completions(server) == reference_texts
        ranks = rank_processes(server)
        assert len(ranks) == 1, [p.cmdline() for p in ranks]
        children = psutil.Process(server.process.pid).children(recursive=True)
        os.kill(ranks[0].pid, signal.SIGKILL)
        assert "rank 1" in health_503_within(server, 5.0)["error"]
        assert server.wait(timeout=10) == 1, server.log()
        assert "engine failed: rank 1 failed" in server.log()
        deadline = time.monotonic() + 10
        while alive(children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(children), "processes outlived the server"


def test_dp2_tp2_runs_four_ranks_that_serve_the_same_text(reference_texts):
    with ServerProcess("--data-parallel-size", "2", "--tensor-parallel-size", "2", "--dtype", "float32", "--max-model-len", "256",
                       "--kv-cache-memory-gb", "0.25") as server:
        replicas = server.engine_state()["replicas"]
        assert len(replicas) == 2
        for replica in replicas:  # each replica is rank 0 of its own group and has spawned rank 1
            ranks = [c for c in psutil.Process(replica["pid"]).children(recursive=True)
                     if "spawn_main" in " ".join(c.cmdline())]
            assert len(ranks) == 1, replica
        assert completions(server) == reference_texts
