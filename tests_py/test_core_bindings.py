"""The memory core and scheduler driven from Python through the bindings."""

import random

import numpy as np
import pytest

from pagedserve import _core


def make_scheduler(num_blocks=64, block_size=4, **kw):
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("max_num_batched_tokens", 32)
    kw.setdefault("max_model_len", 256)
    kw.setdefault("watermark", 0.0)
    cfg = _core.SchedulerConfig(num_blocks=num_blocks, block_size=block_size, eos_token_ids=[2], **kw)
    return _core.Scheduler(cfg)


def test_step_arrays_are_zero_copy_readonly_int32_views():
    s = make_scheduler()
    s.add_sequence([10, 11, 12, 13, 14], max_tokens=2)
    out = s.schedule()
    ids = out.input_ids
    assert ids.dtype == np.int32 and ids.tolist() == [10, 11, 12, 13, 14]
    assert np.shares_memory(ids, out.input_ids), "each access must view the same buffer, not copy it"
    assert not ids.flags.writeable
    with pytest.raises(ValueError):
        ids[0] = 1
    assert out.block_tables.shape == (1, 2) and out.block_tables.dtype == np.int32
    assert out.block_copies.shape == (0, 2)
    assert out.seq_ids.dtype == np.int64
    del out  # the views keep the step alive
    assert ids.tolist() == [10, 11, 12, 13, 14]


