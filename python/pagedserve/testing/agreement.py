"""The bf16 agreement check against transformers, shared by tests_py/test_gpu_engine.py and
bench/numerics/bf16_agreement.py: its 32 prompts (plain text, short Q&A and chat-templated
questions, as token ids), transformers' greedy continuations one prompt at a time, and
pagedserve's first-step logits for one prompt through the paged path."""

from __future__ import annotations

import numpy as np
import torch

N_TOKENS = 16  # greedy tokens compared per prompt

PLAIN = [
    "The capital of France is",
    "def quicksort(arr):",
    "In 1969, the first humans",
    "The recipe for a good pancake starts with",
    "Water boils at",
    "A list of prime numbers: 2, 3, 5,",
    "The mitochondria is",
    "Dear diary, today I",
]
CHAT = ("Name three fruits.", "What is 2+2?", "Tell me a joke.", "Who wrote Hamlet?", "Translate 'hello' to French.",
        "What color is the sky?", "Define entropy.", "What is the speed of light?", "Give me a synonym for happy.",
        "How many legs has a spider?", "What is Python?", "Say something nice.")


def agreement_prompts(tokenizer) -> list[list[int]]:
    texts = PLAIN + [f"Question {i}: what is {i} times {i + 3}? Answer:" for i in range(12)] + \
        [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
         for q in CHAT]
    ids = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    assert len(ids) == 32
    return ids


def hf_greedy(model, prompts, scores=False, n_tokens=N_TOKENS):
    """transformers' greedy continuations, one prompt at a time; with scores, also each step's logits."""
    outs, all_scores = [], []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=model.device)
            res = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_tokens,
                                 min_new_tokens=n_tokens, do_sample=False, pad_token_id=0,
                                 output_scores=scores, return_dict_in_generate=True)
            outs.append(res.sequences[0, len(p):].tolist())
            if scores:
                all_scores.append([s[0].float().cpu() for s in res.scores])
    return outs, all_scores


def first_step_logits(llm, prompt) -> torch.Tensor:
    """The logits pagedserve computes for a prompt's first generated token (one prefill step of the
    engine's own scheduler and runner, nothing sampled); the engine is left with no sequence."""
    engine = llm.llm_engine
    scheduler = engine.scheduler
    seq = scheduler.add_sequence(np.asarray(prompt, dtype=np.int32), max_tokens=1)
    step = scheduler.schedule()
    logits = engine.worker.runner.compute_logits(step)[0].float()
    scheduler.update(np.zeros(1, dtype=np.int32))
    assert scheduler.sequence(seq) is None
    return logits
