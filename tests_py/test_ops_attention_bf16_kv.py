"""A bf16 KV cache under float32 queries (the CPU's bf16 KV cache), and batch invariance of the attention op.

reshape_and_cache rounds float32 keys/values to bf16 (nearest even, as torch's .to(bfloat16));
paged_attention widens them back exactly and computes in float32, so the oracle is the float64 loop
of test_ops_attention_window.py over the bf16-rounded cache. Batch invariance: a query row's output
is bit-identical (==) whatever else is in the batch and however its prompt was chunked, for every
kernel (the AVX-512 row kernel for float32 queries, the tile kernel for 16-bit queries and at lower
ISA levels)."""

from __future__ import annotations

import pytest
import torch
from ops_testing import DTYPES, cpu_isa, gen, randn, torch_single_thread  # noqa: F401  (fixtures)
from test_ops_attention_window import SPECS, naive_attention, run, windowed_batch

from pagedserve import ops

# float32 accumulation against float64 over contexts of up to 300 positions.
TOL = dict(rtol=2e-5, atol=2e-5)


def with_bf16_cache(batch):
    return dict(batch, key_cache=batch["key_cache"].to(torch.bfloat16),
                value_cache=batch["value_cache"].to(torch.bfloat16))


@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 8), (80, 5), (40, 16), (24, 3)])
@pytest.mark.parametrize("q_heads,kv_heads", [(9, 3), (4, 4)])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (21, 0.0), (0, 4.0), (7, 3.0)])
def test_bf16_cache_matches_float64_loop(head_dim, block_size, q_heads, kv_heads, window, softcap, gen):
    batch = with_bf16_cache(windowed_batch(SPECS, q_heads, kv_heads, head_dim, block_size, torch.float32, gen,
                                           window, query_scale=3.0 if softcap else 1.0))
    scale = head_dim ** -0.5
    out = run(batch, scale, window=window, softcap=softcap)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), naive_attention(batch, scale, window, softcap), **TOL,
                               check_dtype=False)


def test_bf16_cache_every_cpu_isa(gen, cpu_isa):
    batch = with_bf16_cache(windowed_batch(SPECS, 9, 3, 64, 16, torch.float32, gen, 0))
    torch.testing.assert_close(run(batch, 0.125).double(), naive_attention(batch, 0.125), **TOL, check_dtype=False)


def test_bf16_cache_same_result_with_one_thread(gen):
    batch = with_bf16_cache(windowed_batch([(300, 1)] * 8 + [(200, 64)], 9, 3, 64, 16, torch.float32, gen, 0))
    threads = ops.num_threads()
    try:
        ops.set_num_threads(1)
        single = run(batch, 0.125)
        ops.set_num_threads(max(threads, 2))
        multi = run(batch, 0.125)
    finally:
        ops.set_num_threads(threads)
    assert torch.equal(single, multi)


def test_reshape_and_cache_rounds_float32_to_bf16_like_torch(gen):
    tokens, kv_heads, head_dim, block_size, num_blocks = 7, 3, 40, 4, 5
    key = randn(tokens, kv_heads, head_dim, gen=gen, scale=10.0)
    value = randn(tokens, kv_heads, head_dim, gen=gen)
    # Ties (round to even both ways), overflow to inf, the largest bf16, NaN, infinities and a subnormal.
    specials = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 3.3961e38, 3.3895e38, float("nan"), float("inf"),
                             -float("inf"), 1e-40, -0.0])
    key[0, 0, :len(specials)] = specials
    key_cache = torch.zeros(num_blocks, kv_heads, block_size, head_dim, dtype=torch.bfloat16)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.tensor([5, 0, -1, 19, 7, 12, 3], dtype=torch.int32)
    ops.reshape_and_cache(key, value, key_cache, value_cache, slots)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        got_k, got_v = key_cache[slot // block_size, :, slot % block_size], value_cache[slot // block_size, :, slot % block_size]
        expected_k = key[t].to(torch.bfloat16)
        assert torch.equal(got_k.view(torch.int16)[~expected_k.isnan()], expected_k.view(torch.int16)[~expected_k.isnan()])
        assert torch.equal(got_k.isnan(), expected_k.isnan())
        assert torch.equal(got_v.view(torch.int16), value[t].to(torch.bfloat16).view(torch.int16))
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[slots >= 0].long()] = True
    assert (key_cache.permute(0, 2, 1, 3).reshape(-1, kv_heads, head_dim)[~written] == 0).all(), "only slots written"


