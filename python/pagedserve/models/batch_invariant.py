"""Batch-invariant GPU numerics (EngineConfig.batch_invariant): a request's tokens and logprobs bit-identical
whether it runs alone or among any other requests.

Two things on a GPU make a row's result depend on its batch. cuBLAS picks its kernel (tile shape, split-K) by
the product's shape, so the same row is summed in another order when the batch has another size; and the
decode attention splits contexts into finer partitions when few rows run. Here every matrix product runs in
slices of exactly SLICE_ROWS rows (the last one zero-padded), so one shape, one kernel and one summation order
serve every row of every batch; rows of one product never mix. The attention keeps 512-token partitions
whatever the batch (ops.paged_attention's fixed_split), and the RMS norms sum a row in an order fixed by its
width (their default mirrors torch's reduction, whose order depends on the number of rows). Rope, activations
and the sampler already work row by row. The CPU is batch-invariant as it is (tests_py/test_batch_invariance.py).

The cost: a decode step of B rows streams the weights once per ceil(B / 128) slices, and a batch smaller than
128 pays for 128 rows of arithmetic (bench/perf/decode_kernels.py --option batch_invariant=true measures it).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pagedserve.models.linear_kernels import LinearKernel

SLICE_ROWS = 128


class FixedSliceProduct(LinearKernel):
    """A LinearKernel for CUDA: x W^T + b in SLICE_ROWS-row slices of x."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        rows = x.shape[0]
        padded = -(-rows // SLICE_ROWS) * SLICE_ROWS
        if padded != rows:
            x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
        out = torch.empty(padded, self.out_features, dtype=x.dtype, device=x.device)
        weight_t = self.weight.t()
        for start in range(0, padded, SLICE_ROWS):
            torch.matmul(x[start:start + SLICE_ROWS], weight_t, out=out[start:start + SLICE_ROWS])
        out = out[:rows]
        return out if bias is None else out + bias  # elementwise: the same for every row

    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


def make_batch_invariant(model: nn.Module) -> None:
    """Routes every product of a CUDA model (its linears and the LM head) through FixedSliceProduct and fixes
    every attention layer's decode split. Mixture-of-experts products (grouped_linear) tile rows by expert
    without splitting K and are left as they are."""
    from pagedserve.models.layers import Linear, PagedAttention, RMSNorm

    model.use_lm_head_kernel(FixedSliceProduct(model.lm_head_weight()))  # the head (a Linear, or the embeddings)
    for module in list(model.modules()):
        if isinstance(module, Linear) and module.kernel is None and module.weight is not None:
            module.use_kernel(FixedSliceProduct(module.weight))
        elif isinstance(module, PagedAttention):
            module.use_fixed_split()
        elif isinstance(module, RMSNorm):
            module.use_fixed_order()
