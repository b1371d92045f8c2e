"""The CUDA sample_tokens kernel against the CPU op (same hashed noise, so the
same draws) and against the softmax distribution. Skipped without a GPU."""

import pytest
import torch

from pagedserve import _core, ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and _core.has_cuda), reason="needs a CUDA GPU and USE_CUDA=ON"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_draws_what_the_cpu_op_draws(dtype):
    rows, vocab = 300, 50_000
    seed = int(torch.randint(0, 2**62, (1,)))
    logits = (torch.randn(rows, vocab) * 3).to(dtype)
    inv_t = torch.where(torch.arange(rows) % 4 == 0, 0.0, 1.0 / (0.3 + torch.rand(rows))).float()
    cpu = torch.full((rows,), -1, dtype=torch.int32)
    ops.sample_tokens(cpu, logits, inv_t, seed)
    gpu = torch.full((rows,), -1, dtype=torch.int32, device="cuda")
    ops.sample_tokens(gpu, logits.cuda(), inv_t.cuda(), seed)
    gpu = gpu.cpu()
    greedy = inv_t == 0
    assert torch.equal(gpu[greedy], logits.float()[greedy].argmax(-1).int())
    # logf may differ by an ulp between the CPU and the GPU: a near-tie can flip, rarely.
    agree = (gpu == cpu).float().mean().item()
    assert agree >= 0.99, f"seed {seed}: only {agree:.3f} of rows agree with the CPU op"


def test_cuda_draws_follow_the_softmax():
    rows = 200_000
    row = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5])
    logits = row.repeat(rows, 1).cuda()
    inv_t = torch.full((rows,), 1 / 0.7, device="cuda")
    out = torch.empty(rows, dtype=torch.int32, device="cuda")
    ops.sample_tokens(out, logits, inv_t, 12345)
    counts = torch.bincount(out.long().cpu(), minlength=5).double()
    p = torch.softmax(row.double() / 0.7, -1)
    sigma = (rows * p * (1 - p)).sqrt()
    assert ((counts - rows * p).abs() < 5 * sigma).all(), (counts, rows * p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_masked_draws_are_the_cpu_op_masked_draws(dtype):
    """A grammar's bitmask read in the sampling pass: only allowed tokens come out, greedy rows are the
    masked argmax, a row with nothing allowed gives 0, and the draws are the CPU op's."""
    rows, vocab = 128, 49_155  # the last mask word partly used
    seed = int(torch.randint(0, 2**62, (1,)))
    logits = (torch.randn(rows, vocab) * 3).to(dtype)
    allowed = torch.randint(-2**31, 2**31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32)
    allowed[::7] &= 0x01010101  # sparse masks on some rows
    allowed[3] = 0
    inv_t = torch.where(torch.arange(rows) % 4 == 0, 0.0, 1.0 / (0.3 + torch.rand(rows))).float()
    cpu = torch.full((rows,), -1, dtype=torch.int32)
    ops.sample_tokens(cpu, logits, inv_t, seed, allowed)
    gpu = torch.full((rows,), -1, dtype=torch.int32, device="cuda")
    ops.sample_tokens(gpu, logits.cuda(), inv_t.cuda(), seed, allowed.cuda())
    gpu = gpu.cpu()
    bits = ((allowed.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).reshape(rows, -1)[:, :vocab].bool()
    drawn = bits[torch.arange(rows), gpu.long()]
    assert drawn[torch.arange(rows) != 3].all() and gpu[3] == 0
    greedy = inv_t == 0
    masked = logits.float().masked_fill(~bits, float("-inf"))
    assert torch.equal(gpu[greedy], masked[greedy].argmax(-1).int())
    agree = (gpu == cpu).float().mean().item()
    assert agree >= 0.99, f"seed {seed}: only {agree:.3f} of rows agree with the CPU op"
