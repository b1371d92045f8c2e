"""Data parallelism's pieces that need no replica process: the router's load and prefix-affinity rules
(engine/data_parallel/router.py), where replicas are placed, and the clear error of an in-process engine
asked for replicas. The server tests (test_server_data_parallel.py) run real replicas."""

from __future__ import annotations

import pytest

from pagedserve.engine.data_parallel import build_engine
from pagedserve.engine.data_parallel.merge import merge_stats
from pagedserve.engine.data_parallel.placement import available_cpus, place_replicas
from pagedserve.engine.data_parallel.router import PrefixLRU, Router, prefix_hashes
from pagedserve.engine_config import EngineConfig

BS = 4


def test_prefix_hashes_cover_whole_blocks_before_the_last_token():
    assert len(prefix_hashes(list(range(8)), BS)) == 1  # the block holding the last token is never cached
    assert len(prefix_hashes(list(range(9)), BS)) == 2
    a, b = prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], BS), prefix_hashes([1, 2, 3, 4, 5, 6, 7, 0, 9], BS)
    assert a[0] == b[0] and a[1] != b[1]
    assert prefix_hashes([9, 2, 3, 4, 5, 6, 7, 8, 9], BS)[1] != a[1], "chained: a later block depends on all before"


def test_prompts_with_nothing_in_common_take_idle_replicas_in_turn():
    router = Router(3, BS, [100, 100, 100])
    picks = []
    for i in range(6):
        picks.append(router.route(f"r{i}", [i * 100 + k for k in range(10)], 1))
        router.finished(f"r{i}")
    assert picks == [0, 1, 2, 0, 1, 2]


def test_a_shared_prefix_keeps_requests_on_its_replica_unless_it_is_much_more_loaded():
    router = Router(2, BS, [100, 100])
    prefix = list(range(1000, 1040))  # 10 blocks
    home = router.route("first", prefix + [1], 1)
    router.finished("first")
    assert router.route("second", prefix + [2], 1) == home
    router.started("second")  # decoding: one token of load
    assert router.route("third", prefix + [3], 1) == home, "a sequence in decode is little load"
    # "third" waits for its prefill there: 41 tokens of load, more than the 40 cached tokens save.
    assert router.load(home) == 1 + 41
    assert router.route("fourth", prefix + [4], 1) != home


def test_load_returns_to_zero_once_requests_finish_or_abort():
    router = Router(2, BS, [100, 100])
    router.route("a", list(range(20)), 2)
    router.route("b", list(range(100, 130)), 1)
    router.started("a")
    assert router.load(0) + router.load(1) == 2 + 30
    router.finished("a")
    router.finished("b")
    router.finished("b")  # twice (an abort after the finish) is harmless
    assert router.load(0) == router.load(1) == 0


def test_the_prefix_memory_is_bounded_by_the_replica_pool():
    lru = PrefixLRU(capacity=3)
    lru.remember([1, 2, 3])
    lru.remember([4])
    assert lru.matched_blocks([1, 2, 3]) == 0, "the oldest hash was forgotten"
    assert lru.matched_blocks([2, 3, 4]) == 3


def test_merged_stats_sum_counts_and_recompute_fractions():
    a = {"num_blocks": 100, "num_used_blocks": 50, "pool_utilization": 0.5, "prefix_queried_blocks": 10,
         "prefix_hit_blocks": 10, "prefix_hit_rate": 1.0, "step_num_seqs": 3}
    b = {"num_blocks": 300, "num_used_blocks": 0, "pool_utilization": 0.0, "prefix_queried_blocks": 30,
         "prefix_hit_blocks": 0, "prefix_hit_rate": 0.0, "step_num_seqs": 1}
    merged = merge_stats([a, b], {"step_num_seqs": 4})
    assert merged["num_blocks"] == 400 and merged["num_used_blocks"] == 50
    assert merged["pool_utilization"] == pytest.approx(50 / 400)
    assert merged["prefix_hit_rate"] == pytest.approx(10 / 40)
    assert merged["step_num_seqs"] == 4
    assert [r["replica"] for r in merged["replicas"]] == [0, 1] and merged["replicas"][1]["num_blocks"] == 300


def test_cpu_replicas_split_the_cores():
    placements = place_replicas(EngineConfig(device="cpu", data_parallel_size=2))
    assert [p.index for p in placements] == [0, 1]
    assert all(p.num_threads == max(1, available_cpus() // 2) and p.cuda_visible_devices is None for p in placements)


def test_an_in_process_engine_asked_for_replicas_says_to_use_the_server():
    from pagedserve import LLM

    with pytest.raises(ValueError, match="pagedserve serve --data-parallel-size 2"):
        LLM(data_parallel_size=2)
    with pytest.raises(ValueError, match="--data-parallel-size must be at least 1"):
        build_engine(EngineConfig(data_parallel_size=0))
