"""waste: a static batch runs every row until its longest request is done.

A batch of short and long requests is generated greedily with natural EOS (the
model decides how long each answer is; with dummy weights, seeded lengths
stand in). Each request needs as many decode steps as it has output tokens; in
a static batch every row is stepped until the longest finishes, so a short
answer's row spends the rest of the batch's steps on padding. Continuous
batching frees the row the step the request ends.
"""

from __future__ import annotations

import numpy as np
from common.report import markdown_table

from _demos.common import add_engine_args, engine_label, make_llm, run_requests, warm_up

SHORT_QUESTIONS = ("What is 7 times 8? Reply with the number only.", "Say hello in French, one word.",
                   "Name a primary colour. One word.", "Is ice cold? Answer yes or no.")
LONG_QUESTIONS = ("Write a detailed story about a lighthouse keeper who finds a message in a bottle.",
                  "Explain in depth how a bicycle works, part by part.",
                  "Describe a week-long journey across a mountain range, day by day.",
                  "Write a long letter to a friend about learning to cook.")


def add_arguments(ap) -> None:
    add_engine_args(ap)
    ap.add_argument("--max-tokens", type=int, default=256)


def prompts_and_params(llm, args):
    from pagedserve import SamplingParams
    tok = llm.get_tokenizer()
    if tok is not None and getattr(tok, "chat_template", None):
        from pagedserve.engine.tokenizer import apply_chat_template
        questions = [q for pair in zip(SHORT_QUESTIONS, LONG_QUESTIONS) for q in pair]
        prompts = [apply_chat_template(tok, [{"role": "user", "content": q}]) for q in questions]
        return questions, prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    rng = np.random.default_rng(0)  # no tokenizer: seeded lengths, half short, half long
    lens = [int(rng.integers(4, 16)) if i % 2 == 0 else int(rng.integers(args.max_tokens // 2, args.max_tokens + 1))
            for i in range(8)]
    prompts = rng.integers(100, 30000, size=(8, 24)).tolist()
    return ([f"random prompt {i}" for i in range(8)], prompts,
            [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens])


def run(args) -> tuple[str, dict, str]:
    if args.quick:
        args.max_tokens = 24
    llm = make_llm(args, max_num_seqs=8)
    warm_up(llm)
    questions, prompts, params = prompts_and_params(llm, args)
    result = run_requests(llm, prompts, params, desc="waste")
    llm.shutdown()
    needed = [len(o.outputs[0].token_ids) for o in result.outputs]
    spent = max(needed)
    rows = [{"request": q[:60], "finish": o.outputs[0].finish_reason, "steps_needed": n, "static_batch_steps": spent,
             "wasted_steps": spent - n, "continuous_batch_steps": n}
            for q, o, n in zip(questions, result.outputs, needed)]
    answers = [o.outputs[0].text[:200] for o in result.outputs]  # in the JSON: what the model actually said
    total_needed, total_spent = sum(needed), spent * len(needed)
    summary = {"batch_size": len(needed), "row_steps_needed": total_needed, "row_steps_static": total_spent,
               "static_waste_share": 1 - total_needed / total_spent,
               "static_useful_share": total_needed / total_spent}
    cols = list(rows[0])
    md = (f"## Demo: waste in a static batch ({engine_label(args)})\n\n"
          f"One batch of {len(rows)} requests, greedy, natural EOS, max_tokens {args.max_tokens}. A static batch "
          f"steps every row {spent} times (its longest request); a row's steps past its own end are waste. "
          "Continuous batching spends exactly the steps needed and gives the row to the next request.\n\n"
          f"{markdown_table(rows, cols)}\n\n"
          f"Row-steps: needed {total_needed}, spent by the static batch {total_spent} "
          f"(**{summary['static_waste_share']:.0%} wasted**).")
    return "demo_waste", {"rows": rows, "answers": answers, "summary": summary, "max_tokens": args.max_tokens}, md
