"""Tensor-parallel layers: each rank holds a shard, as the large engines split them (Megatron-style).

  column-parallel  output rows split (qkv, gate/up, the LM head): each merged block (q, k, v / gate,
                   up) is split on its own, so rank r holds rows [r*n/N, (r+1)*n/N) of every block
                   and its local q, k and v are whole heads; no communication in the forward.
  row-parallel     input columns split (attention output, down, fc2): each rank multiplies its
                   columns, one all-reduce sums the partial products, the bias is added once after.
                   In float32 the sums are float64 until after the all-reduce, with one rank too
                   (layers.Linear's float64_sums): TP = N then gives TP = 1's numbers.
  vocab-parallel   the embedding's rows split by token id: a rank looks up the ids it holds, zeros
                   elsewhere, one all-reduce; the LM head shares the shard (tied or not) and its
                   logits are gathered to the driver, which alone samples.
KV heads split across ranks like q heads; when there are fewer KV heads than ranks each is
replicated to the ranks whose q heads read it.

Each sharded module carries a `shard` (LinearShard) that tells the weight loader (weights.py)
which part of each checkpoint tensor it holds, so a rank reads only its slice. With one rank the
factories return the plain layers, unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from pagedserve.distributed.context import SINGLE, ParallelContext, balanced_split
from pagedserve.models.layers import Embedding, Linear, RMSNorm


@dataclass(frozen=True)
class Part:
    """Rows (dim 0) or columns (dim 1) [start, start + length) of a checkpoint tensor `full` long on `dim`."""

    dim: int
    start: int
    length: int
    full: int


@dataclass(frozen=True)
class Block:
    """One output block of a column-parallel linear: `full` rows in the checkpoint, this rank's
    [start, start + length), held in `capacity` rows (more than length: vocabulary padding)."""

    full: int
    start: int
    length: int
    capacity: int


@dataclass(frozen=True)
class LinearShard:
    dim: int  # 0: column-parallel (output rows), 1: row-parallel (input columns)
    blocks: tuple[Block, ...]

    def part(self, leaf: str, block: int) -> Optional[Part]:
        """The part of the checkpoint tensor of source block `block` this rank loads (None: all of it)."""
        if self.dim == 1 and leaf == "bias":
            return None  # a row-parallel bias is added once, after the all-reduce
        b = self.blocks[block]
        return Part(self.dim, b.start, b.length, b.full)

    def fused_parts(self, leaf: str) -> list[tuple[int, Part]]:
        """(first local row, part) of each block of a checkpoint tensor that stores the blocks fused
        (Phi-3's qkv_proj and gate_up_proj)."""
        if self.dim == 1 or len(self.blocks) == 1:
            part = self.part(leaf, 0)
            return [(0, part)] if part is not None else []
        out, local, offset = [], 0, 0
        total = sum(b.full for b in self.blocks)
        for b in self.blocks:
            out.append((local, Part(0, offset + b.start, b.length, total)))
            local, offset = local + b.capacity, offset + b.full
        return out


class ColumnParallelLinear(Linear):
    """The rank's rows of every output block; forward as a Linear (no communication)."""

    def __init__(self, in_features: int, blocks: Sequence[Block], bias: bool, dtype: torch.dtype,
                 device: torch.device):
        super().__init__(in_features, [b.capacity for b in blocks], bias, dtype, device)
        self.shard = LinearShard(0, tuple(blocks))


class RowParallelLinear(Linear):
    """The rank's input columns (`columns`); the partial products are summed over the ranks (one
    all-reduce) unless `reduce` is off (the MoE block sums its experts and shared expert in one)."""

    def __init__(self, columns: Block, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device,
                 parallel: ParallelContext, reduce: bool = True):
        super().__init__(columns.length, (out_features,), bias, dtype, device, float64_sums=reduce)
        self.shard = LinearShard(1, (columns,))
        self.parallel = parallel
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sums = self.sums_in_float64(x)
        if sums is not None:  # all-reduced as float64 partial sums, rounded once (Linear's float64_sums)
            out = self.parallel.all_reduce(sums).to(x.dtype)
        else:
            out = self.product(x, None)
            if self.reduce:
                self.parallel.all_reduce(out)
        if self.bias is not None and (self.reduce or self.parallel.is_driver):  # once over the ranks
            out += self.bias
        return out


class VocabParallelEmbedding(Embedding):
    """Rows [start, start + per_rank) of the table; the last rank's rows past the vocabulary are zero."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, device: torch.device,
                 parallel: ParallelContext):
        block = vocab_block(num_embeddings, parallel)
        super().__init__(block.capacity, embedding_dim, dtype, device)
        self.shard = LinearShard(0, (block,))
        self.parallel = parallel
        self.first = block.start

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids.long() - self.first
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight).to(self.dtype)  # a bf16-kept table widens
        out.masked_fill_(outside.unsqueeze(1), 0.0)
        return self.parallel.all_reduce(out)


def vocab_block(vocab_size: int, parallel: ParallelContext) -> Block:
    """This rank's share of the vocabulary: ceil(V / N) rows each, the last share padded."""
    per_rank = math.ceil(vocab_size / parallel.world_size)
    start = min(parallel.rank * per_rank, vocab_size)
    return Block(vocab_size, start, min(per_rank, vocab_size - start), per_rank)


def split_block(size: int, parallel: ParallelContext) -> Block:
    """This rank's balanced share of `size` rows (ParallelContext.split)."""
    start, length = parallel.split(size)
    return Block(size, start, length, length)


@dataclass(frozen=True)
class HeadLayout:
    """The attention heads this rank computes: q heads [q_start, q_start + num_heads), KV heads
    [kv_start, kv_start + num_kv_heads) (one replicated KV head when there are fewer than ranks)."""

    num_heads: int
    num_kv_heads: int
    q_start: int
    kv_start: int

    @classmethod
    def of(cls, num_heads: int, num_kv_heads: int, parallel: ParallelContext) -> "HeadLayout":
        """KV heads split over the ranks (balanced), each with its group of q heads; with fewer KV heads
        than ranks, each KV head goes to N / num_kv_heads ranks that split its q heads."""
        world, group = parallel.world_size, num_heads // num_kv_heads
        if num_kv_heads >= world:
            kv_start, local_kv = parallel.split(num_kv_heads)
            return cls(local_kv * group, local_kv, kv_start * group, kv_start)
        if world % num_kv_heads:
            raise ValueError(f"tensor_parallel_size={world} is neither at most nor a multiple of "
                             f"num_key_value_heads={num_kv_heads}: choose one that is")
        sharing = world // num_kv_heads  # ranks per KV head
        kv_head, index = divmod(parallel.rank, sharing)
        q_start, local_q = balanced_split(group, sharing, index)
        if local_q == 0:
            raise ValueError(f"tensor_parallel_size={world} leaves some ranks without attention heads "
                             f"({num_heads} q heads in {num_kv_heads} KV groups): choose a smaller one")
        return cls(local_q, 1, kv_head * group + q_start, kv_head)


class HeadsSliceRMSNorm(RMSNorm):
    """RMSNorm over a vector the ranks hold slices of (OLMo2's q and k, all heads together): each rank's
    sum of squares, one all-reduce, then its slice scaled by its slice of the weight; float32 inside, as
    transformers computes it."""

    def __init__(self, block: Block, eps: float, dtype: torch.dtype, device: torch.device,
                 parallel: ParallelContext):
        super().__init__(block.length, eps, dtype, device)
        self.shard = LinearShard(0, (block,))
        self.full = block.full
        self.parallel = parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        squares = self.parallel.all_reduce(xf.pow(2).sum(dim=-1, keepdim=True))
        return self.weight * (xf * torch.rsqrt(squares / self.full + self.eps)).to(x.dtype)


def heads_norm(num_heads: int, num_kv_heads: int, head_dim: int, kv: bool, eps: float, dtype: torch.dtype,
               device: torch.device, parallel: ParallelContext = SINGLE) -> RMSNorm:
    """The RMSNorm over all q (kv False) or all k heads together, as this rank's heads hold them."""
    heads = num_kv_heads if kv else num_heads
    if not parallel.is_parallel:
        return RMSNorm(heads * head_dim, eps, dtype, device)
    layout = HeadLayout.of(num_heads, num_kv_heads, parallel)
    if kv and num_kv_heads < parallel.world_size:
        raise ValueError(f"a k norm over all KV heads needs each KV head on one rank: tensor_parallel_size="
                         f"{parallel.world_size} replicates the model's {num_kv_heads}; choose at most {num_kv_heads}")
    start, local = (layout.kv_start, layout.num_kv_heads) if kv else (layout.q_start, layout.num_heads)
    return HeadsSliceRMSNorm(Block(heads * head_dim, start * head_dim, local * head_dim, local * head_dim), eps,
                             dtype, device, parallel)


def qkv_linear(hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool, dtype: torch.dtype,
               device: torch.device, parallel: ParallelContext = SINGLE) -> Linear:
    """The merged q/k/v projection over this rank's heads (HeadLayout)."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    if not parallel.is_parallel:
        return Linear(hidden_size, (q_size, kv_size, kv_size), bias, dtype, device)
    heads = HeadLayout.of(num_heads, num_kv_heads, parallel)
    q = Block(q_size, heads.q_start * head_dim, heads.num_heads * head_dim, heads.num_heads * head_dim)
    kv = Block(kv_size, heads.kv_start * head_dim, heads.num_kv_heads * head_dim, heads.num_kv_heads * head_dim)
    return ColumnParallelLinear(hidden_size, (q, kv, kv), bias, dtype, device)


def column_linear(in_features: int, output_sizes: Sequence[int], bias: bool, dtype: torch.dtype,
                  device: torch.device, parallel: ParallelContext = SINGLE) -> Linear:
    """Each output block split evenly over the ranks (gate/up, fc1)."""
    if not parallel.is_parallel:
        return Linear(in_features, output_sizes, bias, dtype, device)
    blocks = [split_block(size, parallel) for size in output_sizes]
    return ColumnParallelLinear(in_features, blocks, bias, dtype, device)


def row_linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device,
               parallel: ParallelContext = SINGLE, reduce: bool = True, columns: Optional[Block] = None) -> Linear:
    """columns: this rank's input columns (default: the balanced split, matching column_linear's)."""
    if not parallel.is_parallel:  # a plain Linear, summing as its shards would (Linear's float64_sums)
        return Linear(in_features, (out_features,), bias, dtype, device, float64_sums=reduce)
    return RowParallelLinear(columns or split_block(in_features, parallel), out_features, bias, dtype, device,
                             parallel, reduce)


def attention_output_linear(num_heads: int, num_kv_heads: int, head_dim: int, hidden_size: int, bias: bool,
                            dtype: torch.dtype, device: torch.device, parallel: ParallelContext = SINGLE) -> Linear:
    """o_proj over the columns of this rank's q heads (HeadLayout)."""
    heads = HeadLayout.of(num_heads, num_kv_heads, parallel)
    columns = Block(num_heads * head_dim, heads.q_start * head_dim, heads.num_heads * head_dim,
                    heads.num_heads * head_dim)
    return row_linear(num_heads * head_dim, hidden_size, bias, dtype, device, parallel, columns=columns)


def embedding(vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device,
              parallel: ParallelContext = SINGLE) -> Embedding:
    if not parallel.is_parallel:
        return Embedding(vocab_size, hidden_size, dtype, device)
    return VocabParallelEmbedding(vocab_size, hidden_size, dtype, device, parallel)


def lm_head_linear(hidden_size: int, vocab_size: int, bias: bool, dtype: torch.dtype, device: torch.device,
                   parallel: ParallelContext = SINGLE) -> Linear:
    """An untied LM head over the embedding's vocabulary shard (vocab_block)."""
    if not parallel.is_parallel:
        return Linear(hidden_size, (vocab_size,), bias, dtype, device)
    return ColumnParallelLinear(hidden_size, (vocab_block(vocab_size, parallel),), bias, dtype, device)


__all__ = ["Block", "ColumnParallelLinear", "HeadLayout", "LinearShard", "Part", "RowParallelLinear",
           "VocabParallelEmbedding", "attention_output_linear", "column_linear", "embedding", "lm_head_linear",
           "qkv_linear", "row_linear", "split_block", "vocab_block"]
