"""Worker: what lives on the model's device, built once and whole.

The model (weights loaded, packed for the CPU as they load), the
sampler, the KV cache sized by a KVPlan, and the ModelRunner that executes
steps over them. The engine reads `kv_plan` to size its scheduler; it never
reaches further in than `execute_async`.

Tensor-parallel (`parallel`, a ParallelContext), every rank builds its Worker
alike over its shard: the model's slices, the KV cache of its KV heads with the
same number of blocks (on a GPU, the smallest any rank's memory allows), and a
runner that executes every step; only the driver's samples (distributed/).
"""

from __future__ import annotations

import logging
import math
from typing import Sequence

import torch

from pagedserve import ops
from pagedserve.distributed.context import SINGLE, ParallelContext
from pagedserve.engine_config import EngineConfig
from pagedserve.models import build_model
from pagedserve.models.batch_invariant import make_batch_invariant
from pagedserve.models.cpu_weight_packing import StreamedPacking
from pagedserve.models.fused_layers import fuse_decoder_layers
from pagedserve.models.linear_kernels import has_quantized_weights
from pagedserve.models.model_config import ModelConfig
from pagedserve.models.parallel_layers import HeadLayout
from pagedserve.sample.sampler import PendingSamples, Sampler
from pagedserve.worker.heap_trim import HeapTrimmer
from pagedserve.worker.kv_cache import allocate_kv_cache, bytes_per_block, kv_cache_dtype
from pagedserve.worker.memory_budget import KVPlan, kv_cache_budget_bytes, plan_kv_cache
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.prefill_warmup import prefill_warmup_sizes, warm_up_prefills
from pagedserve.worker.step_inputs import StepInputs
from pagedserve.worker.worst_case_step import worst_case_rows, worst_case_step

logger = logging.getLogger("pagedserve")


