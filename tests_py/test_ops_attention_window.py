"""pagedserve.ops.paged_attention's options, sliding window and logit soft-capping, against a naive
loop over each query's visible positions (transformers' sliding_window_causal mask: the query at
position p sees keys p - window < k <= p; Gemma 2's capping: s = softcap * tanh(s / softcap)).

Blocks wholly before every query's window are given back to the pool in the engine, so here their
block-table entries are -1 and their slots NaN: the op must not read them."""

from __future__ import annotations

import math

import pytest
import torch
from ops_testing import DTYPES, TOL, cpu_isa, gen, randn, torch_single_thread  # noqa: F401  (fixtures)

from pagedserve import ops


def windowed_batch(specs, q_heads, kv_heads, head_dim, block_size, dtype, gen, window, query_scale=1.0):
    """(seq_len, q_len) rows over scattered blocks; blocks before each row's first window are dropped."""
    blocks_per_seq = [math.ceil(seq_len / block_size) for seq_len, _ in specs]
    num_blocks = sum(blocks_per_seq) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    key_cache = randn(num_blocks, kv_heads, block_size, head_dim, gen=gen, dtype=dtype)
    value_cache = randn(num_blocks, kv_heads, block_size, head_dim, gen=gen, dtype=dtype)
    block_tables = torch.full((len(specs), max(blocks_per_seq) + 1), -1, dtype=torch.int32)
    for s, ((seq_len, q_len), n) in enumerate(zip(specs, blocks_per_seq)):
        first_visible = max(0, seq_len - q_len - window + 1) if window > 0 else 0
        for b in range(n):
            block = order.pop()
            if (b + 1) * block_size <= first_visible:  # wholly before every query's window: freed
                key_cache[block] = float("nan")
                value_cache[block] = float("nan")
            else:
                block_tables[s, b] = block
    q_lens = [q_len for _, q_len in specs]
    query_start_loc = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    query = randn(int(query_start_loc[-1]), q_heads, head_dim, gen=gen, dtype=dtype, scale=query_scale)
    seq_lens = torch.tensor([seq_len for seq_len, _ in specs], dtype=torch.int32)
    return dict(query=query, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
                query_start_loc=query_start_loc, seq_lens=seq_lens)


