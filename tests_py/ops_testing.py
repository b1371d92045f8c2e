"""Shared helpers for the pagedserve.ops tests."""

from __future__ import annotations

import pytest
import torch

from pagedserve import _core

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Oracles compute in float32 on the same (rounded) inputs, so the tolerance is
# about one rounding of the output to the dtype, plus float32 noise.
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
}


# The devices a sampler or op test runs on: the CPU always, CUDA where a GPU is present.
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU")]),
]


@pytest.fixture(scope="module", autouse=True)
def torch_single_thread():
    """Runs the torch oracles single-threaded. torch's intra-op threads spin after every op, and
    on a loaded 2-core box that makes these many small reference ops a hundred times slower; the
    ops under test keep their own thread pool."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


@pytest.fixture(params=_core.ops.supported_cpu_isas())
def cpu_isa(request):
    """Runs a test once per instruction set the CPU supports (baseline SSE2, AVX2, AVX-512)."""
    before = _core.ops.cpu_isa()
    _core.ops.set_cpu_isa(request.param)
    yield request.param
    _core.ops.set_cpu_isa(before)


def randn(*shape, gen, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)
