"""The engine: host-side bookkeeping of requests (tokenizer, scheduler, detokenizer, stop strings)."""