class Worker:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, eos_token_ids: Sequence[int],
                 parallel: ParallelContext = SINGLE):
        """config: resolved (engine_config.resolve_defaults); model_config: on the device to run on;
        parallel: this rank's place in a tensor-parallel group."""
        mc, device = model_config, model_config.device
        self.device = device
        self.model_config = mc
        self.parallel = parallel
        self.num_kv_heads = HeadLayout.of(mc.num_heads, mc.num_kv_heads, parallel).num_kv_heads  # this rank's
        baseline_bytes = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        # On a CPU each linear goes into its kernel as soon as it is loaded: the float32 model never exists whole.
        packing = StreamedPacking(mc.dtype, config.cpu_weight_dtype, config.cpu_precision,
                                  config.quantization) if device.type == "cpu" else None
        self.model = build_model(mc, device, load_format=config.load_format, seed=config.seed, parallel=parallel,
                                 on_module_loaded=None if packing is None else self._packing_as_loaded(packing))
        packed = packing is not None and packing.finish(self.model)
        if packed and config.cpu_fused_layers:
            fuse_decoder_layers(self.model)
        if config.batch_invariant and device.type == "cuda":
            make_batch_invariant(self.model)
        self.sampler = Sampler(device, mc.vocab_size, eos_token_ids, seed=config.seed)
        self._workspace = ops.paged_attention_workspace(config.max_num_seqs, mc.num_heads, mc.head_dim,
                                                        config.max_model_len, device)
        kv_dtype = kv_cache_dtype(config.kv_cache_dtype, mc.dtype, device.type, config.cpu_precision,
                                  has_quantized_weights(self.model))
        per_block = bytes_per_block(mc.num_layers, self.num_kv_heads, config.block_size, mc.head_dim, kv_dtype)
        per_block = parallel.max_int(per_block, device)  # ranks may hold unequal KV heads: plan the same blocks
        self.kv_plan: KVPlan = plan_kv_cache(
            config, mc.max_position_embeddings, per_block,
            lambda: parallel.min_int(kv_cache_budget_bytes(lambda: self._run_worst_case_step(config, kv_dtype),
                                                           config.gpu_memory_utilization, device, baseline_bytes),
                                     device), mc.kv_window, dtype=kv_dtype)
        plan = self.kv_plan
        kv_cache = allocate_kv_cache(mc.num_layers, plan.num_blocks, self.num_kv_heads, plan.block_size, mc.head_dim,
                                     plan.dtype, device)
        inputs = self._step_inputs(config, plan.max_model_len)
        graphs = None
        if device.type == "cuda" and not config.enforce_eager and getattr(self.model, "supports_cuda_graphs", True):
            from pagedserve.worker.cuda_graphs import PREFILL_GRAPH_TOKENS, CudaGraphs
            # Prefill graphs on one GPU only: captured over a tensor-parallel group's collectives they are
            # not yet run on several GPUs (decode graphs are).
            prefill_tokens = 0 if parallel.is_parallel else PREFILL_GRAPH_TOKENS
            graphs = CudaGraphs(self.model, kv_cache, inputs, config.max_num_seqs, plan.max_model_len,
                                prefill_tokens=prefill_tokens)
        # Packed weights: every matrix product runs in our ops' pool; torch keeps only light work.
        self.runner = ModelRunner(self.model, kv_cache, self.sampler, inputs, graphs=graphs,
                                  torch_threads=1 if packed else None)
        self.runner.heap.trim()  # what loading and packing freed
        if device.type == "cuda":  # through a sampler of its own: the engine's seeded streams stay untouched
            warm_up_prefills(ModelRunner(self.model, kv_cache, Sampler(device, mc.vocab_size, eos_token_ids), inputs),
                             prefill_warmup_sizes(config.max_num_batched_tokens, plan.max_model_len,
                                                  config.max_num_seqs, plan.num_blocks, plan.block_size),
                             config.max_num_seqs, plan.block_size, mc.vocab_size)
        logger.info("model %s on %s (%s): %d KV blocks of %d tokens (%.2f GiB, %s), max_model_len %d",
                    mc.model_dir.name if mc.model_dir else mc.architecture, device, mc.dtype, plan.num_blocks,
                    plan.block_size, kv_cache.numel() * kv_cache.element_size() / 2**30, plan.dtype,
                    plan.max_model_len)

    @staticmethod
    def _packing_as_loaded(packing: StreamedPacking):
        """The loader's hook: each module packed, then the heap trimmed, since the float32 weight it freed
        sits in the middle of the heap, where glibc keeps it resident (SmolLM2-135M: ~80 MiB by the end)."""
        heap = HeapTrimmer()

        def loaded(model, module) -> None:
            packing(model, module)
            heap.trim()
        return loaded

    def execute_async(self, step, rows, grammar=None, prompt_plan=None, last_ids=None) -> PendingSamples:
        return self.runner.execute_async(step, rows, grammar, prompt_plan, last_ids)

    def check_health(self) -> None:
        """Raises EngineDeadError when the worker cannot run another step (a single process always can)."""

    def close(self) -> None:
        """Destroys the captured CUDA graphs, before a tensor-parallel group's communicators they captured
        are destroyed; the rest of the memory goes with the object."""
        if self.runner.graphs is not None:
            self.runner.graphs.release()

    def abandon_graphs(self) -> None:
        """Destroys the captured CUDA graphs without waiting for the device (a tensor-parallel peer died
        while one ran: see CudaGraphs.abandon); any thread may call it."""
        if self.runner.graphs is not None:
            self.runner.graphs.abandon()

    def _step_inputs(self, config: EngineConfig, max_model_len: int) -> StepInputs:
        return StepInputs(config.max_num_batched_tokens, config.max_num_seqs,
                          math.ceil(max_model_len / config.block_size), self.device, self._workspace)

    def _run_worst_case_step(self, config: EngineConfig, kv_dtype: torch.dtype) -> None:
        """Runs the step with the most activations (a full token budget of prefill, then logits and
        top-p/top-k sampling for the most rows) through a runner of its own over a scratch KV cache."""
        mc = self.model_config
        tokens = config.max_num_batched_tokens
        step = worst_case_step(tokens, config.max_model_len, config.block_size,
                               num_logit_rows=config.max_num_seqs, vocab_size=mc.vocab_size)
        scratch = allocate_kv_cache(mc.num_layers, step.block_tables.size, self.num_kv_heads, config.block_size,
                                    mc.head_dim, kv_dtype, self.device)
        inputs = StepInputs(tokens, step.num_seqs, step.max_blocks_per_seq, self.device, self._workspace)
        runner = ModelRunner(self.model, scratch, self.sampler, inputs)
        pending = runner.execute_async(step, worst_case_rows(len(step.logits_indices)))
        if pending is not None:  # None: a tensor-parallel rank other than the driver, which samples nothing
            pending.result()
