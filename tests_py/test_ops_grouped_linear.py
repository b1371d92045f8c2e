"""pagedserve.ops.grouped_linear (mixture-of-experts products, cpp/ops/grouped_linear.h) against a
naive torch loop over the experts, on the CPU and, where present, a GPU."""

from __future__ import annotations

import pytest
import torch
from ops_testing import DEVICES, DTYPES, TOL, cpu_isa, gen, randn, torch_single_thread  # noqa: F401  (fixtures)

from pagedserve import ops


def naive_grouped_linear(x, weight, offsets):
    out = torch.full((x.shape[0], weight.shape[1]), float("nan"), dtype=torch.float64)
    bounds = offsets.tolist()
    for e in range(weight.shape[0]):
        rows = slice(bounds[e], bounds[e + 1])
        out[rows] = x[rows].double() @ weight[e].double().T
    return out


def make_problem(counts, k, n, dtype, gen, lead=0, tail=0):
    offsets = torch.tensor([lead] + counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    rows = int(offsets[-1]) + tail
    x = randn(rows, k, gen=gen, dtype=dtype)
    weight = randn(len(counts), n, k, gen=gen, dtype=dtype, scale=k ** -0.5)
    return x, weight, offsets


def run(x, weight, offsets, device):
    x, weight, offsets = x.to(device), weight.to(device), offsets.to(device)
    out = torch.full((x.shape[0], weight.shape[1]), float("nan"), dtype=x.dtype, device=device)
    ops.grouped_linear(out, x, weight, offsets)
    return out.cpu()


CASES = [
    ([5, 0, 17, 1], 64, 48),           # an empty expert, single rows
    ([70, 3, 130], 128, 96),            # row tiles past 64, N not a multiple of 16 / 64
    ([0, 0, 9], 40, 130),               # leading empty experts, K not a multiple of 64
    ([1] * 8, 256, 16),                 # decode-like: one row per expert
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("counts,k,n", CASES)
def test_grouped_linear_matches_naive_loop(device, dtype, counts, k, n, gen):
    x, weight, offsets = make_problem(counts, k, n, dtype, gen)
    out = run(x, weight, offsets, device)
    torch.testing.assert_close(out.double(), naive_grouped_linear(x, weight, offsets), **TOL[dtype],
                               check_dtype=False)


@pytest.mark.parametrize("device", DEVICES)
def test_rows_outside_the_offsets_are_not_written(device, gen):
    x, weight, offsets = make_problem([4, 6], 64, 32, torch.float32, gen, lead=3, tail=2)
    out = run(x, weight, offsets, device)
    assert out[:3].isnan().all() and out[-2:].isnan().all()
    torch.testing.assert_close(out[3:-2].double(), naive_grouped_linear(x, weight, offsets)[3:-2], **TOL[torch.float32])


def test_every_cpu_isa(gen, cpu_isa):
    x, weight, offsets = make_problem([30, 0, 90], 96, 40, torch.float32, gen)
    torch.testing.assert_close(run(x, weight, offsets, "cpu").double(), naive_grouped_linear(x, weight, offsets),
                               **TOL[torch.float32])


def test_large_problem_runs_on_the_thread_pool(gen):
    x, weight, offsets = make_problem([300, 200, 10, 500], 256, 192, torch.bfloat16, gen)
    torch.testing.assert_close(run(x, weight, offsets, "cpu").double(), naive_grouped_linear(x, weight, offsets),
                               **TOL[torch.bfloat16])


def test_rejects_bad_arguments(gen):
    x, weight, offsets = make_problem([4, 6], 64, 32, torch.float32, gen)
    out = torch.empty(10, 32)
    with pytest.raises(ValueError, match="expert_offsets must be non-decreasing"):
        ops.grouped_linear(out, x, weight, torch.tensor([0, 7, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="expert_offsets must be non-decreasing"):
        ops.grouped_linear(out, x, weight, torch.tensor([0, 4, 11], dtype=torch.int32))
    with pytest.raises(ValueError, match="expert_offsets"):
        ops.grouped_linear(out, x, weight, torch.tensor([0, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="weight"):
        ops.grouped_linear(out, x, weight[:, :, :32].contiguous(), offsets)
    with pytest.raises(ValueError, match="out"):
        ops.grouped_linear(torch.empty(10, 33), x, weight, offsets)


@pytest.mark.parametrize("counts,k,n", CASES)
def test_packed_grouped_linear_matches_naive_loop_on_bf16_weights(counts, k, n, gen, cpu_isa):
    x, weight, offsets = make_problem(counts, k, n, torch.float32, gen, lead=1, tail=2)
    packed = ops.pack_grouped_weight(weight)
    out = torch.full((x.shape[0], n), float("nan"))
    ops.packed_grouped_linear(out, x, packed, offsets)
    expected = naive_grouped_linear(x, weight.to(torch.bfloat16).float(), offsets)
    assert out[:1].isnan().all() and out[-2:].isnan().all()
    torch.testing.assert_close(out[1:-2].double(), expected[1:-2], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="expert_offsets must be non-decreasing"):
        ops.packed_grouped_linear(out, x, packed, offsets.flip(0).contiguous())
