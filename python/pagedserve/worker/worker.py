"""Worker: what lives on the model's device, built once and whole.

The model (weights loaded, packed for the CPU where that is lossless), the
sampler, the KV cache sized by a KVPlan, and the ModelRunner that executes
steps over them. The engine reads `kv_plan` to size its scheduler; it never
reaches further in than `execute_async`.
"""

from __future__ import annotations

import logging
import math
from typing import Sequence

import torch

from pagedserve import ops
from pagedserve.engine_config import EngineConfig
from pagedserve.models import build_model
from pagedserve.models.cpu_weight_packing import pack_cpu_weights
from pagedserve.models.model_config import ModelConfig
from pagedserve.sample.sampler import PendingSamples, Sampler
from pagedserve.worker.kv_cache import allocate_kv_cache, bytes_per_block
from pagedserve.worker.memory_budget import KVPlan, kv_cache_budget_bytes, plan_kv_cache
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.step_inputs import StepInputs
from pagedserve.worker.worst_case_step import worst_case_rows, worst_case_step

logger = logging.getLogger("pagedserve")


class Worker:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, eos_token_ids: Sequence[int]):
        """config: resolved (engine_config.resolve_defaults); model_config: on the device to run on."""
        mc, device = model_config, model_config.device
        self.device = device
        self.model_config = mc
        baseline_bytes = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        self.model = build_model(mc, device, load_format=config.load_format, seed=config.seed)
        packed = device.type == "cpu" and pack_cpu_weights(self.model, config.cpu_weight_dtype,
                                                           config.cpu_precision, config.quantization)
        self.sampler = Sampler(device, mc.vocab_size, eos_token_ids, seed=config.seed)
        self._workspace = ops.paged_attention_workspace(config.max_num_seqs, mc.num_heads, mc.head_dim,
                                                        config.max_model_len, device)
        per_block = bytes_per_block(mc.num_layers, mc.num_kv_heads, config.block_size, mc.head_dim, mc.dtype)
        self.kv_plan: KVPlan = plan_kv_cache(
            config, mc.max_position_embeddings, per_block,
            lambda: kv_cache_budget_bytes(lambda: self._run_worst_case_step(config), config.gpu_memory_utilization,
                                          device, baseline_bytes), mc.kv_window)
        plan = self.kv_plan
        kv_cache = allocate_kv_cache(mc.num_layers, plan.num_blocks, mc.num_kv_heads, plan.block_size, mc.head_dim,
                                     mc.dtype, device)
        inputs = self._step_inputs(config, plan.max_model_len)
        graphs = None
        if device.type == "cuda" and not config.enforce_eager and getattr(self.model, "supports_cuda_graphs", True):
            from pagedserve.worker.cuda_graphs import CudaGraphs
            graphs = CudaGraphs(self.model, kv_cache, inputs, config.max_num_seqs, plan.max_model_len)
        # Packed weights: every matrix product runs in our ops' pool; torch keeps only light work.
        self.runner = ModelRunner(self.model, kv_cache, self.sampler, inputs, graphs=graphs,
                                  torch_threads=1 if packed else None)
        logger.info("model %s on %s (%s): %d KV blocks of %d tokens (%.2f GiB), max_model_len %d",
                    mc.model_dir.name if mc.model_dir else mc.architecture, device, mc.dtype, plan.num_blocks,
                    plan.block_size, kv_cache.numel() * kv_cache.element_size() / 2**30, plan.max_model_len)

    def execute_async(self, step, rows, grammar=None, prompt_plan=None) -> PendingSamples:
        return self.runner.execute_async(step, rows, grammar, prompt_plan)

    def _step_inputs(self, config: EngineConfig, max_model_len: int) -> StepInputs:
        return StepInputs(config.max_num_batched_tokens, config.max_num_seqs,
                          math.ceil(max_model_len / config.block_size), self.device, self._workspace)

    def _run_worst_case_step(self, config: EngineConfig) -> None:
        """Runs the step with the most activations (a full token budget of prefill, then logits and
        top-p/top-k sampling for the most rows) through a runner of its own over a scratch KV cache."""
        mc = self.model_config
        tokens = config.max_num_batched_tokens
        step = worst_case_step(tokens, config.max_model_len, config.block_size,
                               num_logit_rows=config.max_num_seqs, vocab_size=mc.vocab_size)
        scratch = allocate_kv_cache(mc.num_layers, step.block_tables.size, mc.num_kv_heads, config.block_size,
                                    mc.head_dim, mc.dtype, self.device)
        inputs = StepInputs(tokens, step.num_seqs, step.max_blocks_per_seq, self.device, self._workspace)
        runner = ModelRunner(self.model, scratch, self.sampler, inputs)
        runner.execute_async(step, worst_case_rows(len(step.logits_indices))).result()
