"""Data parallelism: N engine replicas in processes of their own behind one server.

build_engine(config) is the engine the server runs: LLMEngine in this process when
data_parallel_size is 1 (no extra process, no cost), else a DataParallelEngine over that many
replicas (client.py), each an LLMEngine with the same config, tensor parallelism included.
"""

from __future__ import annotations

from pagedserve.engine_config import EngineConfig


def build_engine(config: EngineConfig):
    """The server's engine for `config` (an EngineClient)."""
    if config.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be at least 1, got {config.data_parallel_size}")
    if config.data_parallel_size == 1:
        from pagedserve.engine.engine import LLMEngine
        return LLMEngine(config)
    from pagedserve.engine.data_parallel.client import DataParallelEngine
    return DataParallelEngine(config)
