"""Output tok/s of greedy decodes at a few batch sizes, per CPU mode, random weights of a model shape, in one
process: run it once per build (PYTHONPATH=<old or new package>) and alternate the builds to compare them
(session 30's AMX prefetch and int8 threshold: bench/results/intel_amx/session30.md). 24-token prompts, no
prefix caching. Pin it to measure a 2-core machine:

    taskset -c 0,1 python bench/perf/probes/cpu_decode_rounds.py [--tokens 32] [--batches 1 4 16]
    python bench/perf/probes/cpu_decode_rounds.py --quick     # the int8 mode, 4 tokens, batch 1
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common.model_shapes import random_bf16_options, shape_dir  # noqa: E402
from common.report import arg_parser, markdown_table, save  # noqa: E402

MODES = {"bfloat16": dict(cpu_precision="bfloat16"), "float32": dict(cpu_precision="float32"),
         "int8": dict(quantization="int8")}


def main() -> None:
    ap = arg_parser(__doc__, "the int8 mode, 4 tokens, batch 1: checks the script works")
    ap.add_argument("--shape", default="smollm2-135m", help="model shape (bench/common/model_shapes.py)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--name", default="cpu_decode_rounds", help="results file name (one per build compared)")
    args = ap.parse_args()
    from pagedserve import LLM, SamplingParams, ops

    modes, tokens, batches = MODES, args.tokens, args.batches
    if args.quick:
        modes, tokens, batches = {"int8": MODES["int8"]}, 4, [1]
    engines = {mode: LLM(str(shape_dir(args.shape)), device="cpu", load_format="dummy", max_num_seqs=max(batches),
                         max_model_len=256, enable_prefix_caching=False, **random_bf16_options(options))
               for mode, options in modes.items()}
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for llm in engines.values():
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    rows = []
    for batch in batches:
        prompts = [{"prompt_token_ids": list(range(100 + i, 124 + i))} for i in range(batch)]
        for mode, llm in engines.items():
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            rows.append({"mode": mode, "batch": batch, "output_tok_s": batch * tokens / (time.perf_counter() - start)})
    md = (f"## Greedy decodes on CPU, {args.shape} random weights, {tokens} tokens, ops {ops.cpu_isa()}\n\n"
          + markdown_table(rows, ["mode", "batch", "output_tok_s"]))
    print(md)
    print("saved", save(args.name, {"shape": args.shape, "tokens": tokens, "rows": rows}, md, args.out))


if __name__ == "__main__":
    main()
