"""KV blocks a long sequence holds with an all-layer sliding window vs without, and what it costs.

When every layer of a model slides over the same window W (Mistral with `sliding_window`:
ModelConfig.kv_window > 0), the scheduler gives the KV blocks wholly behind the window back to the pool,
so once a sequence is longer than W it holds a flat ceil((W - 1) / block_size) + 1 blocks. Without a
window (or on a hybrid model such as Gemma 2/3, where some layers attend the whole context) it holds
every block: its block count grows with its length.

Two random-weight Mistral-shaped checkpoints are built locally with transformers' MistralConfig (4 layers,
hidden 256, 4 heads, 2 KV heads, head_dim 64, vocab 4096; no hub) and saved to a temporary directory:
one with sliding_window = --window, one the same with sliding_window = None. Each runs ONE greedy
sequence (a random --prompt-len prompt, --max-tokens output tokens, EOS ignored) alone through
pagedserve.LLMEngine on the CPU, block_size 16, prefix caching off (so a block given back is free, not
cached-evictable: num_free_blocks counts evictable ones too), one step() at a time. After every step it
records the sequence's length and the blocks it holds: the live (not dropped) entries of its block table
(scheduler.sequence()), checked against the pool's num_used_blocks, which is the same figure with one
sequence and no prefix cache (and equals num_blocks - num_free_blocks).

Reported: peak and final (last step the sequence still ran) blocks held with and without the window, the
theoretical ceil((W - 1) / B) + 1, and output tokens per second of each run (wall time of the step loop,
the per-step bookkeeping included for both). The plot shows blocks held vs sequence length, both runs,
the window marked.

    PYTHONPATH=python python bench/perf/window_kv_bench.py [--window 256] [--max-tokens 1500]
    python bench/perf/window_kv_bench.py --quick     # 300 tokens, window 64, 2 layers

Prints a table and writes bench/results/window_kv_cpu.json, .md and .png (_quick with --quick); the per-step
traces go to bench/results/raw/window_kv_cpu.json (not committed).
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.plots import pyplot  # noqa: E402
from common.report import RESULTS_DIR, arg_parser, markdown_table, save, save_raw  # noqa: E402

SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, vocab_size=4096, max_position_embeddings=4096,
             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
QUICK_SHAPE = dict(SHAPE, num_hidden_layers=2)
BLOCK_SIZE = 16


def build_checkpoint(out_dir: Path, shape: dict, window: int | None, seed: int) -> None:
    """A random Mistral checkpoint (float32) in out_dir; the same seed gives the same weights for any window."""
    import torch
    from transformers import AutoModelForCausalLM, MistralConfig

    config = MistralConfig(**shape, sliding_window=window)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir)


def run_one(model_dir: Path, prompt: list[int], max_tokens: int, seed: int) -> dict:
    """One greedy sequence through LLMEngine step by step: per-step lengths and blocks held, wall time."""
    from pagedserve import SamplingParams
    from pagedserve.engine.engine import LLMEngine

    engine = LLMEngine(model=str(model_dir), device="cpu", seed=seed, block_size=BLOCK_SIZE,
                       enable_prefix_caching=False, max_num_seqs=1, kv_cache_memory_gb=0.25)
    kv_window = engine.model_config.kv_window
    # Warm up (first-call allocations, thread pools) on a short request, then check the pool is empty again.
    engine.add_request("warmup", prompt[:8], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats()["num_used_blocks"] == 0

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request("long", prompt, params)
    scheduler = engine.scheduler
    trace: list[dict] = []
    tokens: list[int] = []
    steps = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.outputs[0].token_ids)
        steps += 1
        ids = scheduler.running_ids
        if not ids:
            continue  # finished this step: its blocks are back in the pool
        seq = scheduler.sequence(ids[0])
        stats = scheduler.stats()
        held = sum(b >= 0 for b in seq["block_ids"])  # dropped entries are -1
        used = stats["num_used_blocks"]
        assert held == used == stats["num_blocks"] - stats["num_free_blocks"], (held, stats)
        assert stats["num_evictable_blocks"] == 0
        trace.append({"step": steps, "seq_len": len(seq["token_ids"]), "computed": seq["num_computed_tokens"],
                      "blocks_held": held, "table_len": len(seq["block_ids"])})
    wall = time.perf_counter() - start
    final_stats = engine.stats()
    engine.shutdown()
    assert len(tokens) == max_tokens, (len(tokens), max_tokens)
    assert final_stats["num_used_blocks"] == 0, "a finished sequence gives every block back"
    return {"kv_window": kv_window, "trace": trace, "wall_s": wall, "steps": steps, "output_tokens": len(tokens),
            "tokens": tokens, "num_preemptions": final_stats["num_preemptions"]}


def plot(path: Path, runs: dict[str, dict], window: int, theory: int, title: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for label, run in runs.items():
        xs = [t["seq_len"] for t in run["trace"]]
        ys = [t["blocks_held"] for t in run["trace"]]
        ax.plot(xs, ys, label=label, drawstyle="steps-post")
    ax.axvline(window, color="grey", linestyle="--", linewidth=1, label=f"window W = {window}")
    ax.axhline(theory, color="tab:red", linestyle=":", linewidth=1,
               label=f"ceil((W-1)/B)+1 = {theory}")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel(f"KV blocks held (block size {BLOCK_SIZE})")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = arg_parser(__doc__, "300 output tokens, window 64, a 2-layer model")
    ap.add_argument("--window", type=int, default=256, help="sliding_window of the windowed model")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=1500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-plot", action="store_true", help="skip the PNG")
    args = ap.parse_args()
    shape = SHAPE
    if args.quick:
        args.window, args.max_tokens, shape = 64, 300, QUICK_SHAPE

    import torch
    import transformers  # noqa: F401  (recorded in the versions: it built the checkpoints)

    generator = torch.Generator().manual_seed(args.seed + 1)
    prompt = torch.randint(3, shape["vocab_size"], (args.prompt_len,), generator=generator).tolist()
    theory = math.ceil((args.window - 1) / BLOCK_SIZE) + 1
    labels = {"window": f"sliding_window={args.window}", "full": "sliding_window=None"}
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="window_kv_bench_") as tmp:
        for key, window in (("window", args.window), ("full", None)):
            model_dir = Path(tmp) / key
            build_checkpoint(model_dir, shape, window, args.seed)
            runs[key] = run_one(model_dir, prompt, args.max_tokens, args.seed)
    assert runs["window"]["kv_window"] == args.window and runs["full"]["kv_window"] == 0

    rows = []
    for key in ("window", "full"):
        run, trace = runs[key], runs[key]["trace"]
        rows.append({"model": labels[key], "kv_window": run["kv_window"],
                     "final_seq_len": trace[-1]["seq_len"],
                     "peak_blocks_held": max(t["blocks_held"] for t in trace),
                     "final_blocks_held": trace[-1]["blocks_held"],
                     "blocks_without_freeing": trace[-1]["table_len"],
                     "theoretical_window_blocks": theory if key == "window" else None,
                     "output_tokens": run["output_tokens"], "steps": run["steps"], "wall_s": run["wall_s"],
                     "tokens_per_s": run["output_tokens"] / run["wall_s"],
                     "preemptions": run["num_preemptions"]})
    win, full = rows
    pairs = list(zip(runs["window"]["tokens"], runs["full"]["tokens"]))
    agree = next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs))  # greedy tokens before they part
    # Once past the window the windowed run must sit at (never above) the bound.
    past = [t["blocks_held"] for t in runs["window"]["trace"] if t["seq_len"] > args.window + BLOCK_SIZE]
    table = markdown_table(rows, ["model", "final_seq_len", "peak_blocks_held", "final_blocks_held",
                                  "blocks_without_freeing", "theoretical_window_blocks", "output_tokens",
                                  "wall_s", "tokens_per_s", "preemptions"])
    summary = (f"With the window the sequence holds at most {win['peak_blocks_held']} blocks "
               f"(theory ceil(({args.window}-1)/{BLOCK_SIZE})+1 = {theory}); past the window it held "
               f"{min(past) if past else '-'}-{max(past) if past else '-'} blocks. Without it: "
               f"{full['final_blocks_held']} blocks at length {full['final_seq_len']} "
               f"({full['final_blocks_held'] / max(win['final_blocks_held'], 1):.1f}x). "
               f"Tokens/s with / without the window: {win['tokens_per_s'] / full['tokens_per_s']:.2f}x. "
               f"The two models share their weights; their greedy tokens agree on the first "
               f"{agree} of {args.max_tokens} tokens (the window first hides context from output token "
               f"{max(args.window - args.prompt_len + 1, 0)}, counting from 0).")
    model_line = (f"Mistral shape: {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, "
                  f"{shape['num_attention_heads']} heads ({shape['num_key_value_heads']} KV, head_dim "
                  f"{shape['head_dim']}), vocab {shape['vocab_size']}; random float32 weights; one sequence, "
                  f"{args.prompt_len}-token random prompt, {args.max_tokens} greedy output tokens (EOS ignored); "
                  f"CPU, block size {BLOCK_SIZE}, prefix caching off, torch threads {torch.get_num_threads()}. "
                  f"\"blocks_without_freeing\": the block-table length at the end (what a full-attention "
                  f"sequence of that length holds). Blocks held: live block-table entries, equal to the "
                  f"pool's num_used_blocks at every step.")
    md = f"{table}\n\n{summary}\n\n{model_line}"
    print(md)
    name = "window_kv_cpu" + ("_quick" if args.quick else "")
    out_dir = args.out or RESULTS_DIR
    payload = {"rows": rows, "device": "cpu", "window": args.window, "block_size": BLOCK_SIZE,
               "theoretical_window_blocks": theory, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
               "shape": shape, "greedy_tokens_agree_until": agree}
    path = save(name, payload, md, out_dir)
    save_raw(name, {"columns": ["seq_len", "blocks_held"],  # the per-step traces the plot draws
                    "traces": {labels[k]: [[t["seq_len"], t["blocks_held"]] for t in runs[k]["trace"]] for k in runs}},
             out_dir)
    if not args.no_plot:
        plot(Path(out_dir) / f"{name}.png", {labels[k]: runs[k] for k in ("window", "full")}, args.window, theory,
             f"KV blocks held by one sequence (Mistral shape, {shape['num_hidden_layers']} layers, CPU)")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
