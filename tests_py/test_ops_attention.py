"""pagedserve.ops.paged_attention against scaled_dot_product_attention on K/V
gathered through the block table."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from ops_testing import DTYPES, TOL, cpu_isa, gen, randn, torch_single_thread  # noqa: F401  (fixtures)

from pagedserve import ops


# ---------------------------------------------------------------------------
# Paged attention


def build_paged_batch(specs, q_heads, kv_heads, head_dim, block_size, dtype, gen, pad_tokens=0):
    """A batch of (seq_len, q_len) rows with each sequence's blocks scattered across the pool."""
    blocks_per_seq = [math.ceil(seq_len / block_size) for seq_len, _ in specs]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_seq) + 1
    block_tables = torch.zeros(len(specs), max_blocks, dtype=torch.int32)  # padded with kPadBlock = 0
    key_cache = randn(num_blocks, kv_heads, block_size, head_dim, gen=gen, dtype=dtype)
    value_cache = randn(num_blocks, kv_heads, block_size, head_dim, gen=gen, dtype=dtype)
    contexts = []
    for s, ((seq_len, _), n) in enumerate(zip(specs, blocks_per_seq)):
        blocks = [order.pop() for _ in range(n)]
        block_tables[s, :n] = torch.tensor(blocks, dtype=torch.int32)
        positions = torch.arange(seq_len)
        ids = block_tables[s, positions // block_size].long()
        contexts.append((key_cache[ids, :, positions % block_size], value_cache[ids, :, positions % block_size]))
    q_lens = [q_len for _, q_len in specs]
    query_start_loc = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    num_tokens = int(query_start_loc[-1]) + pad_tokens
    query = randn(num_tokens, q_heads, head_dim, gen=gen, dtype=dtype)
    seq_lens = torch.tensor([seq_len for seq_len, _ in specs], dtype=torch.int32)
    return dict(query=query, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
                query_start_loc=query_start_loc, seq_lens=seq_lens), contexts


def reference_attention(batch, contexts, scale):
    """SDPA per sequence on K/V gathered to contiguous, with the causal offset mask, in float32."""
    query, starts = batch["query"], batch["query_start_loc"].tolist()
    out = torch.full(query.shape, float("nan"))
    q_heads = query.shape[1]
    for s, (keys, values) in enumerate(contexts):
        q = query[starts[s]:starts[s + 1]].float()
        q_len, seq_len = q.shape[0], keys.shape[0]
        if q_len == 0:
            continue
        group = q_heads // keys.shape[1]
        k = keys.float().repeat_interleave(group, dim=1)
        v = values.float().repeat_interleave(group, dim=1)
        # query i sits at position seq_len - q_len + i and sees positions <= its own
        mask = torch.arange(seq_len)[None, :] <= (seq_len - q_len + torch.arange(q_len))[:, None]
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=mask, scale=scale)
        out[starts[s]:starts[s + 1]] = o.transpose(0, 1)
    return out


def run_paged_attention(batch, scale):
    out = torch.full_like(batch["query"], float("nan"))
    ops.paged_attention(out, batch["query"], batch["key_cache"], batch["value_cache"], batch["block_tables"],
                        batch["query_start_loc"], batch["seq_lens"], scale,
                        max_query_len=int(batch["query_start_loc"].diff().max()),
                        max_seq_len=int(batch["seq_lens"].max()))
    return out


# Decodes first, then prefill chunks with earlier context, a fresh prompt and an empty row.
MIXED = [(1, 1), (17, 1), (300, 1), (47, 1), (40, 24), (100, 37), (33, 33), (5, 0), (70, 9)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 8)])
def test_paged_attention_matches_sdpa(dtype, q_heads, kv_heads, head_dim, block_size, gen):
    batch, contexts = build_paged_batch(MIXED, q_heads, kv_heads, head_dim, block_size, dtype, gen, pad_tokens=2)
    scale = head_dim ** -0.5
    out = run_paged_attention(batch, scale)
    expected = reference_attention(batch, contexts, scale)
    num_real = int(batch["query_start_loc"][-1])
    torch.testing.assert_close(out[:num_real].float(), expected[:num_real], **TOL[dtype])
    assert out[num_real:].isnan().all(), "padding tokens past query_start_loc[-1] must not be written"


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_every_cpu_isa(dtype, gen, cpu_isa):
    batch, contexts = build_paged_batch(MIXED, 9, 3, 64, 16, dtype, gen)
    out = run_paged_attention(batch, 0.125)
    torch.testing.assert_close(out.float(), reference_attention(batch, contexts, 0.125), **TOL[dtype])


def test_paged_attention_same_result_with_one_thread(gen):
    batch, _ = build_paged_batch([(300, 1)] * 8 + [(200, 64)], 9, 3, 64, 16, torch.float32, gen)
    threads = ops.num_threads()
    try:
        ops.set_num_threads(1)
        single = run_paged_attention(batch, 0.125)
        ops.set_num_threads(max(threads, 2))
        multi = run_paged_attention(batch, 0.125)
    finally:
        ops.set_num_threads(threads)
    assert torch.equal(single, multi)


def test_paged_attention_releases_the_gil(gen):
    """Another Python thread keeps running while a long attention call is in C++."""
    batch, _ = build_paged_batch([(1500, 1500)], 9, 3, 64, 16, torch.float32, gen)
    out = torch.empty_like(batch["query"])
    args = (out, batch["query"], batch["key_cache"], batch["value_cache"], batch["block_tables"],
            batch["query_start_loc"], batch["seq_lens"], 0.125, 1500, 1500)
    window = {}

    def attend():
        window["start"] = time.perf_counter()
        ops.paged_attention(*args)
        window["end"] = time.perf_counter()

    worker = threading.Thread(target=attend)
    ticks = []
    worker.start()
    while worker.is_alive():
        ticks.append(time.perf_counter())
    worker.join()
    # Ignore the edges, where the worker still holds the GIL converting arguments.
    margin = 0.1 * (window["end"] - window["start"])
    inside = [t for t in ticks if window["start"] + margin < t < window["end"] - margin]
    assert len(inside) > 100, f"only {len(inside)} ticks of this thread ran during the call"


def test_paged_attention_rejects_inconsistent_batch(gen):
    batch, _ = build_paged_batch([(20, 4)], 2, 1, 64, 16, torch.float32, gen)
    batch["seq_lens"][0] = 3
    with pytest.raises(ValueError, match="shorter than its 4 queries"):
        run_paged_attention(batch, 0.125)
    batch["seq_lens"][0] = 20
    batch["block_tables"][0, 1] = 1000
    with pytest.raises(ValueError, match=r"block_tables\[1\] = 1000"):
        run_paged_attention(batch, 0.125)
    batch["block_tables"][0, 1] = 0
    batch["seq_lens"][0] = 16 * batch["block_tables"].shape[1] + 1
    with pytest.raises(ValueError, match="needs 4 blocks, the block table has 3"):
        run_paged_attention(batch, 0.125)
