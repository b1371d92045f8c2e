"""The 32 prompts of the bf16 agreement check (GPU test and bench/bf16_agreement.py):
plain text, short Q&A and chat-templated questions, as token ids."""

from __future__ import annotations

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
