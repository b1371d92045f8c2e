"""Tensor parallelism on two GPUs (NCCL): TP = 2 against TP = 1 on the same GPU type.

The CPU tests (test_tensor_parallel.py, gloo) hold the sharding rules; these run the same rules where
the collectives are NCCL kernels, captured in the decode steps' CUDA graphs:
  float32   Llama (one KV head, replicated), Qwen3-MoE (experts split) and Gemma (tied vocab-parallel
            embeddings) random checkpoints: greedy tokens identical, prompt and sampled logprobs within
            1e-4 of TP = 1 (the multi-GPU issue's bound), with prefix-cache hits, CUDA graphs on;
  eager     the same for Llama without CUDA graphs (the collectives launched one by one);
  faults    rank 1 killed mid-run: EngineDeadError naming it within 5 s, no process left, and its
            GPU's memory given back.
Skipped without two GPUs and the CUDA build.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
import torch

from pagedserve import LLM, _core
from test_gpu_families import GPU_SHAPE, hf_model_for_gpu
from test_tensor_parallel import (batch, check_same, check_whole_and_prefix_cached, children, kill_rank_1_mid_run,
                                  llama_one_kv_head, rank_pid, run, tp1_baseline)

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and _core.has_cuda and torch.cuda.device_count() >= 2),
    reason="needs two CUDA GPUs and USE_CUDA=ON")

TOL, RTOL = 1e-4, 1e-6  # cuBLAS may sum a column-parallel shard's outputs in another order than the whole's
CASES = ["llama_one_kv_head", "qwen3_moe_norm_topk_sparse_step", "gemma"]


def hf_model(name: str):
    """The CPU tests' cases at a head size the CUDA kernels are built for (64)."""
    return llama_one_kv_head(GPU_SHAPE) if name == "llama_one_kv_head" else hf_model_for_gpu(name)


def make_llm(path, tp: int, **options) -> LLM:
    return LLM(str(path), dtype="float32", device="cuda", tensor_parallel_size=tp,
               **{"block_size": 16, "max_num_seqs": 16, "num_kv_blocks": 256, **options})


@pytest.fixture(scope="module", params=CASES)
def case(request, tmp_path_factory):
    return tp1_baseline(tmp_path_factory, request.param, hf_model(request.param), make_llm)


def test_nccl_tp2_equals_tp1_with_cuda_graphs_and_prefix_hits(case):
    name, path, baseline = case
    worst = check_whole_and_prefix_cached(make_llm(path, 2), baseline, 16, TOL, RTOL)
    print(f"\n{name}: NCCL TP=2 vs TP=1 max |logprob difference| = {worst:.1e}")


def test_nccl_tp2_eager_equals_tp1(tmp_path):
    hf_model("llama_one_kv_head").save_pretrained(tmp_path)
    outs = {}
    for tp in (1, 2):
        llm = make_llm(tmp_path, tp, enforce_eager=True)
        try:
            outs[tp] = run(llm, batch())
        finally:
            llm.shutdown()
    check_same(outs[2], outs[1], TOL, RTOL)


def gpu_processes(index: int) -> set[int]:
    """The pids holding memory on GPU `index` (nvidia-smi's compute apps)."""
    uuid = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader", f"--id={index}"],
                          capture_output=True, text=True, check=True).stdout.strip()
    apps = subprocess.run(["nvidia-smi", "--query-compute-apps=gpu_uuid,pid", "--format=csv,noheader"],
                          capture_output=True, text=True, check=True).stdout
    return {int(pid) for line in apps.splitlines() if line.strip()
            for gpu, pid in [line.split(", ")] if gpu == uuid}


def test_killed_rank_fails_the_engine_and_frees_its_gpu(tmp_path):
    hf_model("llama_one_kv_head").save_pretrained(tmp_path)
    before = children()
    llm = make_llm(tmp_path, 2)
    victim = rank_pid(llm, 1)
    assert victim in gpu_processes(1)
    kill_rank_1_mid_run(llm)
    llm.shutdown()
    assert children() - before == set(), "no rank process outlives the engine"
    deadline = time.monotonic() + 10.0
    while victim in gpu_processes(1) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert victim not in gpu_processes(1), "the killed rank's GPU memory was given back"


# -- the server ----------------------------------------------------------------------------------------------------

def test_server_tp2_killed_rank_gives_503_exits_1_and_frees_the_gpus():
    from server_process import ServerProcess
    from test_server_tensor_parallel import alive, completions, health_503_within, rank_processes

    with ServerProcess("--device", "cuda", "--tensor-parallel-size", "2", "--max-model-len", "256",
                       "--kv-cache-memory-gb", "1") as server:
        assert all(completions(server))
        ranks = rank_processes(server)
        assert len(ranks) == 1 and ranks[0].pid in gpu_processes(1)
        holders = gpu_processes(0) | gpu_processes(1)
        os.kill(ranks[0].pid, signal.SIGKILL)
        assert "rank 1" in health_503_within(server, 5.0)["error"]
        assert server.wait(timeout=20) == 1, server.log()
        deadline = time.monotonic() + 10
        while holders & (gpu_processes(0) | gpu_processes(1)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not holders & (gpu_processes(0) | gpu_processes(1)), "a process still holds GPU memory"
        assert not alive(ranks)


def test_server_dp2_puts_one_replica_on_each_gpu():
    from server_process import ServerProcess
    from test_server_tensor_parallel import completions

    with ServerProcess("--device", "cuda", "--data-parallel-size", "2", "--max-model-len", "256",
                       "--kv-cache-memory-gb", "1") as server:
        pids = {r["pid"] for r in server.engine_state()["replicas"]}
        on_gpu = [pids & gpu_processes(0), pids & gpu_processes(1)]
        assert len(on_gpu[0]) == 1 and len(on_gpu[1]) == 1 and on_gpu[0] != on_gpu[1], (pids, on_gpu)
        texts = completions(server)
        assert all(texts)
