"""A busy machine slows a decode step in proportion to the CPU it takes, not more.

A competing process burns one core's worth of CPU, pinned (os.sched_setaffinity) to the same cores
as the engine. A pool that split each op statically over its threads and waited at a spin barrier
would lose far more than that share: whenever the burner preempts one worker, every op waits for
that worker's next time slice (milliseconds under CFS) while the others spin, and a 30-layer step
runs ~200 ops. Ours hands tasks out dynamically (a preempted worker's share is taken by the others),
spins only 50 us before sleeping and lets the caller work (cpp/ops/thread_pool.h).

How much a burner takes depends on the machine, not only on its core count: on 2 cores CFS gives
it a third of the time (a step ~1.5x slower), but two vCPUs that are hyperthreads of one core, or a
host that is itself busy, give less (CI once saw 2.1x). So the test measures its oracle on the same
machine in the same rounds: the slowdown of an ideal workload, as many Python threads as cores
hashing 256 KiB chunks from a shared queue (hashlib releases the GIL), about as long as a step.
It then asserts two things:
- the engine's own CPU time per step grows at most 1.25x: time spent waiting for a preempted worker
  is spent asleep. Seen on a 2-core Zen 3: 0.84-1.02x for this pool; 1.40-1.44x for the same pool
  spinning instead of sleeping (kSpinTime 10 s), the failure this test exists for.
- the step's wall time grows at most 1.6x as much as the ideal workload's. Seen: 0.99-1.23 for this
  pool, 1.38-1.52 spinning, 1.09-1.56 for a static split that sleeps; both wall ratios swing by
  ~0.3 between runs of a shared machine, so this bound only catches a gross loss.
Rounds with and without the burner are interleaved so that load from elsewhere hits both alike, and
each ratio is the median of the rounds' own busy / quiet ratios: on a shared VM (Intel, 2 vCPUs) the
quiet step's CPU time drifted from 49 to 28 ms within one run, and a ratio of the medians over all
rounds once read 1.32 where the paired one reads near 1.
"""

from __future__ import annotations

import hashlib
import os
import resource
import statistics
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from pagedserve import LLM, SamplingParams

pytestmark = pytest.mark.serial  # it times steps: scripts/test.sh runs it alone, after the parallel run

BURN = "import os, sys\nos.sched_setaffinity(0, {int(c) for c in sys.argv[1:]})\nwhile True:\n    pass\n"
ROUNDS, BATCH, TOKENS = 7, 8, 12
CHUNK, CHUNKS = os.urandom(256 << 10), 400  # the ideal workload: ~40 ms on 2 cores of a Zen 3


def burner(cores: set[int]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", BURN, *map(str, sorted(cores))])


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def decode_step(llm: LLM, prompts: list[list[int]]) -> tuple[float, float]:
    """(wall, CPU) seconds per step of a batch of BATCH requests decoding TOKENS tokens (prefill excluded)."""
    requests = [{"prompt_token_ids": p} for p in prompts]

    def timed(max_tokens: int) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), cpu_seconds()
        llm.generate(requests, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - wall, cpu_seconds() - cpu

    prefill, total = timed(1), timed(TOKENS)
    return tuple(max(1e-6, t - p) / (TOKENS - 1) for t, p in zip(total, prefill))


def ideal_workload(num_threads: int) -> float:
    """Wall seconds for num_threads threads to hash CHUNKS chunks handed out one at a time (median of 3)."""
    return statistics.median(hash_chunks(num_threads) for _ in range(3))


def hash_chunks(num_threads: int) -> float:
    chunks, lock = iter(range(CHUNKS)), threading.Lock()

    def work() -> None:
        digest = hashlib.sha256()
        while True:
            with lock:
                if next(chunks, None) is None:
                    return
            digest.update(CHUNK)

    threads = [threading.Thread(target=work) for _ in range(num_threads)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def slowdown(busy: list[float], quiet: list[float]) -> float:
    """The median over rounds of busy / quiet, each round's pair measured back to back."""
    return statistics.median(b / q for b, q in zip(busy, quiet))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs os.sched_setaffinity")
def test_a_competing_process_slows_a_step_by_the_cpu_it_takes(default_model_path):
    cores = os.sched_getaffinity(0)
    llm = LLM(str(default_model_path), device="cpu", enable_prefix_caching=False, max_num_seqs=BATCH, max_model_len=128)
    prompts = np.random.default_rng(0).integers(100, 30000, size=(BATCH, 24)).tolist()
    decode_step(llm, prompts)  # warm-up
    quiet, busy, ideal_quiet, ideal_busy = [], [], [], []
    try:
        for _ in range(ROUNDS):
            quiet.append(decode_step(llm, prompts))
            ideal_quiet.append(ideal_workload(len(cores)))
            proc = burner(cores)
            try:
                time.sleep(0.2)  # let it start spinning
                busy.append(decode_step(llm, prompts))
                ideal_busy.append(ideal_workload(len(cores)))
            finally:
                proc.kill()
                proc.wait()
    finally:
        llm.shutdown()
    wall = slowdown([b[0] for b in busy], [q[0] for q in quiet])
    cpu = slowdown([b[1] for b in busy], [q[1] for q in quiet])
    ideal = slowdown(ideal_busy, ideal_quiet)
    report = (f"on {len(cores)} cores a burner made a decode step {wall:.2f}x slower (the ideal workload "
              f"{ideal:.2f}x: {wall / ideal:.2f} of it) and its CPU time {cpu:.2f}x; "
              f"(wall, cpu) quiet {quiet}, busy {busy}; ideal quiet {ideal_quiet}, busy {ideal_busy}")
    print(report)
    assert cpu < 1.25, report
    assert wall / ideal < 1.6, report


def test_the_pool_sizes_itself_to_the_cores_it_may_use():
    """ops' pool takes the affinity mask (taskset, a cpuset, a rank's share), not the machine's core count."""
    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "from pagedserve import ops; print(ops.num_threads())")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.strip() == "1", out.stderr
