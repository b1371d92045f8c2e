"""The grammar thread's C++ worker (cpp/grammar/grammar_worker.h) against one matcher at a time: queued jobs
consume the drawn id of their rows and fill the same masks, in order, each raising the flag to its number;
a failed job raises the flag too and reports its error without stopping the jobs after it; misuse raises.
The CUDA path (a job waiting on its draw's event) runs in test_grammar_thread.py's CUDA engines."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("llguidance")

from pagedserve import _core  # noqa: E402
from pagedserve._core import grammar as core  # noqa: E402
from test_llguidance_matcher import (c_tokenizer, eos_ids, hf_tokenizer, mask_bits, mask_bits_of,  # noqa: E402,F401
                                     outcome, vocab, walk_matchers)


def draw(ids_by_row: dict[int, int], num_ids: int) -> torch.Tensor:
    """A draw's ids on the host: row r's id at index r, other rows' ids junk."""
    ids = torch.full((num_ids,), 7, dtype=torch.int32)
    for row, token in ids_by_row.items():
        ids[row] = token
    return ids


def submit(worker, number, pairs, ids, bitmask, flag):
    worker.submit(number, pairs, ids.data_ptr(), ids.numel(), 0, 0, bitmask.data_ptr(), bitmask.shape[0],
                  bitmask.shape[1], flag.data_ptr())


def test_queued_jobs_equal_one_matcher_at_a_time(c_tokenizer, vocab):  # noqa: F811
    rows, words, width = 12, (vocab + 31) // 32, 20
    queued, plans = walk_matchers(c_tokenizer, vocab, rows, seed=11)
    alone = [m.clone() for m in queued]
    out_rows = [(7 * i + 2) % width for i in range(rows)]  # scattered: the draw's rows and the bitmask's
    pairs = core.MatcherRows(queued, out_rows)
    worker = core.GrammarWorker(core.GrammarPool(2))
    flag = torch.zeros(2, dtype=torch.int64)
    steps = 6
    # Every job queued before the first is waited for: each reads its own draw and fills its own bitmask.
    draws, bitmasks = [], []
    for step in range(steps):
        tokens = {out_rows[i]: plan[step] if step < len(plan) else 0 for i, plan in enumerate(plans)}
        draws.append(draw(tokens, width + 3))
        bitmasks.append(torch.full((width, words), -1, dtype=torch.int32))
        submit(worker, step + 1, pairs, draws[-1], bitmasks[-1], flag)
    for step in range(steps):
        outcomes, seconds = worker.wait(step + 1)
        assert flag[0] >= step + 1 and seconds > 0
        for i, m in enumerate(alone):
            took = m.consume(int(draws[step][out_rows[i]]))
            assert outcomes[i] == outcome(took, m), f"row {i}, step {step}"
            assert mask_bits(bitmasks[step][out_rows[i]], vocab) == mask_bits_of(m, vocab), f"row {i}, step {step}"
        untouched = sorted(set(range(width)) - set(out_rows))
        assert (bitmasks[step][untouched] == -1).all()
    assert flag[0] == steps
    worker.close()


def test_a_failed_job_raises_its_flag_and_the_next_runs(c_tokenizer, vocab):  # noqa: F811
    words = (vocab + 31) // 32
    matchers, plans = walk_matchers(c_tokenizer, vocab, 2, seed=5)
    worker = core.GrammarWorker(core.GrammarPool(1))
    flag = torch.zeros(2, dtype=torch.int64)
    bitmask = torch.zeros((4, words), dtype=torch.int32)
    short = draw({0: plans[0][0]}, 2)  # row 3 has no id in a draw of two
    submit(worker, 1, core.MatcherRows(matchers, [0, 3]), short, bitmask, flag)
    with pytest.raises(RuntimeError, match="row 3 of a draw of 2 ids"):
        worker.wait(1)
    assert flag[0] == 1  # a device waiting for the job is let go; the engine reports the error
    good = draw({0: plans[0][0], 1: plans[1][0]}, 2)
    submit(worker, 2, core.MatcherRows(matchers, [0, 1]), good, bitmask, flag)
    outcomes, _ = worker.wait(2)
    assert list(outcomes) == [core.GrammarPool.LIVE] * 2 and flag[0] == 2
    worker.close()


def test_misuse_raises(c_tokenizer, vocab):  # noqa: F811
    words = (vocab + 31) // 32
    matchers, plans = walk_matchers(c_tokenizer, vocab, 1, seed=3)
    pairs = core.MatcherRows(matchers, [0])
    with pytest.raises(ValueError, match="one row a matcher"):
        core.MatcherRows(matchers, [0, 1])
    worker = core.GrammarWorker(core.GrammarPool(1))
    flag = torch.zeros(2, dtype=torch.int64)
    bitmask = torch.zeros((1, words), dtype=torch.int32)
    ids = draw({0: plans[0][0]}, 1)
    with pytest.raises(ValueError, match="job 2 after job 0"):
        submit(worker, 2, pairs, ids, bitmask, flag)
    with pytest.raises(ValueError, match="was not submitted"):
        worker.wait(1)
    submit(worker, 1, pairs, ids, bitmask, flag)
    worker.wait(1)
    with pytest.raises(ValueError, match="waited for already"):
        worker.wait(1)
    if not _core.has_cuda:  # an event to wait for: the job fails, its flag raised
        worker.submit(2, pairs, ids.data_ptr(), 1, 12345, 0, bitmask.data_ptr(), 1, words, flag.data_ptr())
        with pytest.raises(RuntimeError, match="build without CUDA"):
            worker.wait(2)
        assert flag[0] == 2
    worker.close()
    with pytest.raises(ValueError, match="closed"):
        submit(worker, 3, pairs, ids, bitmask, flag)
