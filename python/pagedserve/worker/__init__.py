"""The worker: what lives on the model's device (model, KV cache, model runner, CUDA graphs)."""
