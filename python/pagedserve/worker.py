"""Worker: everything that lives on the model's device, built once.

Loads the model and tokenizer, sizes and allocates the KV cache from the
memory budget, and owns the scheduler (sized to that cache), the sampler and
the model runner.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

from pagedserve import _core, ops
from pagedserve.attention_metadata import AttentionMetadata
from pagedserve.config import ModelConfig
from pagedserve.engine_config import EngineConfig
from pagedserve.kv_cache import allocate_kv_cache, bytes_per_block
from pagedserve.model_runner import ModelRunner
from pagedserve.models import build_model
from pagedserve.models.cpu_weight_packing import pack_cpu_weights
from pagedserve.sampler import Sampler, SamplingRow
from pagedserve.sampling_params import SamplingParams
from pagedserve.tokenizer import encode_prompt, eos_token_ids, load_tokenizer

logger = logging.getLogger("pagedserve")

CPU_KV_CACHE_GB = 1.0


def resolve_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() and _core.has_cuda else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for but torch sees no CUDA GPU")
        if not _core.has_cuda:
            raise ValueError("device='cuda' needs the extension built with CUDA: "
                             "pip install -C cmake.define.USE_CUDA=ON .")
    return device


def resolve_model_dir(model: str | None) -> Path:
    if model is None:
        from pagedserve.default_model import default_model_dir
        return default_model_dir()
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"{model!r} is not a local model directory with a config.json "
                         "(pagedserve never downloads from a model hub)")
    return path


class Worker:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = resolve_device(config.device)
        self.model_dir = resolve_model_dir(config.model)
        self.model_config = ModelConfig.from_model_dir(self.model_dir, dtype=config.dtype, device=self.device)
        mc = self.model_config
        has_tokenizer = any((self.model_dir / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))
        self.tokenizer = load_tokenizer(self.model_dir) if has_tokenizer else None
        self._baseline_bytes = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        self.model = build_model(mc, self.device, load_format=config.load_format, seed=config.seed)
        packed = self.device.type == "cpu" and pack_cpu_weights(self.model, config.cpu_weight_dtype)

        cuda = self.device.type == "cuda"
        self.max_num_seqs = config.max_num_seqs or (256 if cuda else 64)
        self.max_num_batched_tokens = config.max_num_batched_tokens or max(8192 if cuda else 2048,
                                                                           self.max_num_seqs)
        self.block_size = config.block_size
        max_model_len = config.max_model_len or mc.max_position_embeddings
        eos = eos_token_ids(self.tokenizer, mc.eos_token_ids) if self.tokenizer is not None else list(mc.eos_token_ids)
        self.eos_token_ids = eos
        self.sampler = Sampler(self.device, mc.vocab_size, eos, seed=config.seed)
        self.workspace = ops.paged_attention_workspace(self.max_num_seqs, mc.num_heads, mc.head_dim,
                                                       max_model_len, self.device)
        num_blocks = self._num_kv_blocks(max_model_len)
        capacity = num_blocks * self.block_size
        if max_model_len > capacity:
            if config.max_model_len is not None:
                raise ValueError(f"max_model_len={max_model_len} needs {math.ceil(max_model_len / self.block_size)} "
                                 f"KV blocks, the cache holds {num_blocks}: raise the KV memory or lower "
                                 "max_model_len")
            logger.warning("lowering max_model_len from %d to %d to fit the KV cache", max_model_len, capacity)
            max_model_len = capacity
        self.max_model_len = max_model_len
        self.num_kv_blocks = num_blocks
        self.kv_cache = allocate_kv_cache(mc.num_layers, num_blocks, mc.num_kv_heads,
                                          self.block_size, mc.head_dim, mc.dtype, self.device)
        self.scheduler = _core.Scheduler(_core.SchedulerConfig(
            num_blocks=num_blocks, block_size=self.block_size, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=max_model_len,
            enable_prefix_caching=config.enable_prefix_caching, eos_token_ids=eos))
        self.runner = ModelRunner(self.model, self.kv_cache, self.sampler,
                                  max_num_tokens=self.max_num_batched_tokens, max_num_seqs=self.max_num_seqs,
                                  max_blocks_per_seq=math.ceil(max_model_len / self.block_size))
        self.runner.workspace = self.workspace
        if packed:  # every matrix product runs in our ops' pool; torch keeps only light work
            self.runner.torch_threads = 1
        if cuda and not config.enforce_eager:
            from pagedserve.cuda_graphs import CudaGraphs
            self.runner.graphs = CudaGraphs(self.model, self.kv_cache, self.runner.inputs, self.max_num_seqs,
                                            max_model_len, self.workspace)
        logger.info("model %s on %s (%s): %d KV blocks of %d tokens (%.2f GiB), max_model_len %d",
                    self.model_dir.name, self.device, mc.dtype, num_blocks, self.block_size,
                    self.kv_cache.numel() * self.kv_cache.element_size() / 2**30, max_model_len)

    def _num_kv_blocks(self, max_model_len: int) -> int:
        if self.config.num_kv_blocks:
            return self.config.num_kv_blocks
        mc = self.model_config
        per_block = bytes_per_block(mc.num_layers, mc.num_kv_heads, self.block_size, mc.head_dim,
                                    mc.dtype)
        if self.config.kv_cache_memory_gb is not None:
            budget = self.config.kv_cache_memory_gb * 2**30
        elif self.device.type == "cuda":
            from pagedserve.gpu_memory import kv_cache_budget_bytes
            budget = kv_cache_budget_bytes(lambda: self._run_worst_case_step(max_model_len),
                                           self.config.gpu_memory_utilization, self.device, self._baseline_bytes)
            return max(1, int(budget // per_block))  # a GPU keeps every spare block for the prefix cache
        else:
            budget = CPU_KV_CACHE_GB * 2**30
        # No point holding more than every sequence at full length needs.
        useful = self.max_num_seqs * math.ceil(max_model_len / self.block_size)
        return max(1, min(int(budget // per_block), useful))

    @torch.inference_mode()
    def _run_worst_case_step(self, max_model_len: int) -> None:
        """The step with the most activations: a full token budget of prefill,
        then logits and sampling (top-p/top-k) for the most rows."""
        mc, bs, dev = self.model_config, self.block_size, self.device
        tokens = self.max_num_batched_tokens
        per_seq = min(tokens, max_model_len)
        num_seqs = math.ceil(tokens / per_seq)
        blocks_per_seq = math.ceil(per_seq / bs)
        kv = allocate_kv_cache(mc.num_layers, num_seqs * blocks_per_seq, mc.num_kv_heads, bs, mc.head_dim,
                               mc.dtype, dev)
        lens = [min(per_seq, tokens - i * per_seq) for i in range(num_seqs)]
        positions = torch.cat([torch.arange(n, dtype=torch.int32) for n in lens]).to(dev)
        block_tables = torch.arange(num_seqs * blocks_per_seq, dtype=torch.int32, device=dev).view(num_seqs, -1)
        slots = torch.cat([block_tables[i].repeat_interleave(bs)[:n] * bs + torch.arange(n, device=dev) % bs
                           for i, n in enumerate(lens)]).to(torch.int32)
        qsl = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(dev)
        attn = AttentionMetadata(slot_mapping=slots, block_tables=block_tables, query_start_loc=qsl,
                                 seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev), max_query_len=per_seq,
                                 max_seq_len=per_seq, num_decodes=0, workspace=self.workspace)
        input_ids = torch.randint(0, mc.vocab_size, (tokens,), dtype=torch.int32, device=dev)
        hidden = self.model.forward(input_ids, positions, attn, kv)
        rows = min(self.max_num_seqs, tokens)
        logits = self.model.compute_logits(hidden[:rows])
        params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, repetition_penalty=1.1)
        self.sampler(logits, [SamplingRow(params, 1, [1, 2, 3], [4], None)] * rows)

    def encode(self, text: str) -> list[int]:
        return encode_prompt(self.tokenizer, text)

    def execute_async(self, step, rows):
        return self.runner.execute_async(step, rows)
