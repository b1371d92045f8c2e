"""Building blocks shared by the decoder models.

Dense math is torch (``F.linear``); everything with a custom memory layout or
a fusion opportunity goes through ``pagedserve.ops`` (CPU reference ops, or the
CUDA kernels for CUDA tensors). Parameters are allocated uninitialised on the
target device in the target dtype; ``pagedserve.models.weights`` fills them. Nothing
here branches on tensor values, so a forward can be captured in a CUDA graph. The MLP
activations are in activations.py.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve import ops
from pagedserve.models.attention_metadata import AttentionMetadata
from pagedserve.models.linear_kernels import LinearKernel, PackedBf16, PackedBf16Rows
from pagedserve.models.rope import is_long_rope, rope_table
from pagedserve.models.small_batch import small_batch_applies, small_batch_product


def _empty_parameter(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T + b. ``output_sizes`` lists the row blocks of a merged projection (see weights.py).

    On a CPU the weight may be replaced after loading by a kernel that keeps it in another format
    (linear_kernels.py: bf16 tiles, see cpu_weight_packing.py); the forward then runs the kernel.

    float64_sums: the products tensor parallelism splits over their input (parallel_layers.row_linear) form
    every sum in float64 where their arithmetic is float32, at every rank count, and round once to float32
    after the sums are complete (after the all-reduce on several ranks): the float32 rounding of one sum and
    of a sum of partial sums then agree, so TP = N gives TP = 1's numbers (cpp/ops/packed_linear_float64.cc
    says why). A float32 model's other products, and every product in 16-bit or quantized formats, sum as
    their kernels do.
    """

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool, dtype: torch.dtype,
                 device: torch.device, float64_sums: bool = False):
        super().__init__()
        self.output_sizes = tuple(output_sizes)
        self.out_features = sum(self.output_sizes)
        self.weight = _empty_parameter((self.out_features, in_features), dtype, device)
        self.bias = _empty_parameter((self.out_features,), dtype, device) if bias else None
        self.kernel: Optional[LinearKernel] = None
        self.float64_sums = float64_sums and dtype == torch.float32

    def use_kernel(self, kernel: LinearKernel) -> None:
        """Keeps the weight only in the kernel's format from now on."""
        self.kernel = kernel
        self.weight = None

    def pack(self) -> None:
        """Keeps the weight only as bf16 tiles (rounded if it is not exactly bf16)."""
        self.use_kernel(PackedBf16(self.weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sums = self.sums_in_float64(x)
        if sums is not None:
            out = sums.to(x.dtype)
            return out if self.bias is None else out.add_(self.bias)
        return self.product(x, self.bias)

    def product(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """x W^T + bias as the weight's format computes it (its kernel, the small-batch kernel, or torch)."""
        if self.kernel is not None:
            return self.kernel(x, bias)
        out = small_batch_product(x, self.weight, bias)
        return F.linear(x, self.weight, bias) if out is None else out

    def sums_in_float64(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """x W^T as float64 sums without the bias where float64_sums applies (see the class), else None."""
        if not self.float64_sums:
            return None
        if self.kernel is not None:
            return self.kernel.float64_sums(x)
        return F.linear(x.double(), self.weight.double())

    def small_batch_operands(self, x: torch.Tensor) -> Optional[tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """(weight, bias) for a fused small-batch kernel taking x W^T + b where one applies
        (small_batch_applies), else None."""
        if self.kernel is not None or not small_batch_applies(x, self.weight, self.bias):
            return None
        return self.weight, self.bias

    def gated_forward(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """silu(gate) * up of a merged [gate; up] projection in one kernel where small_batch_product
        applies, else None (the caller runs forward, then the activation)."""
        if self.kernel is not None:
            return None
        return small_batch_product(x, self.weight, self.bias, gated=True)


_ROWS_PER_CHECK = 4096  # keep_bf16_if_exact: 9 MiB of float32 rows at a time for a 576-wide table


class Embedding(nn.Module):
    """Rows of the table in the model's dtype. The table may be kept narrower (keep_bf16_if_exact:
    a bf16 checkpoint under a float32 model, 108 MiB less for SmolLM2's 49152 x 576); its rows
    are then widened as they are gathered, which is exact."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.dtype = dtype
        self.weight = _empty_parameter((num_embeddings, embedding_dim), dtype, device)
        self.lookup: Optional[Callable[[torch.Tensor], torch.Tensor]] = None

    def use_lookup(self, lookup: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Keeps the table only in the lookup's format (GGUF blocks: gguf_linear.GgufRows) from now on."""
        self.lookup = lookup
        self.weight = None

    def keep_bf16_if_exact(self) -> bool:
        """Stores a float32 table as bf16 when every entry is a bf16 value; returns whether it did.
        Whoever reads the table as a matrix (a tied LM head) must hold its own copy first."""
        if self.weight.dtype != torch.float32:
            return False
        narrow = self.weight.to(torch.bfloat16)
        # Compared a block of rows at a time: widening the whole table at once would cost its float32 size again.
        for start in range(0, narrow.shape[0], _ROWS_PER_CHECK):
            rows = slice(start, start + _ROWS_PER_CHECK)
            if not torch.equal(narrow[rows].to(torch.float32), self.weight[rows]):
                return False
        self.weight = nn.Parameter(narrow, requires_grad=False)
        return True

    def read_from_tiles(self, packed: torch.Tensor) -> bool:
        """Drops the table and gathers rows from ``packed``, the bf16 tiles of this very table (a tied LM
        head's), where that is exact: a float32 model whose table holds only bf16 values (the tiles then
        hold the same values; SmolLM2-135M: 54 MiB held once instead of twice). Returns whether it did."""
        if self.weight is None or self.dtype != torch.float32 or self.weight.device.type != "cpu":
            return False
        if self.weight.dtype != torch.bfloat16 and not self.keep_bf16_if_exact():
            return False
        self.use_lookup(PackedBf16Rows(packed, *self.weight.shape))
        return True

    def widen(self) -> None:
        """Back to the model's dtype after keep_bf16_if_exact (exact), for a caller that reads it as a matrix."""
        if self.weight is not None and self.weight.dtype != self.dtype:
            self.weight = nn.Parameter(self.weight.to(self.dtype), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.lookup is not None:
            return self.lookup(input_ids)
        rows = F.embedding(input_ids, self.weight)
        return rows if rows.dtype == self.dtype else rows.to(self.dtype)


class RMSNorm(nn.Module):
    """x / rms(x) * weight; Gemma's variant (``offset`` 1) scales by (1 + weight), computed in float32
    once per call as transformers does (the stored weight stays the checkpoint's)."""

    is_norm = True  # dummy init sets norm weights to 1

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device, offset: float = 0.0):
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = _empty_parameter((size,), dtype, device)
        self.fixed_order = False  # sum rows in an order fixed by `size` (batch_invariant.py)

    def use_fixed_order(self) -> None:
        """Rows are summed in an order fixed by the width, not torch's for the batch (batch-invariant)."""
        self.fixed_order = True

    def scale(self) -> torch.Tensor:
        """What the normalized values are multiplied by: the weight, or (offset 1) 1 + weight in the dtype."""
        if not self.offset:
            return self.weight
        return (self.weight.float() + self.offset).to(self.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalises the rows of a contiguous [N, size] tensor into a new tensor."""
        out = torch.empty_like(x)
        ops.rms_norm(out, x, self.scale(), self.eps, self.fixed_order)
        return out

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual += x, then x = rms_norm(residual), both in place; returns x."""
        ops.fused_add_rms_norm(x, residual, self.scale(), self.eps, self.fixed_order)
        return x


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias (Phi-2), in torch; the same two calls as RMSNorm."""

    is_norm = True

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.eps = eps
        self.weight = _empty_parameter((size,), dtype, device)
        self.bias = _empty_parameter((size,), dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual += x in place; returns the normalised residual."""
        return self(residual.add_(x))


class RotaryEmbedding(nn.Module):
    """Half-rotation rope over the first rotary_dim dims of each head, from a float32 cos/sin table built
    once for every position (pagedserve.models.rope). Longrope tables hold short rows then long rows;
    a token takes the long ones when max(its prompt's length, its position + 1) exceeds the original
    context: transformers' rule for one forward over the prompt and for each decode step (see rope.py),
    and it holds however the prompt is chunked or recomputed."""

    def __init__(self, rotary_dim: int, head_dim: int, max_position: int, theta: float, scaling: Optional[dict],
                 device: torch.device):
        super().__init__()
        self.max_position = max_position
        self.long_threshold = int(scaling["original_max_position_embeddings"]) if is_long_rope(scaling) else 0
        table = rope_table(max_position, rotary_dim, theta, scaling, head_dim)
        self.register_buffer("cos_sin_cache", table.to(device), persistent=False)

    def table_positions(self, positions: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        """The table row of each token: its position, offset into the long rows where they apply."""
        if not self.long_threshold:
            return positions
        tokens = torch.arange(positions.shape[0], device=positions.device, dtype=attn.query_start_loc.dtype)
        rows = torch.searchsorted(attn.query_start_loc[1:].contiguous(), tokens, right=True)
        rows = rows.clamp_(max=attn.seq_lens.shape[0] - 1)  # padding tokens past the last row
        row_lengths = attn.seq_lens if attn.prompt_lens is None else attn.prompt_lens
        is_long = torch.maximum(row_lengths.long()[rows], positions.long() + 1) > self.long_threshold
        return (positions.long() + is_long.long() * self.max_position).to(torch.int32)

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> None:
        """Rotates query [T, Hq, D] and key [T, Hkv, D] in place; positions [T] int32 (table rows)."""
        ops.rotary_embedding(positions, query, key, self.cos_sin_cache)


class PagedAttention(nn.Module):
    """Writes this step's keys/values into the paged cache, then attends through the block tables.

    scale: the softmax scale (default head_dim ** -0.5); window: attend to the last ``window``
    positions only (transformers' sliding window, 0 = all); softcap: scores become
    softcap * tanh(scores / softcap) (Gemma 2, 0 = off).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: Optional[float] = None,
                 window: int = 0, softcap: float = 0.0):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.extra: dict[str, object] = {}
        if window:
            self.extra["window"] = int(window)
        if softcap:
            self.extra["softcap"] = float(softcap)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_kv_cache: torch.Tensor,
                attn: AttentionMetadata) -> torch.Tensor:
        """query [T, Hq, D], key/value [T, Hkv, D], layer_kv_cache [2, N, Hkv, B, D] -> [T, Hq, D]."""
        ops.reshape_and_cache(key, value, layer_kv_cache[0], layer_kv_cache[1], attn.slot_mapping)
        return self.attend(query, layer_kv_cache, attn)

    def use_fixed_split(self) -> None:
        """Decode rows split their context by the context alone (batch-invariant results, batch_invariant.py)."""
        self.extra["fixed_split"] = True

    def attend(self, query: torch.Tensor, layer_kv_cache: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        """Attention of query [T, Hq, D] over the cache, this step's keys and values already in it."""
        key_cache, value_cache = layer_kv_cache[0], layer_kv_cache[1]
        out = torch.empty_like(query)
        ops.paged_attention(out, query, key_cache, value_cache, attn.block_tables, attn.query_start_loc,
                            attn.seq_lens, self.scale, attn.max_query_len, attn.max_seq_len,
                            num_decodes=attn.num_decodes, workspace=attn.workspace, decode_order=attn.decode_order,
                            **self.extra)
        return out
