"""The ladders CUDA graphs are captured on (worker/cuda_graphs.py): plain functions, checked on any machine
(the graphs themselves: tests_py/test_gpu_engine.py)."""

import pytest

from pagedserve.worker.cuda_graphs import batch_size_ladder, context_bound_ladder


@pytest.mark.parametrize("max_seq_len, want", [
    (1, [1]),
    (256, [256]),
    (257, [256, 257]),
    (2048, [256, 1024, 2048]),
    (8192, [256, 1024, 4096, 8192]),
    (40960, [256, 1024, 4096, 16384, 40960]),
])
def test_context_bounds_grow_4x_from_one_partition_to_max_seq_len(max_seq_len, want):
    assert context_bound_ladder(max_seq_len) == want


@pytest.mark.parametrize("max_num_seqs, want", [
    (1, [1]),
    (4, [1, 2, 4]),
    (40, [1, 2, 4, 8, 16, 32, 40]),
    (64, [1, 2, 4, 8, 16, 32, 48, 64]),
])
def test_batch_sizes_double_to_8_then_step_by_16(max_num_seqs, want):
    assert batch_size_ladder(max_num_seqs) == want
