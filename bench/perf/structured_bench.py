"""What structured outputs cost: output tokens per second of 16 concurrent requests constrained by a
JSON schema vs the same requests unconstrained (default model, offline LLM API), the host time per
step spent filling the grammar's token masks, and the time to compile a typical schema (first use,
which loads the tokenizer's grammar vocabulary, then a new schema, then cached).

The schema (an array of at least 200 strings) cannot be finished within max_tokens, so every
constrained request runs to max_tokens as the unconstrained ones (ignore_eos) do: both generate the
same number of tokens. A compact case (disable_any_whitespace) shows what the free whitespace costs:
the engine bounds a whitespace run (MAX_WHITESPACE_RUN), a counted repetition that makes xgrammar's
masks about 4x as costly to fill. A further JSON case bounds each string's length (maxLength 24): a counted
repetition that xgrammar cannot serve from its context-independent token cache, the slow case of
its masks (about 15x the host time per token of the first on a Zen 4 core). A third case is what tool_choice "auto" adds to a chat request with the shipped
tools template: a structural tag over free text (calls after <tool_call> must be valid). These rows
sample plainly (temperature 0.7): where a step's masks cost more than CHECK_FIRST_SECONDS, each draw is
checked by the grammar and only refused rows get a mask and draw again (engine/grammar_step.py); the
table gives the refused share and both host costs. Last, the JSON schema case's outputs are replayed through
each backend's masks (xgrammar on 1..N threads, llguidance on 1, 2 and 4 threads of its GrammarPool): what a
step's masks cost the host.

    PYTHONPATH=python python bench/perf/structured_bench.py [--device cpu] [--runs 2]
    python bench/perf/structured_bench.py --quick     # 4 requests, 16 tokens: checks the script works
    python bench/perf/structured_bench.py --model DIR --load-format dummy   # a model's config and tokenizer only
    python bench/perf/structured_bench.py --option structured_outputs_backend=xgrammar   # JSON by xgrammar too

Prints a table and writes bench/results/structured_<device>.json and .md (_quick with --quick).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.report import add_engine_options, arg_parser, engine_options, markdown_table, save  # noqa: E402

LONG_SCHEMA = {"type": "array", "items": {"type": "string"}, "minItems": 200}
BOUNDED_SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 200}
TYPICAL_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "emails": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
                "required": ["street", "city"]},
    "role": {"enum": ["admin", "user", "guest"]}}, "required": ["name", "age", "role"]}
PROMPT = "List some fruit names as a JSON array of strings:"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS_AUTO = {"structural_tag": {"type": "structural_tag", "triggers": ["<tool_call>"], "structures": [
    {"begin": '<tool_call>\n{"name": "get_weather", "arguments": ', "schema": WEATHER, "end": "}\n</tool_call>"}]}}


def main() -> None:
    ap = arg_parser(__doc__, "4 requests of 16 tokens, one run")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default=None, help="a model directory (default: the default model)")
    ap.add_argument("--load-format", default="auto", help="dummy: random weights (the host's costs, not the "
                    "model's choices: its tokens are not the default model's)")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=2, help="timed runs of each case (interleaved); best is kept")
    ap.add_argument("--skip-replay", action="store_true", help="leave out the masks' replay (A/B runs of throughput)")
    add_engine_options(ap)
    args = ap.parse_args()
    if args.quick:
        args.num_requests, args.max_tokens, args.runs = 4, 16, 1

    from pagedserve import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(args.model, device=args.device, seed=0, load_format=args.load_format, **engine_options(args.option))
    engine = llm.llm_engine
    steps = [0]
    step = engine.step

    def counted_step():
        steps[0] += 1
        return step()
    engine.step = counted_step
    phases = {"launch": 0.0, "wait": 0.0}  # host seconds in execute_async (forward queued, masks filled) / result()
    execute_async = engine.worker.execute_async

    def timed_execute_async(*a, **k):
        start = time.perf_counter()
        pending = execute_async(*a, **k)
        phases["launch"] += time.perf_counter() - start
        if pending is not None:
            result = pending.result

            def timed_result():
                begin = time.perf_counter()
                try:
                    return result()
                finally:
                    phases["wait"] += time.perf_counter() - begin
            pending.result = timed_result
        return pending
    engine.worker.execute_async = timed_execute_async

    compile_s = {}
    for label, schema in (("first use", LONG_SCHEMA), ("typical schema", TYPICAL_SCHEMA),
                          ("typical schema, cached", TYPICAL_SCHEMA)):
        start = time.perf_counter()
        engine.grammars.compile(StructuredOutputsParams(json=schema))
        compile_s[label] = time.perf_counter() - start

    cases = {
        "unconstrained": SamplingParams(temperature=0.7, max_tokens=args.max_tokens, ignore_eos=True),
        "json schema": SamplingParams(temperature=0.7, max_tokens=args.max_tokens,
                                      structured_outputs=StructuredOutputsParams(json=LONG_SCHEMA)),
        "json schema, compact (no free whitespace)": SamplingParams(
            temperature=0.7, max_tokens=args.max_tokens,
            structured_outputs=StructuredOutputsParams(json=LONG_SCHEMA, disable_any_whitespace=True)),
        "json schema, strings maxLength 24": SamplingParams(
            temperature=0.7, max_tokens=args.max_tokens, structured_outputs=StructuredOutputsParams(json=BOUNDED_SCHEMA)),
        "tools auto (structural tag)": SamplingParams(temperature=0.7, max_tokens=args.max_tokens, ignore_eos=True,
                                                      structured_outputs=StructuredOutputsParams(**TOOLS_AUTO)),
    }
    llm.generate([PROMPT] * 2, cases["unconstrained"], use_tqdm=False)  # warm up
    best: dict[str, dict] = {}
    written: list[list[int]] = []  # the JSON schema case's outputs, replayed by mask_replay
    for _ in range(args.runs):
        for name, params in cases.items():
            g = engine.grammars.stats
            steps[0], mask0, check0, thread0 = 0, g.mask_seconds, g.check_seconds, g.thread_seconds
            checked0, refused0 = g.rows_checked, g.rows_refused
            waited0 = getattr(g, "steps_waited_on_device", 0)  # (an older tree's stats lack it: py_ab)
            phases.update(launch=0.0, wait=0.0)
            start = time.perf_counter()
            outs = llm.generate([PROMPT] * args.num_requests, params, use_tqdm=False)
            wall = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            if name == "json schema":
                written = [list(o.outputs[0].token_ids) for o in outs]
            mask, check, thread = g.mask_seconds - mask0, g.check_seconds - check0, g.thread_seconds - thread0
            checked, refused = g.rows_checked - checked0, g.rows_refused - refused0
            waited = getattr(g, "steps_waited_on_device", 0) - waited0
            launch, wait = phases["launch"], phases["wait"]

            def ms_per_step(seconds: float) -> float:
                return 1000 * seconds / max(steps[0], 1)
            spec = params.structured_outputs  # which backend served it: a fallback must show (session 36)
            backend = engine.grammars.compile(spec).backend if spec is not None else "-"
            row = {"case": name, "backend": backend, "requests": args.num_requests, "output_tokens": tokens,
                   "wall_s": wall, "tokens_per_s": tokens / wall, "steps": steps[0],
                   "mask_ms_per_step": ms_per_step(mask), "thread_ms_per_step": ms_per_step(thread),
                   "check_ms_per_step": ms_per_step(check),
                   "refused_pct": 100 * refused / checked if checked else 0.0,
                   "device_waited_pct": 100 * waited / max(steps[0], 1),  # draws that read the thread's masks as left
                   "launch_ms_per_step": ms_per_step(launch), "wait_ms_per_step": ms_per_step(wait),
                   "other_host_ms_per_step": ms_per_step(wall - launch - wait),
                   "finish": ",".join(sorted({o.outputs[0].finish_reason for o in outs}))}
            if name not in best or row["tokens_per_s"] > best[name]["tokens_per_s"]:
                best[name] = row
    rows = list(best.values())
    vs_plain = {name: row["tokens_per_s"] / best["unconstrained"]["tokens_per_s"] for name, row in best.items()}
    ratio, compact_ratio = vs_plain["json schema"], vs_plain["json schema, compact (no free whitespace)"]
    bounded_ratio, tag_ratio = vs_plain["json schema, strings maxLength 24"], vs_plain["tools auto (structural tag)"]
    table = markdown_table(rows, ["case", "backend", "requests", "output_tokens", "wall_s", "tokens_per_s", "steps",
                                 "mask_ms_per_step", "thread_ms_per_step", "check_ms_per_step", "refused_pct",
                                 "device_waited_pct", "launch_ms_per_step",
                                 "wait_ms_per_step",
                                 "other_host_ms_per_step", "finish"])
    fills = [] if args.skip_replay else mask_replay(engine, written)
    compile_table = markdown_table([{"compile": k, "ms": 1000 * v} for k, v in compile_s.items()],
                                   ["compile", "ms"])
    overlap = "while the device runs the forward" if args.device != "cpu" else "on the calling thread, no overlap"
    md = (f"{table}\n\nJSON schema throughput: {100 * ratio:.1f}% of unconstrained ({100 * compact_ratio:.1f}% "
          f"compact, {100 * bounded_ratio:.1f}% with bounded string lengths); tools auto (structural tag): {100 * tag_ratio:.1f}%. Masks are filled once the forward is "
          f"queued ({overlap}); where they would cost more than CHECK_FIRST_SECONDS a step, rows that sample "
          f"plainly (temperature, as here) draw unmasked, the grammar checks each draw (check) and only refused "
          f"rows (refused %) get a mask (mask) and draw again, after the first draw reaches the host. With "
          f"structured_outputs_thread on ({engine.config.structured_outputs_thread} here), steps whose masks are "
          f"cheap go to the grammar thread (thread: its ms a step; mask: the engine's part) and run ahead; their "
          f"draw is queued after the forward and waits on the device for the thread's masks where the rows stayed "
          f"put (device waited %: the share of steps). Per step: launch = host "
          f"time queuing the forward and sampling; wait = host time waiting for the sampled ids, checks and "
          f"redraws included; other = the rest of the step on the host (scheduling, recording tokens, advancing "
          f"matchers).\n\n{compile_table}")
    if fills:
        md += (f"\n\nThe JSON schema case's {len(written)} outputs replayed through each backend's masks (host, one "
               f"batch fill a step, as the engine fills them; the engine's backend for json schemas: "
               f"{engine.info().structured_outputs_backend}, see engine/grammar.py backend_order):\n\n"
               f"{markdown_table(fills, ['backend', 'threads', 'ms_per_step_median', 'ms_per_step_mean', 'us_per_row'])}")
    print(md)
    name = f"structured_{args.device}" + ("_quick" if args.quick else "")
    path = save(name, {"rows": rows, "ratio": ratio, "mask_replay": fills, "tools_auto_ratio": tag_ratio, "bounded_strings_ratio": bounded_ratio,
                       "compact_ratio": compact_ratio, "compile_s": compile_s,
                       "max_tokens": args.max_tokens},
                md, args.out)
    print(f"wrote {path}")


def mask_replay(engine, written: list[list[int]]) -> list[dict]:
    """Host ms a step to fill the masks of `written` (token ids the engine wrote under LONG_SCHEMA), every
    row in one batch fill a step as the engine fills them (engine/grammar_backends.py MaskFiller): xgrammar
    and llguidance (its GrammarPool, cpp/grammar/grammar_pool.h) by thread count."""
    import os
    import statistics

    import torch

    from pagedserve import StructuredOutputsParams
    from pagedserve._core.grammar import GrammarPool
    from pagedserve.engine.grammar import Grammars
    from pagedserve.engine.grammar_backends import MaskFiller

    info, rows = engine.info(), []
    spec = StructuredOutputsParams(json=LONG_SCHEMA)
    bitmask = torch.zeros((max(len(written), 1), (info.limits.vocab_size + 31) // 32), dtype=torch.int32)
    cpus = os.cpu_count() or 1
    compiled = {backend: Grammars(info.model_path, info.limits.vocab_size, engine.eos_token_ids, max_rows=1,
                                  backend=backend).compile(spec) for backend in ("xgrammar", "llguidance")}
    runs = ([("xgrammar", t) for t in sorted({1, 2, 4, 8, 16, cpus}) if t <= cpus]
            + [("llguidance", t) for t in (1, 2, 4) if t <= cpus])
    for backend, threads in runs:
        filler = MaskFiller(threads, GrammarPool(threads if backend == "llguidance" else 1))
        matchers, steps, filled = [compiled[backend].new_matcher() for _ in written], [], 0
        for position in range(max(map(len, written), default=0)):
            live = [(row, m) for row, m in enumerate(matchers) if position < len(written[row]) and not m.is_terminated()]
            start = time.perf_counter()
            filler.fill(live, bitmask)
            steps.append(time.perf_counter() - start)
            filled += len(live)
            for row, matcher in live:
                matcher.accept_token(written[row][position])
        rows.append({"backend": compiled[backend].backend, "threads": threads,
                     "ms_per_step_median": 1000 * statistics.median(steps) if steps else 0.0,
                     "ms_per_step_mean": 1000 * statistics.fmean(steps) if steps else 0.0,
                     "us_per_row": 1e6 * sum(steps) / max(filled, 1)})
    return rows


if __name__ == "__main__":
    main()
