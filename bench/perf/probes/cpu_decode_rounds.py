"""Output tok/s of greedy decodes at a few batch sizes, per CPU mode, random weights of a model shape, one
process: run it once per build (PYTHONPATH=<old or new package>) and alternate the builds to compare them
(session 30's AMX prefetch and int8 threshold: bench/results/intel_amx/session30.md). 24-token prompts, no
prefix caching. Pin it to measure a 2-core machine:

    taskset -c 0,1 python bench/perf/probes/cpu_decode_rounds.py [--tokens 32] [--batches 1 4 16]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common.model_shapes import random_bf16_options, shape_dir  # noqa: E402

MODES = {"bfloat16": dict(cpu_precision="bfloat16"), "float32": dict(cpu_precision="float32"),
         "int8": dict(quantization="int8")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    args = ap.parse_args()
    import pagedserve
    from pagedserve import LLM, SamplingParams, ops

    print(f"package {pagedserve.__file__}, ops {ops.cpu_isa()}")
    engines = {mode: LLM(str(shape_dir(args.shape)), device="cpu", load_format="dummy", max_num_seqs=max(args.batches),
                         max_model_len=256, enable_prefix_caching=False, **random_bf16_options(options))
               for mode, options in MODES.items()}
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    for llm in engines.values():
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    for batch in args.batches:
        prompts = [{"prompt_token_ids": list(range(100 + i, 124 + i))} for i in range(batch)]
        for mode, llm in engines.items():
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            print(f"{mode:9s} batch {batch:<3d} {batch * args.tokens / (time.perf_counter() - start):7.1f} tok/s")


if __name__ == "__main__":
    main()