def test_slot_mapping_matches_block_tables():
    s = make_scheduler(block_size=4)
    s.add_sequence(list(range(3, 12)), max_tokens=4)
    s.add_sequence(list(range(20, 26)), max_tokens=4)
    out = s.schedule()
    qsl, bt = out.query_start_loc, out.block_tables
    for row in range(out.num_seqs):
        for i in range(qsl[row], qsl[row + 1]):
            pos = out.positions[i]
            assert out.slot_mapping[i] == bt[row, pos // 4] * 4 + pos % 4


def test_update_validates_the_number_of_tokens_and_allows_retry():
    s = make_scheduler()
    s.add_sequence([5, 6, 7], max_tokens=3, n=2)
    out = s.schedule()
    assert out.total_samples == 2
    with pytest.raises(ValueError, match="2"):
        s.update([1])
    result = s.update([8, 9])
    assert len(result.forks) == 1 and result.forks[0].sample_index == 1
    with pytest.raises(RuntimeError):
        s.update([1, 2])  # no step in flight


def test_bad_config_and_bad_prompt_raise_value_error():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        _core.Scheduler(_core.SchedulerConfig(num_blocks=4, max_num_seqs=8, max_num_batched_tokens=4))
    s = make_scheduler()
    with pytest.raises(ValueError, match="empty"):
        s.add_sequence([], max_tokens=1)
    with pytest.raises(ValueError, match="max_tokens"):
        s.add_sequence([1], max_tokens=0)


def test_block_table_fork_and_copy_on_write_from_python():
    pool = _core.BlockPool(num_blocks=4, block_size=4, enable_prefix_caching=False)
    table = _core.BlockTable(pool)
    assert table.prepare_write(0, 6) == []
    child = table.fork()
    assert child.blocks == table.blocks
    assert pool.refcount(table.blocks[1]) == 2
    copies = child.prepare_write(6, 7)
    assert len(copies) == 1 and copies[0][0] == table.blocks[1] and child.blocks[1] == copies[0][1]
    pool.end_step()
    assert child.prepare_write(7, 20) is None, "exhaustion is a None, not an exception"
    del table, child
    assert pool.num_free == 4
    pool.check_invariants()


def test_prefix_match_from_python():
    pool = _core.BlockPool(num_blocks=8, block_size=4, enable_prefix_caching=True)
    prompt = list(range(100, 110))
    first = _core.BlockTable(pool)
    first.prepare_write(0, 10)
    first.register_full_blocks(prompt, 10)
    del first
    second = _core.BlockTable(pool)
    assert second.match_prefix(pool, prompt) == 8
    assert pool.prefix_counters["hit_blocks"] == 2


def run_engine_loop(s, rng, requests, protected=()):
    """A simulated engine: random tokens, stop strings, aborts; returns finish reasons by seq id.

    Requests at the indices in `protected` are never aborted or stopped by the loop.
    """
    finished = {}
    live = set()
    keep = set()
    for i, (prompt, kw) in enumerate(requests):
        seq_id = s.add_sequence(prompt, **kw)
        live.add(seq_id)
        if i in protected:
            keep.add(seq_id)
    steps = 0
    while s.has_unfinished():
        steps += 1
        assert steps < 10000, "the scheduler stalled"
        out = s.schedule()
        for f in out.rejected:
            finished[f.seq_id] = f.reason
            live.discard(f.seq_id)
        sampled = np.array([rng.choice([2, 5, 6, 7, 8, 9]) for _ in range(out.total_samples)], dtype=np.int32)
        result = s.update(sampled)
        for fork in result.forks:
            live.add(fork.child)
        for f in result.finished:
            finished[f.seq_id] = f.reason
            live.discard(f.seq_id)
        if live - keep and rng.random() < 0.05:
            victim = rng.choice(sorted(live - keep))
            assert s.abort(victim)
            finished[victim] = _core.FinishReason.ABORT
            live.discard(victim)
        if live - keep and rng.random() < 0.03:  # a stop string found in Python
            victim = rng.choice(sorted(live - keep))
            assert s.finish(victim, _core.FinishReason.STOP)
            finished[victim] = _core.FinishReason.STOP
            live.discard(victim)
    assert not live
    return finished


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_simulated_engine_finishes_everything_and_frees_the_pool(prefix_caching):
    rng = random.Random(7)
    s = make_scheduler(num_blocks=24, block_size=4, enable_prefix_caching=prefix_caching)
    shared = [rng.randrange(3, 50) for _ in range(9)]
    requests = []
    for i in range(60):
        prompt = (shared if i % 2 else []) + [rng.randrange(3, 50) for _ in range(rng.randrange(1, 30))]
        requests.append((prompt, dict(max_tokens=rng.randrange(1, 40), n=rng.choice([1, 1, 2, 3]))))
    requests.append(([3] * 200, dict(max_tokens=4)))  # needs more blocks than the pool: rejected
    finished = run_engine_loop(s, rng, requests, protected={len(requests) - 1})
    assert list(finished.values()).count(_core.FinishReason.REJECTED) == 1
    stats = s.stats()
    assert stats["num_preemptions"] > 0, "the pool is small enough to force preemption"
    assert s.pool.num_free == 24 and s.pool.total_refs == 0
    s.pool.check_invariants()
    if prefix_caching:
        assert stats["prefix_hit_blocks"] > 0


def test_stats_and_views_for_the_engine_page():
    s = make_scheduler(num_blocks=16)
    s.add_sequence(list(range(3, 9)), max_tokens=5, n=2)
    s.update(np.array([7, 8], dtype=np.int32)) if s.schedule() else None
    stats = s.stats()
    assert stats["num_running"] == 2 and stats["blocks_saved_by_sharing"] == 2
    states = s.pool.block_states()
    assert len(states) == 16
    assert states.count(int(_core.BlockState.SHARED)) == 2
    info = s.sequence(s.running_ids[0])
    assert info["status"] == "running" and info["token_ids"][:6] == list(range(3, 9))
    assert s.sequence(999) is None


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_sliding_window_scheduler_feeds_windowed_attention(prefix_caching):
    """With sliding_window W the step's block tables hold -1 before each row's window, the sequence
    holds about W / block_size + 1 blocks however long it grows (a 40-token prompt in a 6-block pool of
    4-token blocks), and windowed paged attention over those tables matches a naive loop."""
    import torch

    from pagedserve import ops

    window, bs, dim = 7, 4, 16
    s = make_scheduler(num_blocks=6, block_size=bs, sliding_window=window, max_num_batched_tokens=8,
                       enable_prefix_caching=prefix_caching)
    gen = torch.Generator().manual_seed(3)
    keys, values = torch.randn(64, 1, dim, generator=gen), torch.randn(64, 1, dim, generator=gen)
    key_cache = torch.full((6, 1, bs, dim), float("nan"))
    value_cache = torch.full((6, 1, bs, dim), float("nan"))
    s.add_sequence([3 + i % 5 for i in range(40)], max_tokens=6, ignore_eos=True)
    steps = 0
    while s.has_unfinished():
        out = s.schedule()
        positions = torch.from_numpy(out.positions.copy()).long()
        slots = torch.from_numpy(out.slot_mapping.copy())
        ops.reshape_and_cache(keys[positions], values[positions], key_cache, value_cache, slots)
        tables = torch.from_numpy(out.block_tables.copy())
        seq_len, q_len = int(out.seq_lens[0]), len(positions)
        first = max(0, seq_len - q_len - window + 1)
        assert (tables[0, :first // bs] == -1).all() and (tables[0, first // bs:(seq_len + bs - 1) // bs] >= 0).all()
        query = torch.randn(q_len, 2, dim, generator=gen)
        attn = torch.empty_like(query)
        ops.paged_attention(attn, query, key_cache, value_cache, tables, torch.from_numpy(out.query_start_loc.copy()),
                            torch.from_numpy(out.seq_lens.copy()), 0.25, q_len, seq_len, window=window)
        for i, p in enumerate(positions.tolist()):
            visible = range(max(0, p - window + 1), p + 1)
            k, v = keys[list(visible), 0], values[list(visible), 0]
            expected = torch.softmax(query[i] @ k.T * 0.25, -1) @ v
            torch.testing.assert_close(attn[i], expected, rtol=1e-5, atol=1e-5)
        s.update(np.full(out.total_samples, 5, dtype=np.int32))
        assert s.pool.num_used <= (window - 1 + bs - 1) // bs + 1 + (8 + bs - 1) // bs
        steps += 1
    assert steps >= 10 and s.pool.num_free == 6 and s.pool.total_refs == 0
    s.pool.check_invariants()
