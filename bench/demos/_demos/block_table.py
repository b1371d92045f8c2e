"""block-table: where a sequence's KV lives, from the real scheduler and block pool.

Part 1 follows one sequence (A, a 40-token prompt and 60 output tokens) next to
a neighbour (B) through chunked prefill (16 tokens a step) and decode, and
prints A's block table each time it crosses a block boundary: logical block i
of A lives in physical block table[i], and token position p is written to slot
table[p // 16] * 16 + p % 16. Part 2 runs a batch of sequences that grow side
by side, finish, and make room for newcomers, and draws the pool: each
character is one physical block, labelled with the sequence that holds it.
No model runs: the scheduler is driven with made-up sampled tokens, so every
figure is exact and reproducible.
"""

from __future__ import annotations

import string

import numpy as np
from common.report import markdown_table

BLOCK = 16


def add_arguments(ap) -> None:
    pass  # no model, no options: the demo is fixed and takes well under a second


def make_scheduler(num_blocks: int, max_num_batched_tokens: int):
    from pagedserve import _core
    # Prefix caching off: freed blocks go straight back to the free list, which keeps the picture plain.
    return _core.Scheduler(_core.SchedulerConfig(num_blocks=num_blocks, block_size=BLOCK, max_num_seqs=8,
                                                 max_num_batched_tokens=max_num_batched_tokens,
                                                 max_model_len=1024, enable_prefix_caching=False))


def advance(scheduler, rng):
    step = scheduler.schedule()
    finished = scheduler.update(rng.integers(0, 30000, size=step.total_samples, dtype=np.int32)).finished
    return step, [f.seq_id for f in finished]


def follow_one_sequence() -> tuple[list[dict], str]:
    rng = np.random.default_rng(0)
    s = make_scheduler(num_blocks=32, max_num_batched_tokens=16)
    s.add_sequence(rng.integers(0, 30000, size=20, dtype=np.int32), max_tokens=90, ignore_eos=True)  # B
    a = s.add_sequence(rng.integers(0, 30000, size=40, dtype=np.int32), max_tokens=60, ignore_eos=True)
    rows, known_blocks, step_no = [], 0, 0
    while True:
        step_no += 1
        step = s.schedule()
        ids = step.seq_ids.tolist()
        if a in ids:
            r = ids.index(a)
            begin, end = int(step.query_start_loc[r]), int(step.query_start_loc[r + 1])
            cached, slot = int(step.seq_lens[r]), int(step.slot_mapping[end - 1])
            table = s.sequence(a)["block_ids"]
            new_block = len(table) > known_blocks
            last = cached == 40 + 60 - 1
            if new_block or last:
                phase = f"prefill {cached - (end - begin)}..{cached - 1}" if end - begin > 1 or cached <= 40 \
                    else f"decode {cached - 1}"
                rows.append({"step": step_no, "phase": phase, "tokens_cached": cached,
                             "block_table": str(table), "last_token_slot": f"{slot} = {slot // BLOCK}*{BLOCK}+"
                             f"{slot % BLOCK}", "new_block": table[-1] if new_block else "-"})
                known_blocks = len(table)
        s.update(rng.integers(0, 30000, size=step.total_samples, dtype=np.int32))
        if s.sequence(a) is None:
            break
    return rows, markdown_table(rows, list(rows[0]))


def pool_map(scheduler, names: dict[int, str]) -> str:
    owner = ["."] * scheduler.pool.num_blocks
    for seq_id in scheduler.running_ids:
        for block in scheduler.sequence(seq_id)["block_ids"]:
            owner[block] = names[seq_id]
    return "".join(owner)


def scattered_batch() -> tuple[list[dict], dict[str, list[int]], str]:
    rng = np.random.default_rng(1)
    s = make_scheduler(num_blocks=48, max_num_batched_tokens=512)
    names: dict[int, str] = {}
    first = [(20, 40), (50, 8), (33, 80), (70, 16), (12, 60), (45, 30)]  # (prompt, output) of A..F
    later = [(40, 40), (50, 40)]                                         # G, H join at step 25
    letters = iter(string.ascii_uppercase)

    def add(specs):
        for prompt, out in specs:
            names[s.add_sequence(rng.integers(0, 30000, size=prompt, dtype=np.int32), max_tokens=out,
                                 ignore_eos=True)] = next(letters)

    add(first)
    snapshots, done = [], []
    for step_no in range(1, 46):
        if step_no == 25:
            add(later)
        _, finished = advance(s, rng)
        done += [names[i] for i in finished]
        if step_no in (1, 20, 24, 26, 45):
            snapshots.append({"after_step": step_no, "pool": pool_map(s, names),
                              "running": "".join(sorted(names[i] for i in s.running_ids)),
                              "finished_so_far": "".join(done)})
    tables = {names[i]: s.sequence(i)["block_ids"] for i in s.running_ids}
    ruler = "".join(str(i // 10) for i in range(48)) + "\n" + "".join(str(i % 10) for i in range(48))
    lines = [ruler] + [f"{snap['pool']}  after step {snap['after_step']:>2}: running {snap['running']}, "
                       f"finished {snap['finished_so_far'] or '-'}" for snap in snapshots]
    text = "\n".join(lines) + "\n\nBlock tables after step 45:\n" + "\n".join(
        f"  {name}: {table}" for name, table in sorted(tables.items()))
    return snapshots, tables, text


def run(args) -> tuple[str, dict, str]:
    rows, table = follow_one_sequence()
    snapshots, tables, picture = scattered_batch()
    md = ("## Demo: block tables (scheduler and block pool only, block size 16)\n\n"
          "### One sequence through chunked prefill and decode\n\n"
          "Sequence A (40-token prompt, 60 output tokens) next to a neighbour B, 16 prompt tokens a step. "
          "A row per block boundary: A's block table maps its logical blocks to physical ones.\n\n"
          f"{table}\n\n### A batch: scattered physical blocks\n\n"
          "Sequences A-F start together, G and H join at step 25 into blocks the finished ones freed. One "
          "character per physical block (index ruler on top), '.' = free.\n\n"
          f"```\n{picture}\n```")
    return "demo_block_table", {"one_sequence": rows, "pool_snapshots": snapshots, "final_tables": tables}, md
