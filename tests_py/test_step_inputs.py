"""StepInputs: the scheduler's arrays at fixed offsets, padded decode batches for CUDA graphs."""

import numpy as np
import pytest
import torch

from pagedserve import _core
from pagedserve.worker.step_inputs import PAD_SLOT, StepInputs


def decode_step(num_seqs: int):
    s = _core.Scheduler(_core.SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=8,
                                              max_num_batched_tokens=64, watermark=0.0))
    for i in range(num_seqs):
        s.add_sequence([10 + i, 11, 12, 13, 14], max_tokens=8)
    s.update(np.full(s.schedule().total_samples, 7, dtype=np.int32))
    return s.schedule()


def test_decode_rows_launch_longest_context_first_padding_last():
    """The attention kernel's launch order (cuda/cuda_ops.h decode_order): the decode rows by falling context,
    ties in row order, the padding rows of a graph's batch last; a prefill row is not in it."""
    s = _core.Scheduler(_core.SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=8,
                                              max_num_batched_tokens=64, watermark=0.0))
    for prompt_len in (3, 9, 5, 9):
        s.add_sequence(list(range(1, prompt_len + 1)), max_tokens=8)
    s.update(np.full(s.schedule().total_samples, 7, dtype=np.int32))
    s.add_sequence([1, 2, 3, 4, 5, 6], max_tokens=8)  # a prefill row after the four decodes
    step = s.schedule()
    assert step.num_decodes == 4 and step.num_seqs == 5 and step.seq_lens.tolist() == [4, 10, 6, 10, 6]
    inputs = StepInputs(max_num_tokens=64, max_num_seqs=8, max_blocks_per_seq=4, device=torch.device("cpu"))
    attn = inputs.prepare(step)[2]
    assert attn.decode_order.tolist() == [1, 3, 2, 0]
    s.update(np.full(step.total_samples, 7, dtype=np.int32))
    step = s.schedule()  # five decodes, replayed in a graph of 8 rows
    inputs.prepare_replay(step, 8)
    assert inputs.decode_views(8, max_seq_len=16)[2].decode_order.tolist() == [1, 3, 2, 4, 0, 5, 6, 7]


def test_padded_decode_rows_write_nothing_and_attend_to_nothing():
    step = decode_step(3)
    assert step.num_decodes == 3
    inputs = StepInputs(max_num_tokens=64, max_num_seqs=8, max_blocks_per_seq=4, device=torch.device("cpu"))
    ids, pos, attn = inputs.decode_views(8, max_seq_len=16)  # what the graph of 8 rows captured
    logits = inputs.prepare_replay(step, 8)
    assert ids.shape == (8,) and attn.block_tables.shape == (8, 4) and attn.num_decodes == 8
    assert ids[:3].tolist() == [7, 7, 7] and pos[:3].tolist() == [5, 5, 5]
    assert attn.slot_mapping[:3].tolist() == step.slot_mapping.tolist()
    assert attn.slot_mapping[3:].tolist() == [PAD_SLOT] * 5
    assert attn.seq_lens.tolist() == [6, 6, 6, 0, 0, 0, 0, 0]
    assert attn.query_start_loc.tolist() == list(range(9))
    assert logits.tolist() == [0, 1, 2]


def test_capture_views_alias_what_prepare_fills():
    inputs = StepInputs(max_num_tokens=64, max_num_seqs=8, max_blocks_per_seq=4, device=torch.device("cpu"))
    inputs.fill_capture_batch(8)
    ids, pos, attn = inputs.decode_views(8, max_seq_len=16)
    assert attn.slot_mapping.tolist() == [PAD_SLOT] * 8 and attn.seq_lens.tolist() == [1] * 8
    assert attn.query_start_loc.tolist() == list(range(9)) and attn.max_query_len == 1 and attn.max_seq_len == 16
    inputs.prepare_replay(decode_step(2), 8)  # a graph replay reads the new values in place
    assert ids[:2].tolist() == [7, 7] and attn.seq_lens[:3].tolist() == [6, 6, 0]


def test_an_eager_step_gets_views_of_its_own_size():
    step = decode_step(3)
    inputs = StepInputs(max_num_tokens=64, max_num_seqs=8, max_blocks_per_seq=4, device=torch.device("cpu"))
    inputs.prepare_replay(decode_step(5), 8)  # a padded replay before leaves nothing behind in the views
    ids, pos, attn, logits = inputs.prepare(step)
    assert ids.tolist() == [7, 7, 7] and pos.tolist() == [5, 5, 5] and attn.num_decodes == 3
    assert attn.block_tables.shape == (3, 4) and attn.seq_lens.tolist() == [6, 6, 6]
    assert attn.query_start_loc.tolist() == [0, 1, 2, 3] and logits.tolist() == [0, 1, 2]
    assert inputs.logits_indices(3) is logits  # one view per count, made once


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_step_filled_while_the_last_copy_waits_does_not_overwrite_it():
    """A step's arrays reach the device as they were when it was filled, even when the next step is filled
    before the device has run the first one's copy (a step that samples nothing returns at once)."""
    inputs = StepInputs(max_num_tokens=64, max_num_seqs=8, max_blocks_per_seq=4, device=torch.device("cuda"))
    first, second = decode_step(3), decode_step(5)
    torch.cuda._sleep(200_000_000)  # ~0.1 s of device time ahead of the first copy
    inputs.prepare_replay(first, 8)
    seen = inputs.decode_views(8, max_seq_len=16)[2].seq_lens.clone()  # what the first step's kernels read
    inputs.prepare_replay(second, 8)
    torch.cuda.synchronize()
    assert seen.tolist() == [6, 6, 6, 0, 0, 0, 0, 0]