def test_cache_dtype_contract(gen):
    key = randn(2, 1, 8, gen=gen)
    slots = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="key_cache must have the same dtype as the other inputs .float32. or be bfloat16"):
        ops.reshape_and_cache(key, key, torch.zeros(2, 1, 4, 8, dtype=torch.float16),
                              torch.zeros(2, 1, 4, 8, dtype=torch.float16), slots)
    with pytest.raises(ValueError, match="value_cache must have the same dtype"):
        ops.reshape_and_cache(key, key, torch.zeros(2, 1, 4, 8, dtype=torch.bfloat16), torch.zeros(2, 1, 4, 8), slots)
    batch = windowed_batch([(20, 4)], 2, 1, 64, 16, torch.bfloat16, gen, 0)
    with pytest.raises(ValueError, match=r"key_cache must have the same dtype as the other inputs \(bfloat16\), got"):
        run(dict(batch, key_cache=batch["key_cache"].float(), value_cache=batch["value_cache"].float()), 0.125)


# ---------------------------------------------------------------------------
# Batch invariance


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    bits = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(bits), b.view(bits))


def _rows_of(out, batch, seq):
    starts = batch["query_start_loc"].tolist()
    return out[starts[seq]:starts[seq + 1]]


def _single(batch, seq, begin, end):
    """Sequence seq's queries [begin, end) of its chunk as their own one-row batch (the same cache)."""
    starts, lens = batch["query_start_loc"].tolist(), batch["seq_lens"].tolist()
    q_len = starts[seq + 1] - starts[seq]
    first_position = lens[seq] - q_len
    return dict(batch, query=batch["query"][starts[seq] + begin:starts[seq] + end].contiguous(),
                query_start_loc=torch.tensor([0, end - begin], dtype=torch.int32),
                seq_lens=torch.tensor([first_position + end], dtype=torch.int32),
                block_tables=batch["block_tables"][seq:seq + 1].contiguous())


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                               (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)])
@pytest.mark.parametrize("window", [0, 21])
def test_rows_are_bit_identical_alone_in_a_batch_and_in_any_chunking(dtype, cache_dtype, window, gen, cpu_isa):
    """Each row of the mixed batch equals (==) the same row computed alone, in chunks of 1, 5 and 37 queries
    (the last query of a prompt left alone in its chunk, as a prefix-cache hit leaves it, included)."""
    batch = windowed_batch(SPECS, 9, 3, 64, 16, torch.float32, gen, window)
    batch = dict(batch, query=batch["query"].to(dtype), key_cache=batch["key_cache"].to(cache_dtype),
                 value_cache=batch["value_cache"].to(cache_dtype))
    whole = run(batch, 0.125, window=window)
    starts = batch["query_start_loc"].tolist()
    for seq in range(len(SPECS)):
        q_len = starts[seq + 1] - starts[seq]
        expected = _rows_of(whole, batch, seq)
        for chunk in (q_len, 1, 5, 37):
            for begin in range(0, q_len, chunk):
                end = min(q_len, begin + chunk)
                got = run(_single(batch, seq, begin, end), 0.125, window=window)
                assert same_bits(got, expected[begin:end]), \
                    f"sequence {seq}, queries [{begin}, {end}) differ from the batched rows"


def test_kv_cache_dtype_rule():
    from pagedserve.worker.kv_cache import kv_cache_dtype

    f32, bf16 = torch.float32, torch.bfloat16
    assert kv_cache_dtype("auto", f32, "cpu", "float32") == f32, "the exact float32 mode keeps a float32 cache"
    assert kv_cache_dtype("auto", f32, "cpu", "auto") == f32
    assert kv_cache_dtype("auto", f32, "cpu", "bfloat16") == bf16
    assert kv_cache_dtype("auto", bf16, "cpu", "float32") == bf16
    assert kv_cache_dtype("auto", torch.float16, "cpu", "float32") == torch.float16
    assert kv_cache_dtype("bfloat16", f32, "cpu") == bf16
    assert kv_cache_dtype("auto", f32, "cpu", "float32", quantized_weights=True) == bf16, "GGUF and int8 weights"
    assert kv_cache_dtype("float32", f32, "cpu", "float32", quantized_weights=True) == f32, "asked for: kept"
    assert kv_cache_dtype("auto", f32, "cuda", "bfloat16") == f32, "CUDA: the model's dtype"
    assert kv_cache_dtype("auto", f32, "cuda", "float32", quantized_weights=True) == f32
    assert kv_cache_dtype("bfloat16", bf16, "cuda") == bf16
    with pytest.raises(ValueError, match="on cuda the KV cache has the model's dtype; use kv_cache_dtype auto"):
        kv_cache_dtype("bfloat16", f32, "cuda")
    with pytest.raises(ValueError, match="under a float32 model, bfloat16"):
        kv_cache_dtype("float32", bf16, "cpu")
    with pytest.raises(ValueError, match="not supported"):
        kv_cache_dtype("fp8", f32, "cpu")
