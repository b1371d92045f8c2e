"""ops.wait_for_flag: the CPU op waits on the calling thread, the CUDA op makes the stream wait (the
grammar thread's masks reach the draw this way: engine/grammar_thread.py). The oracle is the order
of events: what is queued after the wait sees what the raising thread wrote before it raised."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from pagedserve import _core, ops

CUDA = torch.cuda.is_available() and _core.has_cuda


def raise_later(flag: torch.Tensor, value: int, seconds: float, before=None) -> threading.Thread:
    def run():
        time.sleep(seconds)
        if before is not None:
            before()
        flag[0] = value

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_cpu_wait_returns_once_the_flag_reaches_the_target():
    flag = torch.zeros(2, dtype=torch.int64)
    flag[0] = 3
    ops.wait_for_flag(flag, 3, torch.device("cpu"))  # already there
    ops.wait_for_flag(flag, 2, torch.device("cpu"))
    start = time.perf_counter()
    thread = raise_later(flag, 4, 0.05)
    ops.wait_for_flag(flag, 4, torch.device("cpu"), timeout_seconds=10.0)
    assert time.perf_counter() - start >= 0.045
    thread.join()
    assert flag.tolist() == [4, 0]


def test_cpu_wait_gives_up_after_its_timeout():
    flag = torch.zeros(2, dtype=torch.int64)
    start = time.perf_counter()
    ops.wait_for_flag(flag, 1, torch.device("cpu"), timeout_seconds=0.05)
    assert 0.045 <= time.perf_counter() - start < 5.0
    assert flag.tolist() == [0, 1]


@pytest.mark.parametrize("bad, message", [
    (torch.zeros(2, dtype=torch.int32), "int64"),
    (torch.zeros(1, dtype=torch.int64), "at least 2"),
    (torch.zeros(4, dtype=torch.int64)[::2], "contiguous"),
])
def test_bad_flags_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        ops.wait_for_flag(bad, 1, torch.device("cpu"))
    with pytest.raises(ValueError, match="timeout_seconds"):
        ops.wait_for_flag(torch.zeros(2, dtype=torch.int64), 1, torch.device("cpu"), timeout_seconds=0.0)


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_cuda_stream_waits_for_the_host_before_what_follows():
    device = torch.device("cuda")
    flag = torch.zeros(2, dtype=torch.int64, pin_memory=True)
    src = torch.zeros(1024, dtype=torch.int32, pin_memory=True)
    dst = torch.empty(1024, dtype=torch.int32, device=device)
    ops.wait_for_flag(flag, 1, device, timeout_seconds=10.0)
    dst.copy_(src, non_blocking=True)  # queued after the wait: must read what the host writes below
    thread = raise_later(flag, 1, 0.05, before=lambda: src.fill_(7))
    torch.cuda.synchronize()
    thread.join()
    assert bool((dst == 7).all())
    assert flag.tolist() == [1, 0]


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_cuda_wait_gives_up_after_its_timeout():
    flag = torch.zeros(2, dtype=torch.int64, pin_memory=True)
    ops.wait_for_flag(flag, 1, torch.device("cuda"), timeout_seconds=0.05)
    torch.cuda.synchronize()
    assert flag.tolist() == [0, 1]


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_cuda_wait_needs_pinned_memory():
    with pytest.raises(ValueError, match="pinned"):
        ops.wait_for_flag(torch.zeros(2, dtype=torch.int64), 1, torch.device("cuda"))
