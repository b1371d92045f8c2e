"""Whether a step's llguidance masks fill faster on more threads: 64 matchers under structured_bench's JSON
schema, each at its own place in one JSON text and advanced a token a step (fresh states, as in the engine),
filled by llguidance's Python executor on 1 or 2 threads, the matchers cloned from one compiled grammar or
from two separate compilations (which share no lexer state); then the engine's way since session 39, its
GrammarPool (cpp/grammar/grammar_pool.h: llguidance's C API, accept and fill in one pass) on 1, 2, 4 and 8
threads (bench/results/h200/session39.md).

    python bench/perf/probes/llguidance_parallel_fill.py [--steps 60] [--rows 64]
    python bench/perf/probes/llguidance_parallel_fill.py --quick     # 8 steps of 8 rows: checks the script works
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from structured_bench import LONG_SCHEMA  # noqa: E402

import torch  # noqa: E402

_FRUITS = ("apple banana cherry durian elderberry fig grape honeydew kiwi lemon mango nectarine orange papaya "
           "quince raspberry strawberry tangerine").split()


def median_fill_ms(templates: list, threads: int, text_ids: list[int], steps: int, rows: int, words: int) -> float:
    import llguidance

    matchers = [templates[r % len(templates)].deep_copy() for r in range(rows)]
    starts = [(r * 13) % 40 for r in range(rows)]
    for m, start in zip(matchers, starts):
        if not all(m.consume_token(t) for t in text_ids[:start]):
            raise RuntimeError("the schema refused the probe's text")
    executor = llguidance.LLExecutor(num_threads=threads)
    buffer = torch.zeros((rows, words), dtype=torch.int32)
    pairs = [(m, row) for row, m in enumerate(matchers)]
    times = []
    for step in range(steps):
        begin = time.perf_counter()
        executor.unsafe_compute_mask_ptr(pairs, buffer.data_ptr(), words * 4, rows)
        times.append(time.perf_counter() - begin)
        if not all(executor.consume_token_par([(m, text_ids[s + step]) for m, s in zip(matchers, starts)])):
            raise RuntimeError("the schema refused the probe's text")
    return 1e3 * statistics.median(times)


def pool_step_ms(backend, grammar_spec, threads: int, text_ids: list[int], steps: int, rows: int,
                 words: int) -> float:
    """Median ms a step of the GrammarPool on `threads` threads: each row takes its next token, then fills."""
    from pagedserve._core.grammar import GrammarPool

    template = backend.compile(grammar_spec).new_matcher().raw
    matchers, starts = [template.clone() for _ in range(rows)], [(r * 13) % 40 for r in range(rows)]
    for m, start in zip(matchers, starts):
        if not all(m.consume(t) for t in text_ids[:start]):
            raise RuntimeError("the schema refused the probe's text")
    pool, buffer, times = GrammarPool(threads), torch.zeros((rows, words), dtype=torch.int32), []
    for step in range(steps):
        tokens = [text_ids[s + step] for s in starts]
        begin = time.perf_counter()
        accepted = pool.run(matchers, tokens, list(range(rows)), buffer.data_ptr(), rows, words)
        times.append(time.perf_counter() - begin)
        if not all(accepted):
            raise RuntimeError("the schema refused the probe's text")
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="8 steps of 8 rows: checks the script works")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.rows = 8, 8
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    from pagedserve import StructuredOutputsParams
    from pagedserve.engine.grammar_backends import LLGuidanceBackend
    from pagedserve.models.default_model import model_path

    tokenizer = AutoTokenizer.from_pretrained(str(model_path(None)), local_files_only=True)
    vocab = 49152
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=[tokenizer.eos_token_id])
    grammar = LLGuidanceBackend.grammar_text(StructuredOutputsParams(json=LONG_SCHEMA))  # as the engine compiles it
    text = json.dumps([f"{word} {i}" for i, word in enumerate(_FRUITS * 6)], indent=2)
    text_ids = tokenizer.encode(text, add_special_tokens=False)
    compiled = [llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0) for _ in range(2)]
    words = (vocab + 31) // 32
    for threads in (1, 2):
        one = median_fill_ms(compiled[:1], threads, text_ids, args.steps, args.rows, words)
        two = median_fill_ms(compiled, threads, text_ids, args.steps, args.rows, words)
        print(f"{threads} thread(s): {one:.3f} ms a step of {args.rows} masks from one compilation, {two:.3f} ms "
              f"from two (median of {args.steps} steps)")
    backend = LLGuidanceBackend(tokenizer, vocab, [tokenizer.eos_token_id])
    spec = StructuredOutputsParams(json=LONG_SCHEMA)
    for threads in (1, 2, 4, 8):
        ms = pool_step_ms(backend, spec, threads, text_ids, args.steps, args.rows, words)
        print(f"GrammarPool, {threads} thread(s): {ms:.3f} ms a step of {args.rows} accepts and masks "
              f"(median of {args.steps} steps)")


if __name__ == "__main__":
    main()
