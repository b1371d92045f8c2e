"""GPU tests of the CUDA kernels (pagedserve._core.cuda_ops).

Every kernel is checked against two oracles: the CPU reference op
(pagedserve._core.ops, run on CPU copies) and a float64 torch reference.
Inputs are fresh random draws (seeded per test for reproducible failures, the
seed is in the assertion message), outputs are poisoned with NaN first so an
unwritten element fails. Cache slots no sequence may read hold NaN, so a kernel that reads past a
sequence's length fails too. scripts/gpu_check.sh runs the whole file under
compute-sanitizer memcheck, and a small attention subset under racecheck and synccheck:

    compute-sanitizer --tool racecheck python -m pytest tests_py/test_cuda_ops.py -k sanitizer_subset_attention
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys

import pytest
import torch
from torch.utils.dlpack import to_dlpack

try:
    from pagedserve import _core
except ImportError:  # the extension is not built: every test here skips
    _core = None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        _core is None or not getattr(_core, "has_cuda", False) or not torch.cuda.is_available(),
        reason="needs a CUDA GPU and pagedserve._core built with USE_CUDA=ON",
    ),
]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Relative Frobenius error allowed against the float64 reference and the CPU op.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
PAD_SLOT = -1


# ---------------------------------------------------------------------------
# Calling the ops.


def _args(args):
    return [to_dlpack(a) if isinstance(a, torch.Tensor) else a for a in args]


def cuda_op(name, *args, stream=None, **options):
    """Runs pagedserve._core.cuda_ops.<name> on `stream` (default: the current one)."""
    stream = stream if stream is not None else torch.cuda.current_stream()
    options = {key: to_dlpack(v) if isinstance(v, torch.Tensor) else v for key, v in options.items()}
    getattr(_core.cuda_ops, name)(*_args(args), stream=stream.cuda_stream, **options)


def cpu_op(name, *args):
    """Runs the CPU reference op on CPU tensors (they are modified in place where the op writes)."""
    getattr(_core.ops, name)(*_args(args))


def seeded(seed: int) -> torch.Generator:
    torch.manual_seed(seed)
    random.seed(seed)
    return torch.Generator(device="cpu").manual_seed(seed)


def fresh_seed() -> int:
    return random.SystemRandom().randrange(2**31)


def randn(shape, dtype, scale=1.0):
    return (torch.randn(shape, dtype=torch.float64) * scale).to(dtype).cuda()


def nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual = actual.double().cpu()
    expected = expected.double().cpu()
    assert torch.isfinite(actual).all(), "non-finite values in the output (unwritten or corrupted elements)"
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def assert_close(actual, expected, dtype, what, seed):
    err = rel_err(actual, expected)
    assert err < TOLERANCE[dtype], f"{what}: relative error {err:.3g} >= {TOLERANCE[dtype]} (seed {seed})"


def misaligned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t whose data pointer is NOT 16-byte aligned."""
    storage = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = storage[1:].view(t.shape)
    view.copy_(t)
    assert view.data_ptr() % 16 != 0
    return view


# ---------------------------------------------------------------------------
# rms_norm / fused_add_rms_norm


def rms_norm_ref(x, weight, eps):
    """HF LlamaRMSNorm rounding: the normalized value is rounded to the dtype before the weight multiply."""
    xd = x.double()
    normalized = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return normalized.double() * weight.double()


