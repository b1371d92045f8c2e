"""Mixture-of-Experts feed-forward: a router picks top-k experts per token; the experts run as grouped GEMMs.

Routing (the order transformers uses for Mixtral, Qwen2-MoE and Qwen3-MoE):
router logits in the model dtype -> softmax in float32 -> top-k -> divided by
their sum when the family renormalises (Mixtral always; the Qwen MoEs when
``norm_topk_prob``). The (token, expert) pairs are then sorted by expert, so
each expert's tokens are one contiguous slice of a gathered copy of the
hidden rows; every expert runs gate_up -> SiLU-and-mul -> down over its slice
(``grouped_expert_products``: one ``ops.grouped_linear`` per projection on
CUDA when the extension has it, else a loop over the experts that got tokens),
and the routing-weighted rows are scatter-added back per token in float32.

Expert weights live as 3D parameters, ``gate_up_proj`` [E, 2I, H] (gate rows
first) and ``down_proj`` [E, H, I], the layout transformers 5 holds in memory.
They load from that fused layout or from the per-expert tensors checkpoints
store (``experts.{e}.gate_proj/up_proj/down_proj`` or Mixtral's ``w1/w3/w2``).
On a CPU they can be packed per expert into the bf16 tiles of
``ops.packed_linear`` like every dense Linear (cpu_weight_packing.py).

Tensor-parallel: the experts are split across the ranks (rank r holds experts
[r*E/N, (r+1)*E/N), each whole); the router and the shared expert's gate are
replicated, so every rank routes every token alike. A rank runs the (token,
expert) pairs of its own experts; the pairs of other ranks' experts sort after
them and add nothing. The shared expert is column/row split. The block's output,
experts and shared expert together, is summed over the ranks in one all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve import ops
from pagedserve.distributed.context import SINGLE, ParallelContext
from pagedserve.models.activations import SiluAndMul
from pagedserve.models.layers import Linear
from pagedserve.models.moe_config import MIXTRAL_EXPERT_NAMES, QWEN_EXPERT_NAMES, MoeConfig
from pagedserve.models.parallel_layers import Part, column_linear, row_linear
from pagedserve.models.weights import require_shape



def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def use_grouped_linear(x: torch.Tensor) -> bool:
    """The switch to the device-side grouped GEMM: CUDA tensors and an extension that has the op."""
    return x.is_cuda and hasattr(ops, "grouped_linear")


@dataclass
class PackedExperts:
    """Per-expert bf16 tiles (ops.pack_linear_weight) of gate_up [2I, H] and down [H, I]."""

    gate_up: list[torch.Tensor]
    down: list[torch.Tensor]
    intermediate_size: int


def grouped_expert_products(x: torch.Tensor, gate_up: Optional[torch.Tensor], down: Optional[torch.Tensor],
                            expert_offsets: torch.Tensor, packed: Optional[PackedExperts] = None) -> torch.Tensor:
    """Each expert's MLP over its rows: x [N, H] sorted by expert, rows offsets[e]:offsets[e+1] for expert e.

    gate_up [E, 2I, H], down [E, H, I]; expert_offsets [E+1] int32; packed: per-expert bf16 tiles
    (CPU) used instead of gate_up/down. Returns [N, H] in x's dtype.
    """
    num_rows = x.shape[0]
    if packed is None:
        assert gate_up is not None and down is not None
        num_experts, two_inter, hidden = gate_up.shape
    else:
        num_experts, hidden, two_inter = len(packed.gate_up), x.shape[1], 2 * packed.intermediate_size
    out = torch.empty(num_rows, hidden, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    if packed is None and use_grouped_linear(x):
        offsets = expert_offsets.to(device=x.device, dtype=torch.int32)
        gate_up_out = torch.empty(num_rows, two_inter, dtype=x.dtype, device=x.device)
        ops.grouped_linear(gate_up_out, x, gate_up, offsets)
        act = torch.empty(num_rows, two_inter // 2, dtype=x.dtype, device=x.device)
        ops.silu_and_mul(act, gate_up_out)
        ops.grouped_linear(out, act, down, offsets)
        return out
    bounds = expert_offsets.tolist()  # one host sync; the loop visits only experts that got tokens
    for expert in range(num_experts):
        start, end = bounds[expert], bounds[expert + 1]
        if start == end:
            continue
        rows = x[start:end]
        if packed is None:
            gate_up_out = F.linear(rows, gate_up[expert])
        else:
            gate_up_out = torch.empty(end - start, two_inter, dtype=x.dtype)
            ops.packed_linear(gate_up_out, rows, packed.gate_up[expert])
        act = torch.empty(end - start, two_inter // 2, dtype=x.dtype, device=x.device)
        ops.silu_and_mul(act, gate_up_out)
        if packed is None:
            out[start:end] = F.linear(act, down[expert])
        else:
            ops.packed_linear(out[start:end], act, packed.down[expert])
    return out


class FusedExperts(nn.Module):
    """E gated-SiLU MLPs as two 3D weights; forward(hidden, routing weights, expert ids) -> [T, H]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 device: torch.device, checkpoint_names: tuple[str, str, str] = QWEN_EXPERT_NAMES,
                 parallel: ParallelContext = SINGLE):
        """num_experts: all of the model's; this rank holds experts [first_expert, first_expert + local)."""
        super().__init__()
        self.total_experts = num_experts
        self.first_expert, num_experts = parallel.split(num_experts)
        self.num_experts = num_experts  # this rank's
        self.intermediate_size = intermediate_size
        self.checkpoint_names = checkpoint_names
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype,
                                                     device=device), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype,
                                                  device=device), requires_grad=False)
        self.packed: Optional[PackedExperts] = None

    def packable_matrices(self) -> list[tuple[str, torch.Tensor]]:
        return [("experts.gate_up_proj", self.gate_up_proj), ("experts.down_proj", self.down_proj)]

    def pack(self) -> None:
        """Keeps each expert's two matrices only as bf16 tiles (see cpu_weight_packing.py)."""
        self.packed = PackedExperts([ops.pack_linear_weight(w) for w in self.gate_up_proj],
                                    [ops.pack_linear_weight(w) for w in self.down_proj], self.intermediate_size)
        self.gate_up_proj = None
        self.down_proj = None

    def forward(self, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """hidden [T, H]; weights [T, k] float32; ids [T, k] -> sum_k weights * expert_ids(hidden), [T, H]."""
        num_tokens, top_k = ids.shape
        flat_ids = ids.reshape(-1)
        local = self.num_experts != self.total_experts
        if local:  # other ranks' experts: one bucket sorted last, which no expert reads
            flat_ids = flat_ids - self.first_expert
            flat_ids = torch.where((flat_ids >= 0) & (flat_ids < self.num_experts), flat_ids, self.num_experts)
        order = torch.argsort(flat_ids, stable=True)
        token_of = order // top_k
        counts = torch.zeros(self.num_experts + local, dtype=torch.int32, device=hidden.device)
        counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
        offsets = torch.zeros(self.num_experts + 1 + local, dtype=torch.int32, device=hidden.device)
        torch.cumsum(counts, 0, out=offsets[1:])
        expert_out = grouped_expert_products(hidden[token_of], self.gate_up_proj, self.down_proj,
                                             offsets[:self.num_experts + 1], self.packed)
        weighted = expert_out.float() * weights.reshape(-1)[order].unsqueeze(1)
        if local:  # rows past the last local expert were never written
            weighted = torch.where((flat_ids[order] < self.num_experts).unsqueeze(1), weighted, 0.0)
        out = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
        out.index_add_(0, token_of, weighted)
        return out.to(hidden.dtype)

    def load_parameter(self, leaf: str, param: torch.Tensor, module_path: str, source) -> None:
        """Fills gate_up_proj / down_proj from the fused 3D tensor or from the E per-expert matrices."""
        fused = f"{module_path}.{leaf}"
        if source.resolve(fused) is not None:
            mine = Part(0, self.first_expert, self.num_experts, self.total_experts)
            tensor = source.get(fused, fused, mine if self.num_experts != self.total_experts else None)
            require_shape(fused, tensor, tuple(param.shape))
            param.data.copy_(tensor)
            return
        gate, up, down = self.checkpoint_names
        parts = (gate, up) if leaf == "gate_up_proj" else (down,)
        rows = param.shape[1] // len(parts)
        for expert in range(self.total_experts):  # the other ranks' experts are theirs to read
            if not self.first_expert <= expert < self.first_expert + self.num_experts:
                for part in parts:
                    source.claim(f"{module_path}.{expert}.{part}.weight")
        for expert in range(self.num_experts):
            for index, part in enumerate(parts):
                name = f"{module_path}.{self.first_expert + expert}.{part}.weight"
                tensor = source.get(name, fused)
                require_shape(name, tensor, (rows, param.shape[2]))
                param.data[expert, index * rows:(index + 1) * rows].copy_(tensor)


class GatedMLP(nn.Module):
    """A dense SiLU-gated MLP of any width (the Qwen2-MoE shared expert). Tensor-parallel, its output is
    this rank's partial sum (the MoE block reduces it with the experts')."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype, device: torch.device,
                 parallel: ParallelContext = SINGLE):
        super().__init__()
        self.gate_up_proj = column_linear(hidden_size, (intermediate_size, intermediate_size), False, dtype, device,
                                          parallel)
        self.down_proj = row_linear(intermediate_size, hidden_size, False, dtype, device, parallel, reduce=False)
        self.act = SiluAndMul()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(hidden)))


class SparseMoeBlock(nn.Module):
    """Router + experts (+ a sigmoid-gated shared expert, Qwen2-MoE). Module names follow transformers 5."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool,
                 dtype: torch.dtype, device: torch.device, shared_intermediate_size: int = 0,
                 checkpoint_names: tuple[str, str, str] = QWEN_EXPERT_NAMES, parallel: ParallelContext = SINGLE):
        super().__init__()
        self.parallel = parallel
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and num_experts={num_experts}")
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = Linear(hidden_size, (num_experts,), False, dtype, device)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, dtype, device, checkpoint_names,
                                    parallel)
        self.shared_expert: Optional[GatedMLP] = None
        self.shared_expert_gate: Optional[Linear] = None
        if shared_intermediate_size > 0:
            self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size, dtype, device, parallel)
            self.shared_expert_gate = Linear(hidden_size, (1,), False, dtype, device)

    @classmethod
    def from_config(cls, moe: MoeConfig, hidden_size: int, dtype: torch.dtype, device: torch.device,
                    parallel: ParallelContext = SINGLE) -> "SparseMoeBlock":
        return cls(hidden_size, moe.num_experts, moe.top_k, moe.intermediate_size, moe.renormalize, dtype, device,
                   moe.shared_expert_intermediate_size, moe.expert_names, parallel)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] -> [T, H]."""
        weights, ids = route(self.gate(hidden), self.top_k, self.renormalize)
        out = self.experts(hidden, weights, ids)
        if self.shared_expert is not None:
            assert self.shared_expert_gate is not None
            out += torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        return self.parallel.all_reduce(out)


__all__ = ["FusedExperts", "GatedMLP", "MIXTRAL_EXPERT_NAMES", "PackedExperts", "QWEN_EXPERT_NAMES", "SparseMoeBlock",
           "grouped_expert_products", "route"]