def naive_attention(batch, scale, window=0, softcap=0.0):
    """One query, one head at a time over its visible positions, in float64."""
    query, kc, vc, tables = batch["query"], batch["key_cache"], batch["value_cache"], batch["block_tables"]
    starts, lens = batch["query_start_loc"].tolist(), batch["seq_lens"].tolist()
    block_size = kc.shape[2]
    group = query.shape[1] // kc.shape[1]
    out = torch.zeros(query.shape, dtype=torch.float64)
    for s in range(len(lens)):
        q_len = starts[s + 1] - starts[s]
        for i in range(q_len):
            position = lens[s] - q_len + i
            first = max(0, position - window + 1) if window > 0 else 0
            keys = torch.arange(first, position + 1)
            blocks = tables[s, keys // block_size].long()
            k = kc[blocks, :, keys % block_size].double()  # [n, Hkv, D]
            v = vc[blocks, :, keys % block_size].double()
            for head in range(query.shape[1]):
                scores = k[:, head // group] @ query[starts[s] + i, head].double() * scale
                if softcap > 0:
                    scores = softcap * torch.tanh(scores / softcap)
                out[starts[s] + i, head] = torch.softmax(scores, 0) @ v[:, head // group]
    return out


def run(batch, scale, **options):
    out = torch.full_like(batch["query"], float("nan"))
    ops.paged_attention(out, batch["query"], batch["key_cache"], batch["value_cache"], batch["block_tables"],
                        batch["query_start_loc"], batch["seq_lens"], scale,
                        max_query_len=int(batch["query_start_loc"].diff().max()),
                        max_seq_len=int(batch["seq_lens"].max()), **options)
    return out


# Decodes first (short, long, exactly one block), then prefill chunks after a cached prefix and fresh prompts.
SPECS = [(1, 1), (37, 1), (300, 1), (16, 1), (90, 24), (200, 70), (33, 33), (5, 5)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 8), (80, 5)])
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("window", [1, 7, 16, 50, 1000])
@pytest.mark.parametrize("softcap", [0.0, 4.0])
def test_window_and_softcap_match_naive_loop(dtype, head_dim, block_size, q_heads, kv_heads, window, softcap, gen):
    batch = windowed_batch(SPECS, q_heads, kv_heads, head_dim, block_size, dtype, gen, window,
                           query_scale=3.0 if softcap else 1.0)
    scale = head_dim ** -0.5
    out = run(batch, scale, window=window, softcap=softcap)
    torch.testing.assert_close(out.double(), naive_attention(batch, scale, window, softcap), **TOL[dtype],
                               check_dtype=False)


@pytest.mark.parametrize("softcap", [0.0, 2.5, 30.0])
def test_softcap_without_window_matches_naive_loop(softcap, gen):
    batch = windowed_batch(SPECS, 9, 3, 64, 16, torch.float32, gen, 0, query_scale=4.0)
    out = run(batch, 0.125, softcap=softcap)
    torch.testing.assert_close(out.double(), naive_attention(batch, 0.125, 0, softcap), **TOL[torch.float32],
                               check_dtype=False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_window_and_softcap_every_cpu_isa(dtype, gen, cpu_isa):
    batch = windowed_batch(SPECS, 9, 3, 64, 16, dtype, gen, 21, query_scale=3.0)
    out = run(batch, 0.125, window=21, softcap=3.0)
    torch.testing.assert_close(out.double(), naive_attention(batch, 0.125, 21, 3.0), **TOL[dtype], check_dtype=False)


def test_window_at_least_the_context_is_full_attention(gen):
    batch = windowed_batch(SPECS, 8, 2, 64, 16, torch.float32, gen, 0)
    assert torch.equal(run(batch, 0.125, window=300), run(batch, 0.125))
    assert not torch.equal(run(batch, 0.125, window=299), run(batch, 0.125))


@pytest.mark.parametrize("window", [1, 20, 64])
def test_chunked_prefill_with_window_matches_one_shot(window, gen):
    """A 150-token prompt in chunks of 40 (each after the cached earlier chunks) gives the rows of one shot."""
    batch = windowed_batch([(150, 150)], 8, 2, 64, 16, torch.float32, gen, 0)
    whole = run(batch, 0.125, window=window)
    for begin in range(0, 150, 40):
        end = min(150, begin + 40)
        chunk = dict(batch, query=batch["query"][begin:end].contiguous(),
                     query_start_loc=torch.tensor([0, end - begin], dtype=torch.int32),
                     seq_lens=torch.tensor([end], dtype=torch.int32))
        torch.testing.assert_close(run(chunk, 0.125, window=window), whole[begin:end], rtol=1e-6, atol=1e-6)


def test_rejects_bad_options(gen):
    batch = windowed_batch([(20, 4)], 2, 1, 64, 16, torch.float32, gen, 0)
    with pytest.raises(ValueError, match="window must be >= 0"):
        run(batch, 0.125, window=-1)
    with pytest.raises(ValueError, match="softcap must be finite and >= 0"):
        run(batch, 0.125, softcap=-1.0)
    with pytest.raises(ValueError, match="softcap must be finite and >= 0"):
        run(batch, 0.125, softcap=float("inf"))


def test_entries_before_the_window_are_not_checked_but_those_inside_are(gen):
    batch = windowed_batch([(100, 1)], 2, 1, 64, 16, torch.float32, gen, 10)
    assert (batch["block_tables"][0, :5] == -1).all()  # positions 0..79 lie before the window [90, 99]
    run(batch, 0.125, window=10)
    with pytest.raises(ValueError, match=r"block_tables\[0\] = -1"):
        run(batch, 0.125)  # without the window block 0 is read
