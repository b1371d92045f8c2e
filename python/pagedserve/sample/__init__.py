"""Sampling: logits to token ids on the model's device."""