NORM_SHAPES = [(1, 2048), (7, 128), (300, 2048), (5, 1001), (3, 16384), (2, 8)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", NORM_SHAPES)
def test_rms_norm(dtype, rows, hidden):
    seed = fresh_seed()
    seeded(seed)
    eps = 1e-6
    x = randn((rows, hidden), dtype, scale=3.0)
    weight = randn((hidden,), dtype)
    out = nan_like(x)
    cuda_op("rms_norm", out, x, weight, eps)
    cpu_out = torch.full((rows, hidden), float("nan"), dtype=dtype)
    cpu_op("rms_norm", cpu_out, x.cpu(), weight.cpu(), eps)
    assert_close(out, rms_norm_ref(x, weight, eps), dtype, "vs float64", seed)
    assert_close(out, cpu_out, dtype, "vs CPU op", seed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_unaligned_and_per_head(dtype):
    """A misaligned input takes the scalar path; Qwen3's q-norm views [T, heads, D] as [T * heads, D]."""
    seed = fresh_seed()
    seeded(seed)
    x = misaligned(randn((40 * 16, 128), dtype))
    weight = randn((128,), dtype)
    out = nan_like(x)
    cuda_op("rms_norm", out, x, weight, 1e-5)
    assert_close(out, rms_norm_ref(x, weight, 1e-5), dtype, "misaligned vs float64", seed)


@pytest.mark.parametrize("rows,hidden", [(1, 576), (3, 576), (10, 576), (16, 576), (40, 576), (64, 576), (300, 576),
                                         (1, 1024), (12, 1024), (1, 2048), (3, 2048), (10, 2048), (16, 2048),
                                         (40, 2048), (64, 2048), (64, 4096), (257, 4096)])
def test_rms_norm_is_bit_identical_to_transformers(rows, hidden):
    """bf16 rows normalize exactly as transformers' LlamaRMSNorm does on the same tensor (same
    summation order as torch's mean, same rsqrt), with and without the residual add."""
    seed = fresh_seed()
    seeded(seed)
    x, residual = randn((rows, hidden), torch.bfloat16, 3.0), randn((rows, hidden), torch.bfloat16, 3.0)
    weight = randn((hidden,), torch.bfloat16)
    eps = 1e-5

    def llama_rms_norm(h):  # transformers' LlamaRMSNorm.forward
        h32 = h.to(torch.float32)
        variance = h32.pow(2).mean(-1, keepdim=True)
        return weight * (h32 * torch.rsqrt(variance + eps)).to(torch.bfloat16)

    out = nan_like(x)
    cuda_op("rms_norm", out, x, weight, eps)
    assert torch.equal(out, llama_rms_norm(x)), f"rms_norm differs from transformers (seed {seed})"
    new_residual = residual + x
    cuda_op("fused_add_rms_norm", x, residual, weight, eps)
    assert torch.equal(residual, new_residual), f"residual differs (seed {seed})"
    assert torch.equal(x, llama_rms_norm(new_residual)), f"fused_add_rms_norm differs from transformers (seed {seed})"


def fused_add_rms_norm_ref(x, residual, weight, eps):
    new_residual = (x.double() + residual.double()).to(x.dtype)  # the residual is stored rounded
    return rms_norm_ref(new_residual, weight, eps), new_residual


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", NORM_SHAPES)
def test_fused_add_rms_norm(dtype, rows, hidden):
    seed = fresh_seed()
    seeded(seed)
    eps = 1e-5
    x = randn((rows, hidden), dtype, scale=2.0)
    residual = randn((rows, hidden), dtype, scale=2.0)
    weight = randn((hidden,), dtype)
    expected_x, expected_residual = fused_add_rms_norm_ref(x, residual, weight, eps)
    cpu_x, cpu_residual = x.cpu(), residual.cpu()
    cpu_op("fused_add_rms_norm", cpu_x, cpu_residual, weight.cpu(), eps)
    cuda_op("fused_add_rms_norm", x, residual, weight, eps)
    assert_close(residual, expected_residual, dtype, "residual vs float64", seed)
    assert_close(x, expected_x, dtype, "x vs float64", seed)
    assert_close(residual, cpu_residual, dtype, "residual vs CPU op", seed)
    assert_close(x, cpu_x, dtype, "x vs CPU op", seed)


# ---------------------------------------------------------------------------
# rotary_embedding


def cos_sin_table(max_position, rotary_dim, theta=10000.0):
    inv_freq = theta ** (-torch.arange(0, rotary_dim // 2, dtype=torch.float64) * 2 / rotary_dim)
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float().cuda()


def rotary_ref(positions, x, cos_sin):
    rotary_dim = cos_sin.shape[1]
    half = rotary_dim // 2
    table = cos_sin.double()[positions.long()]
    cos, sin = table[:, None, :half], table[:, None, half:]
    x = x.double().clone()
    x1, x2 = x[..., :half].clone(), x[..., half:rotary_dim].clone()
    x[..., :half] = x1 * cos - x2 * sin
    x[..., half:rotary_dim] = x2 * cos + x1 * sin
    return x


ROTARY_SHAPES = [  # tokens, q heads, kv heads, head dim, rotary dim
    (1, 32, 8, 128, 128),
    (37, 8, 2, 128, 64),  # partial rotary
    (64, 4, 4, 64, 64),
    (9, 6, 2, 80, 40),  # half = 20: not a multiple of the vector width, scalar path
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hq,hkv,head_dim,rotary_dim", ROTARY_SHAPES)
def test_rotary_embedding(dtype, tokens, hq, hkv, head_dim, rotary_dim):
    seed = fresh_seed()
    seeded(seed)
    max_position = 4096
    cos_sin = cos_sin_table(max_position, rotary_dim)
    positions = torch.randint(0, max_position, (tokens,), dtype=torch.int32).cuda()
    query = randn((tokens, hq, head_dim), dtype)
    key = randn((tokens, hkv, head_dim), dtype)
    expected_q, expected_k = rotary_ref(positions, query, cos_sin), rotary_ref(positions, key, cos_sin)
    cpu_q, cpu_k = query.cpu(), key.cpu()
    cpu_op("rotary_embedding", positions.cpu(), cpu_q, cpu_k, cos_sin.cpu())
    cuda_op("rotary_embedding", positions, query, key, cos_sin)
    assert_close(query, expected_q, dtype, "query vs float64", seed)
    assert_close(key, expected_k, dtype, "key vs float64", seed)
    assert_close(query, cpu_q, dtype, "query vs CPU op", seed)
    assert_close(key, cpu_k, dtype, "key vs CPU op", seed)


def test_rotary_embedding_skips_out_of_range_positions():
    seeded(fresh_seed())
    cos_sin = cos_sin_table(16, 64)
    positions = torch.tensor([3, -1, 16], dtype=torch.int32).cuda()
    query = randn((3, 2, 64), torch.bfloat16)
    key = randn((3, 1, 64), torch.bfloat16)
    before_q, before_k = query.clone(), key.clone()
    cuda_op("rotary_embedding", positions, query, key, cos_sin)
    assert not torch.equal(query[0], before_q[0])
    assert torch.equal(query[1:], before_q[1:]) and torch.equal(key[1:], before_k[1:])


# ---------------------------------------------------------------------------
# silu_and_mul


def silu_and_mul_ref(x):
    """silu(gate) rounded to the dtype before the product, as HF's LlamaMLP computes it."""
    gate, up = x.double().chunk(2, dim=-1)
    return torch.nn.functional.silu(gate).to(x.dtype).double() * up


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,intermediate", [(1, 5632), (33, 5632), (257, 1024), (5, 1001)])
def test_silu_and_mul(dtype, tokens, intermediate):
    seed = fresh_seed()
    seeded(seed)
    x = randn((tokens, 2 * intermediate), dtype, scale=3.0)
    out = torch.full((tokens, intermediate), float("nan"), dtype=dtype, device="cuda")
    cuda_op("silu_and_mul", out, x)
    cpu_out = torch.full((tokens, intermediate), float("nan"), dtype=dtype)
    cpu_op("silu_and_mul", cpu_out, x.cpu())
    assert_close(out, silu_and_mul_ref(x), dtype, "vs float64", seed)
    assert_close(out, cpu_out, dtype, "vs CPU op", seed)


# ---------------------------------------------------------------------------
# reshape_and_cache / copy_blocks (pure copies: exact)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hkv,head_dim,block_size", [(8, 128, 16), (2, 64, 32), (3, 20, 16)])
def test_reshape_and_cache(dtype, hkv, head_dim, block_size):
    seed = fresh_seed()
    seeded(seed)
    num_blocks, tokens = 40, 97
    key = randn((tokens, hkv, head_dim), dtype)
    value = randn((tokens, hkv, head_dim), dtype)
    key_cache = randn((num_blocks, hkv, block_size, head_dim), dtype)
    value_cache = randn((num_blocks, hkv, block_size, head_dim), dtype)
    slots = torch.randperm(num_blocks * block_size)[:tokens].to(torch.int32)
    slots[torch.randperm(tokens)[:10]] = PAD_SLOT
    slots = slots.cuda()

    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot != PAD_SLOT:
            expected_k[slot // block_size, :, slot % block_size] = key[t]
            expected_v[slot // block_size, :, slot % block_size] = value[t]
    cpu_k, cpu_v = key_cache.cpu(), value_cache.cpu()
    cpu_op("reshape_and_cache", key.cpu(), value.cpu(), cpu_k, cpu_v, slots.cpu())
    cuda_op("reshape_and_cache", key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k), f"keys (seed {seed})"
    assert torch.equal(value_cache, expected_v), f"values (seed {seed})"
    assert torch.equal(key_cache.cpu(), cpu_k) and torch.equal(value_cache.cpu(), cpu_v), f"vs CPU op (seed {seed})"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hkv,block_size,head_dim", [(4, 16, 64), (1, 1, 3)])  # 16-byte words / 2-byte words
def test_copy_blocks(dtype, hkv, block_size, head_dim):
    seed = fresh_seed()
    seeded(seed)
    layers, num_blocks, num_copies = 3, 30, 7
    kv_cache = randn((layers, 2, num_blocks, hkv, block_size, head_dim), dtype)
    ids = torch.randperm(num_blocks)[: 2 * num_copies]  # distinct: no copy reads a block another writes
    copies = torch.stack([ids[:num_copies], ids[num_copies:]], dim=1).to(torch.int32).cuda()
    expected = kv_cache.clone()
    for src, dst in copies.tolist():
        expected[:, :, dst] = kv_cache[:, :, src]
    cpu_cache = kv_cache.cpu()
    cpu_op("copy_blocks", cpu_cache, copies.cpu())
    cuda_op("copy_blocks", kv_cache, copies)
    assert torch.equal(kv_cache, expected), f"seed {seed}"
    assert torch.equal(kv_cache.cpu(), cpu_cache), f"vs CPU op (seed {seed})"


# ---------------------------------------------------------------------------
# paged_attention


class Batch:
    """A mixed batch over a scattered paged cache.

    rows: (q_len, seq_len) per row, decode rows (q_len 1) first. Each row's
    blocks are a random draw from the pool. Every cache slot no row may read
    is NaN and the tables are padded with a NaN block, so a kernel that reads
    past a row's length poisons its output. num_blocks / max_blocks fix the
    pool and table sizes (to refill tensors captured by a CUDA graph).
    """

    def __init__(self, rows, hq, hkv, head_dim, block_size, dtype, num_blocks=None, max_blocks=None):
        self.rows, self.hq, self.hkv, self.head_dim, self.block_size, self.dtype = (
            rows, hq, hkv, head_dim, block_size, dtype)
        self.num_decodes = next((i for i, (q_len, _) in enumerate(rows) if q_len != 1), len(rows))
        assert all(q_len > 1 for q_len, _ in rows[self.num_decodes:]), "decode rows come first"
        blocks_per_row = [math.ceil(seq_len / block_size) for _, seq_len in rows]
        num_blocks = num_blocks or sum(blocks_per_row) + 5
        max_blocks = max_blocks or max(blocks_per_row + [1])
        pad_block = num_blocks - 1  # never handed to a row: all NaN
        perm = torch.randperm(num_blocks - 1)
        tables = torch.full((len(rows), max_blocks), pad_block, dtype=torch.int32)
        readable = torch.zeros(num_blocks, block_size, dtype=torch.bool)
        used = 0
        for s, n in enumerate(blocks_per_row):
            tables[s, :n] = perm[used:used + n].to(torch.int32)
            used += n
            positions = torch.arange(rows[s][1])
            readable[tables[s, positions // block_size].long(), positions % block_size] = True
        hidden = ~readable[:, None, :, None]
        shape = (num_blocks, hkv, block_size, head_dim)
        self.key_cache = torch.randn(shape, dtype=torch.float64).masked_fill_(hidden, float("nan")).to(dtype).cuda()
        self.value_cache = torch.randn(shape, dtype=torch.float64).masked_fill_(hidden, float("nan")).to(dtype).cuda()
        self.block_tables = tables.cuda()
        q_lens = [q for q, _ in rows]
        self.query_start_loc = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32).cuda()
        self.seq_lens = torch.tensor([s for _, s in rows], dtype=torch.int32).cuda()
        self.num_tokens = sum(q_lens)
        self.query = randn((self.num_tokens, hq, head_dim), dtype)
        self.scale = head_dim**-0.5
        self.max_query_len = max(q_lens)
        self.max_seq_len = max(s for _, s in rows)
        self.window, self.softcap = 0, 0.0  # paged_attention's options (cpp/ops/attention_options.h)

    DEVICE_TENSORS = ("key_cache", "value_cache", "block_tables", "query_start_loc", "seq_lens", "query")

    def copy_into(self, other: Batch):
        """Writes this batch into other's tensors (same shapes), keeping other's device pointers."""
        for name in self.DEVICE_TENSORS:
            getattr(other, name).copy_(getattr(self, name))

    def workspace(self, max_seq_len=None, num_seqs=None):
        nbytes = _core.cuda_ops.paged_attention_workspace_bytes(
            self.num_decodes if num_seqs is None else num_seqs, self.hq, self.head_dim,
            self.max_seq_len if max_seq_len is None else max_seq_len)
        return torch.empty(math.ceil(nbytes / 4), dtype=torch.float32, device="cuda")

    def run_cuda(self, out=None, max_seq_len=None, workspace=None, stream=None, query=None, decode_order=None):
        query = self.query if query is None else query
        out = nan_like(query) if out is None else out
        max_seq_len = self.max_seq_len if max_seq_len is None else max_seq_len
        workspace = self.workspace(max_seq_len) if workspace is None else workspace
        cuda_op("paged_attention", out, query, self.key_cache, self.value_cache, self.block_tables,
                self.query_start_loc, self.seq_lens, self.scale, self.max_query_len, max_seq_len,
                self.num_decodes, workspace, self.window, self.softcap, stream=stream, decode_order=decode_order)
        return out

    def run_cpu(self):
        out = torch.full(self.query.shape, float("nan"), dtype=self.dtype)
        cpu_op("paged_attention", out, self.query.cpu(), self.key_cache.cpu(), self.value_cache.cpu(),
               self.block_tables.cpu(), self.query_start_loc.cpu(), self.seq_lens.cpu(), self.scale, 0, 0, 0, None,
               self.window, self.softcap)
        return out

    def reference(self):
        """float64 attention over the gathered (unpaged) keys and values, on the GPU."""
        out = torch.empty(self.query.shape, dtype=torch.float64, device="cuda")
        group = self.hq // self.hkv
        starts = self.query_start_loc.tolist()
        for s, (q_len, seq_len) in enumerate(self.rows):
            positions = torch.arange(seq_len, device="cuda")
            blocks = self.block_tables[s].long()[positions // self.block_size]
            offsets = positions % self.block_size
            # nan_to_num: keys poisoned before a window (hidden below) must not turn 0 * NaN into NaN here.
            k = self.key_cache[blocks, :, offsets].double().nan_to_num().repeat_interleave(group, dim=1)  # [L, Hq, D]
            v = self.value_cache[blocks, :, offsets].double().nan_to_num().repeat_interleave(group, dim=1)
            q = self.query[starts[s]:starts[s + 1]].double()  # [q_len, Hq, D]
            scores = torch.einsum("qhd,khd->hqk", q, k) * self.scale
            if self.softcap > 0:
                scores = self.softcap * torch.tanh(scores / self.softcap)
            query_pos = seq_len - q_len + torch.arange(q_len, device="cuda")
            hidden = positions[None, None, :] > query_pos[None, :, None]
            if self.window > 0:
                hidden |= positions[None, None, :] <= query_pos[None, :, None] - self.window
            scores.masked_fill_(hidden, float("-inf"))
            out[starts[s]:starts[s + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        return out

    def check(self, out, seed, what="", cpu=True):
        assert_close(out, self.reference(), self.dtype, f"{what} vs float64", seed)
        if cpu:
            assert_close(out, self.run_cpu(), self.dtype, f"{what} vs CPU op", seed)


def decode_rows(n, low, high):
    return [(1, random.randint(low, high)) for _ in range(n)]


def prefill_rows(n, max_q, max_prefix):
    rows = []
    for _ in range(n):
        q_len = random.randint(2, max_q)
        rows.append((q_len, q_len + random.randint(0, max_prefix)))
    return rows


BATCH_KINDS = {
    "decode": lambda: decode_rows(5, 1, 700),
    "prefill": lambda: prefill_rows(3, 150, 0) + prefill_rows(2, 90, 100),
    "mixed": lambda: decode_rows(4, 1, 300) + prefill_rows(3, 130, 90),
}


# Mixed batches over every dtype x head dim x block size x GQA group; decode-only
# and prefill-only batches over block 16 and groups 1 / 4.
ATTENTION_CASES = [
    (dtype, head_dim, block_size, group, kind)
    for dtype in DTYPES
    for head_dim in (64, 128)
    for block_size in (16, 32)
    for group in (1, 4, 8)
    for kind in BATCH_KINDS
    if kind == "mixed" or (block_size == 16 and group != 8)
]


@pytest.mark.parametrize("dtype,head_dim,block_size,group,kind", ATTENTION_CASES)
def test_paged_attention(dtype, head_dim, block_size, group, kind):
    seed = fresh_seed()
    seeded(seed)
    hkv = 2
    batch = Batch(BATCH_KINDS[kind](), group * hkv, hkv, head_dim, block_size, dtype)
    batch.check(batch.run_cuda(), seed, f"{kind} rows {batch.rows}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_attention_long_decode_split_k(dtype):
    """Contexts of several 512-token partitions next to single-partition rows (written without the reduction)."""
    seed = fresh_seed()
    seeded(seed)
    rows = [(1, 3000), (1, 1), (1, 513), (1, 512), (1, 1700), (1, 64)]
    batch = Batch(rows, 32, 8, 128, 16, dtype)
    batch.check(batch.run_cuda(), seed, "long decode")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_attention_many_long_decodes_take_one_partition_a_row(dtype):
    """Rows enough to fill the card (40 rows x 8 kv heads >= 2 CTAs an SM up to 160 SMs) read their whole
    context (600-2000 tokens, past the fixed split's 512) in one partition: no partials, no reduce kernel;
    a short row and a prefill beside them."""
    seed = fresh_seed()
    seeded(seed)
    rows = [(1, random.randint(600, 2000)) for _ in range(40)] + [(1, 3), (37, 900)]
    batch = Batch(rows, 16, 8, 128, 16, dtype)
    batch.check(batch.run_cuda(), seed, "one partition a row", cpu=False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_decode_order_changes_no_bit(dtype):
    """Decode rows launched longest context first (the runner's decode_order) give the bits of row order,
    in grids past the card's resident CTAs (two an SM, up to 160 SMs): 41 rows x 8 kv heads in one partition
    a row, and 41 rows x 4 kv heads, too few CTAs alone, in two partitions; a prefill row is not in the
    order."""
    seed = fresh_seed()
    seeded(seed)
    rows = [(1, random.randint(100, 2000)) for _ in range(40)] + [(1, 1), (37, 900)]
    for num_heads, num_kv_heads in ((16, 8), (8, 4)):
        batch = Batch(rows, num_heads, num_kv_heads, 128, 16, dtype)
        longest_first = torch.argsort(batch.seq_lens[:41].cpu(), descending=True, stable=True).int().cuda()
        plain = batch.run_cuda()
        ordered = batch.run_cuda(decode_order=longest_first)
        assert torch.equal(ordered, plain), f"seed {seed}, {num_kv_heads} kv heads"
        batch.check(ordered, seed, f"longest first, {num_kv_heads} kv heads", cpu=False)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_attention_small_partitions_with_large_workspace(dtype):
    """A workspace sized for many rows lets a small batch split its long context into 256-token partitions."""
    seed = fresh_seed()
    seeded(seed)
    batch = Batch([(1, 1000), (1, 77)], 8, 1, 128, 16, dtype)
    out = batch.run_cuda(workspace=batch.workspace(num_seqs=256))
    batch.check(out, seed, "small partitions")


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_grid_sized_for_longer_contexts(dtype):
    """Under CUDA graphs the decode grid comes from the graph's context bound (up to max_model_len), not from
    the step's contexts; extra partitions must exit cleanly."""
    seed = fresh_seed()
    seeded(seed)
    batch = Batch(decode_rows(3, 1, 600) + prefill_rows(1, 40, 30), 16, 4, 64, 16, dtype)
    out = batch.run_cuda(max_seq_len=8192)
    batch.check(out, seed, "max_seq_len 8192")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_attention_large_group_and_long_prefill(dtype):
    """32 query heads on one kv head (two 16-head chunks per CTA grid row) and a 300-token chunk after a prefix."""
    seed = fresh_seed()
    seeded(seed)
    batch = Batch([(1, 900), (1, 5), (300, 700), (65, 65), (64, 64)], 32, 1, 128, 32, dtype)
    batch.check(batch.run_cuda(), seed, "group 32")


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the wgmma prefill kernel is Hopper's (sm_90a)")
def test_prefill_runs_on_wgmma_on_hopper_unless_told_not_to():
    """Head dim 128 prefill rows run the wgmma kernel on an H100 / H200, head dim 64 the mma.sync kernel (bit
    for bit SDPA's there); PAGEDSERVE_WGMMA=0, read once a process, puts head dim 128 back on mma.sync (gpu_check's
    optests stage runs every attention test that way too)."""
    told_not_to = os.environ.get("PAGEDSERVE_WGMMA") == "0"
    assert _core.cuda_ops.prefill_attention_kernel(128) == ("mma.sync" if told_not_to else "wgmma")
    assert _core.cuda_ops.prefill_attention_kernel(64) == "mma.sync"
    code = "from pagedserve import _core; print(_core.cuda_ops.prefill_attention_kernel(128))"
    env = {**os.environ, "PAGEDSERVE_WGMMA": "0"}
    ran = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert ran.stdout.strip() == "mma.sync"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_attention_long_prompts_take_wide_ctas_with_the_same_outputs(dtype):
    """From 2048 query tokens at head dim 128 the mma.sync prefill runs 8-warp CTAs (prefill::WideShape; on
    Hopper every head-dim-128 prefill runs the wgmma kernel): a long chunk after a prefix next to short rows is
    right, and every row comes out bit for bit as with a batch of short rows only (the same batch launched with
    max_query_len raised to 2048, whose extra query tiles exit at once)."""
    seed = fresh_seed()
    seeded(seed)
    long_batch = Batch([(1, 300), (2100, 2150), (70, 100)], 8, 2, 128, 16, dtype)
    long_batch.check(long_batch.run_cuda(), seed, "long prompt", cpu=False)
    batch = Batch([(1, 700), (300, 300), (129, 200), (5, 5)], 8, 2, 128, 16, dtype)
    default_ctas = batch.run_cuda()
    batch.max_query_len = 2048
    wide_ctas = batch.run_cuda()
    assert torch.equal(default_ctas, wide_ctas), f"rows {batch.rows} (seed {seed})"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 32)])
@pytest.mark.parametrize("window,softcap", [(1, 0.0), (37, 0.0), (300, 0.0), (5000, 0.0), (0, 5.0), (129, 30.0)])
def test_paged_attention_window_and_softcap(dtype, head_dim, block_size, window, softcap):
    """Sliding windows (within a block, across split-K partitions, past every context) and soft-capping,
    on decode, chunked prefill after a prefix, and whole prompts, against float64 and the CPU op.
    Keys wholly before every query's window are NaN, so reading one fails the check."""
    seed = fresh_seed()
    seeded(seed)
    rows = [(1, 1), (1, 40), (1, 1500), (1, 700), (90, 600), (200, 200), (7, 1000)]
    batch = Batch(rows, 4 * 2, 2, head_dim, block_size, dtype)
    batch.window, batch.softcap = window, softcap
    if window:
        for s, (q_len, seq_len) in enumerate(rows):  # poison what the op must not read
            before = max(0, seq_len - q_len - window + 1) // block_size
            blocks = batch.block_tables[s, :before].long()
            batch.key_cache[blocks] = float("nan")
            batch.value_cache[blocks] = float("nan")
    if softcap:
        batch.query *= 4  # so that the cap bends the scores
    batch.check(batch.run_cuda(), seed, f"window {window} softcap {softcap}")


def sdpa_rows(batch: Batch) -> torch.Tensor:
    """torch's scaled_dot_product_attention, one row per call as transformers calls it without a mask
    (kv heads as they are, enable_gqa, torch's choice of backend); rows are whole prompts
    (q_len == seq_len) or decodes."""
    out = torch.empty_like(batch.query)
    starts = batch.query_start_loc.tolist()
    for s, (q_len, seq_len) in enumerate(batch.rows):
        assert q_len in (1, seq_len)
        positions = torch.arange(seq_len, device="cuda")
        blocks = batch.block_tables[s].long()[positions // batch.block_size]
        offsets = positions % batch.block_size
        k = batch.key_cache[blocks, :, offsets].transpose(0, 1)[None]  # [1, Hkv, L, D]
        v = batch.value_cache[blocks, :, offsets].transpose(0, 1)[None]
        q = batch.query[starts[s]:starts[s + 1]].transpose(0, 1)[None]  # [1, Hq, q_len, D]
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=q_len > 1, enable_gqa=True)
        out[starts[s]:starts[s + 1]] = o[0].transpose(0, 1)
    return out


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the arithmetic reproduced is that of torch's SDPA on Hopper (sm_90)")
@pytest.mark.parametrize("hq,hkv", [(9, 3), (8, 1), (4, 4)])
def test_paged_attention_is_bit_identical_to_torch_sdpa_on_hopper(hq, hkv):
    """bf16, head dim 64 (SmolLM2's 9 / 3 heads among others): prompts up to 256 tokens and decodes over
    up to 256 tokens come out exactly as torch's SDPA computes them for transformers on Hopper: the same
    key tiles (128 tokens for prompts, 64 for decodes), exponent, summation order and final reciprocal
    (bench/numerics/softmax_numerics.py). The workspace is the engine's size, so a small batch could split its
    decodes, and must not below 256 tokens."""
    seed = fresh_seed()
    seeded(seed)
    decodes = [(1, n) for n in (1, 20, 64, 65, 100, 130, 200, 256)]
    prompts = [(n, n) for n in (9, 14, 33, 64, 100, 128, 129, 200, 256)]
    batch = Batch(decodes + prompts, hq, hkv, 64, 16, torch.bfloat16)
    batch.query *= 2  # peakier softmax rows, like a trained model's (exact in bf16)
    batch.key_cache *= 2
    expected = sdpa_rows(batch)
    out = batch.run_cuda(workspace=batch.workspace(max_seq_len=8192, num_seqs=256))
    starts = batch.query_start_loc.tolist()
    differing = {f"{q_len}/{seq_len}": int((out[starts[s]:starts[s + 1]] != expected[starts[s]:starts[s + 1]]).sum())
                 for s, (q_len, seq_len) in enumerate(batch.rows)}
    assert not any(differing.values()), f"elements differing from SDPA per row q_len/seq_len: {differing} (seed {seed})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_leaves_padding_tokens_alone(dtype):
    """Tokens past query_start_loc[S] (CUDA-graph padding) are not written."""
    seed = fresh_seed()
    seeded(seed)
    batch = Batch([(1, 40), (5, 20)], 8, 2, 128, 16, dtype)
    padded_query = torch.cat([batch.query, randn((3, 8, 128), dtype)])
    out = nan_like(padded_query)
    workspace = batch.workspace()
    cuda_op("paged_attention", out, padded_query, batch.key_cache, batch.value_cache, batch.block_tables,
            batch.query_start_loc, batch.seq_lens, batch.scale, batch.max_query_len, batch.max_seq_len,
            batch.num_decodes, workspace, 0, 0.0)
    batch.check(out[: batch.num_tokens], seed, "padded", cpu=False)
    assert torch.isnan(out[batch.num_tokens:]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_on_side_stream(dtype):
    seed = fresh_seed()
    seeded(seed)
    batch = Batch(decode_rows(3, 1, 900) + prefill_rows(2, 70, 40), 8, 2, 128, 16, dtype)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = nan_like(batch.query)
        workspace = batch.workspace()
        batch.run_cuda(out=out, workspace=workspace, stream=side)
    torch.cuda.current_stream().wait_stream(side)
    batch.check(out, seed, "side stream")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_cuda_graph_replay(dtype):
    """Capture decode attention with a grid sized for max_seq_len 2048, then change lengths, tables and cache."""
    seed = fresh_seed()
    seeded(seed)
    max_seq_len, block_size, rows = 2048, 16, 4
    sizes = {"num_blocks": rows * max_seq_len // block_size + 1, "max_blocks": max_seq_len // block_size}
    captured = Batch(decode_rows(rows, 1, 400), 8, 2, 128, block_size, dtype, **sizes)
    workspace = captured.workspace(max_seq_len)
    out = nan_like(captured.query)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture
        captured.run_cuda(out=out, max_seq_len=max_seq_len, workspace=workspace)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured.run_cuda(out=out, max_seq_len=max_seq_len, workspace=workspace)

    out.fill_(float("nan"))
    graph.replay()
    captured.check(out, seed, "graph replay, short rows", cpu=False)

    longer = Batch(decode_rows(rows, 500, max_seq_len), 8, 2, 128, block_size, dtype, **sizes)
    longer.copy_into(captured)
    out.fill_(float("nan"))
    graph.replay()
    longer.check(out, seed, "graph replay, long rows", cpu=False)


def test_paged_attention_workspace_bytes():
    nbytes = _core.cuda_ops.paged_attention_workspace_bytes
    assert nbytes(8, 32, 128, 0) == 0
    assert nbytes(8, 32, 128, 512) == 8 * 32 * 1 * (128 + 2) * 4
    assert nbytes(8, 32, 128, 513) == 8 * 32 * 2 * (128 + 2) * 4
    assert nbytes(16, 32, 128, 4096) == 2 * nbytes(8, 32, 128, 4096)


def test_paged_attention_rejects_bad_arguments():
    seed = fresh_seed()
    seeded(seed)
    tiny_workspace = torch.empty(1, dtype=torch.float32, device="cuda")
    batch = Batch([(1, 700), (3, 10)], 8, 2, 128, 16, torch.bfloat16)
    # A workspace too small to split a context leaves it in one partition (slower, the same attention) ...
    batch.check(batch.run_cuda(workspace=tiny_workspace), seed, "unsplit", cpu=False)
    # ... up to the longest partition, 16384 tokens: a longer context needs the workspace.
    long_row = Batch([(1, 20000)], 8, 2, 128, 16, torch.bfloat16)
    with pytest.raises(ValueError, match="workspace"):
        long_row.run_cuda(workspace=tiny_workspace)
    two_decodes = Batch([(1, 700), (1, 10)], 8, 2, 128, 16, torch.bfloat16)
    with pytest.raises(ValueError, match="decode_order holds 1 rows but num_decodes is 2"):
        two_decodes.run_cuda(decode_order=torch.zeros(1, dtype=torch.int32, device="cuda"))
    with pytest.raises(ValueError, match="decode_order"):
        two_decodes.run_cuda(decode_order=torch.zeros(2, dtype=torch.int64, device="cuda"))
    with pytest.raises(ValueError, match="head_dim"):
        odd = Batch([(1, 5)], 2, 1, 96, 16, torch.bfloat16)
        odd.run_cuda()
    with pytest.raises(ValueError, match="key_cache"):
        batch.key_cache = batch.key_cache.float()
        batch.run_cuda()
    with pytest.raises(ValueError, match="cuda"):
        cuda_op("rms_norm", torch.zeros(2, 8), torch.zeros(2, 8), torch.ones(8), 1e-6)


# ---------------------------------------------------------------------------
# A few small cases for compute-sanitizer (-k sanitizer_subset).


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sanitizer_subset_attention(dtype):
    seed = fresh_seed()
    seeded(seed)
    batch = Batch([(1, 600), (1, 17), (70, 90), (5, 5)], 8, 2, 128, 16, dtype)
    batch.check(batch.run_cuda(), seed, "sanitizer subset", cpu=False)
    small = Batch([(1, 1000)], 4, 1, 64, 32, dtype)
    small.check(small.run_cuda(workspace=small.workspace(num_seqs=64)), seed, "sanitizer small partitions", cpu=False)
    if dtype != torch.float32:  # the 8-warp prefill CTAs (max_query_len >= prefill::kWideQueryLen)
        batch.max_query_len = 2048
        batch.check(batch.run_cuda(), seed, "sanitizer wide prefill", cpu=False)


def test_sanitizer_subset_elementwise():
    seed = fresh_seed()
    seeded(seed)
    dtype = torch.bfloat16
    x = randn((3, 1001), dtype)
    weight = randn((1001,), dtype)
    out = nan_like(x)
    cuda_op("rms_norm", out, x, weight, 1e-6)
    assert_close(out, rms_norm_ref(x, weight, 1e-6), dtype, "rms_norm", seed)
    residual = randn((3, 1001), dtype)
    expected_x, _ = fused_add_rms_norm_ref(x, residual, weight, 1e-6)
    cuda_op("fused_add_rms_norm", x, residual, weight, 1e-6)
    assert_close(x, expected_x, dtype, "fused_add_rms_norm", seed)
    gate_up = randn((4, 2 * 72), dtype)
    act = torch.full((4, 72), float("nan"), dtype=dtype, device="cuda")
    cuda_op("silu_and_mul", act, gate_up)
    assert_close(act, silu_and_mul_ref(gate_up), dtype, "silu_and_mul", seed)
    cos_sin = cos_sin_table(32, 64)
    positions = torch.randint(0, 32, (5,), dtype=torch.int32).cuda()
    query, key = randn((5, 4, 64), dtype), randn((5, 2, 64), dtype)
    expected_q = rotary_ref(positions, query, cos_sin)
    cuda_op("rotary_embedding", positions, query, key, cos_sin)
    assert_close(query, expected_q, dtype, "rotary", seed)
    key_cache = randn((6, 2, 16, 64), dtype)
    value_cache = randn((6, 2, 16, 64), dtype)
    slots = torch.tensor([3, PAD_SLOT, 95, 40, 0], dtype=torch.int32).cuda()
    cuda_op("reshape_and_cache", key, key.clone(), key_cache, value_cache, slots)
    assert torch.equal(key_cache[95 // 16, :, 95 % 16], key[2])
    kv_cache = randn((2, 2, 6, 2, 16, 64), dtype)
    expected = kv_cache.clone()
    expected[:, :, 4] = kv_cache[:, :, 1]
    cuda_op("copy_blocks", kv_cache, torch.tensor([[1, 4]], dtype=torch.int32).cuda())
    assert torch.equal(kv_cache, expected)
