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
