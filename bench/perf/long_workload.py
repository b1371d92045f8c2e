"""The long-sequence workload other engines publish (e.g. nano-vllm's bench):
N requests whose prompt and output lengths are each uniform in [MIN, MAX]
(random token ids, seed 0), temperature 0.6, ignore_eos, all submitted at once;
output tokens over wall time, prefill included.

    python bench/perf/long_workload.py                       # GPU: 256 requests, 100..1024, Qwen3-0.6B shapes
    python bench/perf/long_workload.py --device cpu --quick  # CPU-sized: 16 requests, 16..64, Qwen3-0.6B shapes
    python bench/perf/long_workload.py --model DIR           # real weights from a local HF directory instead
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.report import add_engine_options, engine_options, markdown_table, save  # noqa: E402
from common.model_shapes import shape_dir  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default="qwen3-0.6b", help="dummy-weight model shape (bench/common/model_shapes.py)")
    ap.add_argument("--model", default=None, help="HF model dir instead of a shape")
    ap.add_argument("--num-requests", type=int, default=None, help="default 256 (--quick: 16)")
    ap.add_argument("--min-len", type=int, default=None, help="default 100 (--quick: 16)")
    ap.add_argument("--max-len", type=int, default=None, help="default 1024 (--quick: 64)")
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="CPU sizes: 16 requests of 16..64 tokens")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--out", type=Path, default=None)
    add_engine_options(ap)
    args = ap.parse_args()
    for key, full, quick in (("num_requests", 256, 16), ("min_len", 100, 16), ("max_len", 1024, 64)):
        if getattr(args, key) is None:  # explicit sizes win over --quick
            setattr(args, key, quick if args.quick else full)
    from pagedserve import LLM, SamplingParams
    if args.model:
        model_dir, load_format, label = Path(args.model), "auto", Path(args.model).name
    else:
        model_dir, load_format, label = shape_dir(args.shape), "dummy", args.shape
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    llm = LLM(str(model_dir), dtype=dtype, device=args.device, load_format=load_format,
              max_model_len=2 * args.max_len + 16, max_num_seqs=min(256, args.num_requests), seed=args.seed,
              **engine_options(args.option))
    vocab = llm.llm_engine.model_config.vocab_size
    rng = np.random.default_rng(args.seed)
    prompt_lens = rng.integers(args.min_len, args.max_len + 1, size=args.num_requests)
    output_lens = rng.integers(args.min_len, args.max_len + 1, size=args.num_requests)
    prompts = [{"prompt_token_ids": rng.integers(0, min(vocab, 10000), size=n).tolist()} for n in prompt_lens]
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=int(n)) for n in output_lens]
    llm.generate(["warm up"] if llm.get_tokenizer() else [{"prompt_token_ids": [1, 2, 3]}],
                 SamplingParams(max_tokens=8), use_tqdm=False)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    assert generated == int(output_lens.sum()), "ignore_eos: every request generates exactly its length"
    stats = llm.llm_engine.stats()
    row = {"model": label, "device": args.device, "dtype": dtype, "requests": args.num_requests,
           "lengths": f"{args.min_len}..{args.max_len}", "output_tokens": generated,
           "prompt_tokens": int(prompt_lens.sum()), "wall_s": wall, "output_tok_s": generated / wall,
           "preemptions": stats["num_preemptions"], "kv_blocks": stats["num_blocks"]}
    cols = list(row)
    table = markdown_table([row], cols)
    print(table)
    name = f"long_workload_{args.device.split(':')[0]}" + ("_quick" if args.quick else "")
    path = save(name, {"row": row}, "## Long-sequence workload (random lengths, temperature "
                f"{args.temperature}, ignore_eos)\n\n{table}", args.out)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
