"""The MoE layer (pagedserve.models.moe) against transformers' sparse MoE blocks, float32 on CPU."""

from __future__ import annotations

import pytest
import torch

from pagedserve.models.cpu_weight_packing import is_bf16_exact
from pagedserve.models.moe import SparseMoeBlock, grouped_expert_products, route

HIDDEN, INTER, SHARED = 64, 48, 80


def hf_block(family: str, num_experts: int, top_k: int, norm_topk_prob: bool, seed: int):
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    common = dict(hidden_size=HIDDEN, num_experts_per_tok=top_k)
    if family == "mixtral":
        block = MixtralSparseMoeBlock(MixtralConfig(**common, intermediate_size=INTER, num_local_experts=num_experts))
    elif family == "qwen2_moe":
        block = Qwen2MoeSparseMoeBlock(Qwen2MoeConfig(**common, moe_intermediate_size=INTER, num_experts=num_experts,
                                                      shared_expert_intermediate_size=SHARED,
                                                      norm_topk_prob=norm_topk_prob))
    else:
        block = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(**common, moe_intermediate_size=INTER, num_experts=num_experts,
                                                      norm_topk_prob=norm_topk_prob))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(0.2 * torch.randn(param.shape, generator=generator))
    return block.eval()


def our_block(block, family: str, num_experts: int, top_k: int, renormalize: bool) -> SparseMoeBlock:
    ours = SparseMoeBlock(HIDDEN, num_experts, top_k, INTER, renormalize, torch.float32, torch.device("cpu"),
                          shared_intermediate_size=SHARED if family == "qwen2_moe" else 0)
    hf = block.state_dict()
    with torch.no_grad():
        ours.gate.weight.copy_(hf["gate.weight"])
        ours.experts.gate_up_proj.copy_(hf["experts.gate_up_proj"])
        ours.experts.down_proj.copy_(hf["experts.down_proj"])
        if family == "qwen2_moe":
            ours.shared_expert.gate_up_proj.weight.copy_(torch.cat([hf["shared_expert.gate_proj.weight"],
                                                                    hf["shared_expert.up_proj.weight"]]))
            ours.shared_expert.down_proj.weight.copy_(hf["shared_expert.down_proj.weight"])
            ours.shared_expert_gate.weight.copy_(hf["shared_expert_gate.weight"])
    return ours


@pytest.mark.parametrize("family, num_experts, top_k, norm", [
    ("mixtral", 8, 2, True), ("mixtral", 4, 1, True), ("qwen2_moe", 8, 2, False), ("qwen2_moe", 6, 3, True),
    ("qwen3_moe", 8, 2, True), ("qwen3_moe", 8, 8, False)])
def test_block_equals_transformers(family, num_experts, top_k, norm):
    block = hf_block(family, num_experts, top_k, norm, seed=num_experts * 10 + top_k)
    ours = our_block(block, family, num_experts, top_k, renormalize=norm or family == "mixtral")
    hidden = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = block(hidden.unsqueeze(0))
        want = (want[0] if isinstance(want, tuple) else want)[0]
        got = ours(hidden)
        single = torch.cat([ours(hidden[i:i + 1]) for i in range(5)])  # one token at a time: the decode shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(single, want[:5], rtol=1e-5, atol=1e-5)


def test_routing_order_softmax_topk_renormalise():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    weights, ids = route(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)[0]
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(weights[0], probs[:2])
    weights, _ = route(logits, 2, renormalize=True)
    torch.testing.assert_close(weights[0], probs[:2] / probs[:2].sum())
    assert weights.dtype == torch.float32


def test_grouped_products_equal_a_per_row_reference_with_idle_experts():
    generator = torch.Generator().manual_seed(3)
    gate_up = torch.randn(5, 2 * INTER, HIDDEN, generator=generator) * 0.1
    down = torch.randn(5, HIDDEN, INTER, generator=generator) * 0.1
    counts = [3, 0, 7, 0, 1]  # experts 1 and 3 get no tokens
    expert_of_row = [e for e, c in enumerate(counts) for _ in range(c)]
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    x = torch.randn(sum(counts), HIDDEN, generator=generator)
    got = grouped_expert_products(x, gate_up, down, offsets)
    for row, expert in enumerate(expert_of_row):
        gate, up = (gate_up[expert] @ x[row]).chunk(2)
        torch.testing.assert_close(got[row], down[expert] @ (torch.nn.functional.silu(gate) * up))
    assert grouped_expert_products(x[:0], gate_up, down, torch.zeros(6, dtype=torch.int32)).shape == (0, HIDDEN)


def test_packed_experts_equal_unpacked_for_bf16_exact_weights():
    block = hf_block("qwen2_moe", 8, 2, False, seed=4)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    ours = our_block(block, "qwen2_moe", 8, 2, renormalize=False)
    assert all(is_bf16_exact(w) for _, w in ours.experts.packable_matrices())
    hidden = torch.randn(29, HIDDEN, generator=torch.Generator().manual_seed(2))
    want = ours(hidden)
    ours.experts.pack()
    for module in (ours.gate, ours.shared_expert.gate_up_proj, ours.shared_expert.down_proj, ours.shared_expert_gate):
        module.pack()
    assert ours.experts.gate_up_proj is None and ours.experts.packed is not None
    torch.testing.assert_close(ours(hidden), want, rtol=1e-5, atol=1e-5)


def test_grouped_linear_switch_passes_the_op_contract(monkeypatch):
    """With ops.grouped_linear (CUDA), each projection is one call: out [T, N], x [T, K], weight [E, N, K],
    expert_offsets [E+1] int32. A torch stand-in checks the arguments and gives the loop's result."""
    from pagedserve import ops
    from pagedserve.models import moe

    calls = []

    def grouped_linear(out, x, weight, expert_offsets):
        assert expert_offsets.dtype == torch.int32 and expert_offsets.shape == (weight.shape[0] + 1,)
        assert out.shape == (x.shape[0], weight.shape[1]) and x.shape[1] == weight.shape[2]
        bounds = expert_offsets.tolist()
        for e in range(weight.shape[0]):
            out[bounds[e]:bounds[e + 1]] = x[bounds[e]:bounds[e + 1]] @ weight[e].T
        calls.append(weight.shape)

    block = hf_block("qwen3_moe", 8, 2, True, seed=9)
    ours = our_block(block, "qwen3_moe", 8, 2, renormalize=True)
    hidden = torch.randn(19, HIDDEN, generator=torch.Generator().manual_seed(5))
    want = ours(hidden)
    monkeypatch.setattr(ops, "grouped_linear", grouped_linear, raising=False)
    monkeypatch.setattr(moe, "use_grouped_linear", lambda x: True)
    torch.testing.assert_close(ours(hidden), want, rtol=1e-5, atol=1e-5)
    assert calls == [(8, 2 * INTER, HIDDEN), (8, HIDDEN, INTER)]


def routed_batch(num_experts: int, top_k: int, plan: list[tuple[int, ...]], seed: int) -> torch.Tensor:
    """Hidden states [len(plan), HIDDEN] that route token t to exactly the experts plan[t] (in that order):
    with the router set to the identity on the first num_experts dims (router_identity), a token's router
    logits are its first num_experts values: the chosen experts get 4, 3, 2, ... (plus jitter), the others
    values in [-2, 0); the remaining dims are random (they drive the experts' outputs)."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(len(plan), HIDDEN, generator=generator)
    for t, experts in enumerate(plan):
        assert len(experts) == top_k and len(set(experts)) == top_k
        hidden[t, :num_experts] = -2 * torch.rand(num_experts, generator=generator)
        for rank, e in enumerate(experts):
            hidden[t, e] = 4.0 - rank + 0.1 * torch.rand((), generator=generator)
    return hidden


def router_identity(block, num_experts: int) -> None:
    with torch.no_grad():
        block.gate.weight.zero_()
        block.gate.weight[:, :num_experts] = torch.eye(num_experts)


# Experts receiving many tokens, exactly one, and none, in one batch; then a decode-sized batch of one token.
ROUTING_PLANS = {
    # 8 experts, top 2: expert 0 takes 9 tokens, 2 and 3 several, 1 and 4 one each, 5, 6, 7 none
    (8, 2): [(0, 2), (0, 3), (2, 0), (0, 2), (3, 0), (0, 3), (2, 0), (0, 2), (1, 0), (3, 4)],
    # 6 experts, top 3: expert 5 takes all 7 tokens, 4 one, 0 none
    (6, 3): [(5, 1, 2), (1, 5, 3), (2, 3, 5), (5, 2, 1), (3, 5, 1), (5, 4, 2), (1, 3, 5)],
    # 4 experts, top 1: expert 2 takes 5 tokens, 0 one, 1 and 3 none
    (4, 1): [(2,), (2,), (0,), (2,), (2,), (2,)],
}


@pytest.mark.parametrize("family, num_experts, top_k, norm", [
    ("mixtral", 8, 2, True), ("mixtral", 4, 1, True), ("qwen2_moe", 8, 2, False), ("qwen2_moe", 6, 3, True),
    ("qwen3_moe", 8, 2, True), ("qwen3_moe", 6, 3, False)])
def test_experts_receiving_none_one_and_many_tokens_equal_transformers(family, num_experts, top_k, norm):
    block = hf_block(family, num_experts, top_k, norm, seed=100 + num_experts * 10 + top_k)
    router_identity(block, num_experts)
    ours = our_block(block, family, num_experts, top_k, renormalize=norm or family == "mixtral")
    plan = ROUTING_PLANS[(num_experts, top_k)]
    hidden = routed_batch(num_experts, top_k, plan, seed=num_experts + top_k)

    # The routing, as we compute it and as the plan says: some experts get none, one gets exactly one, one many.
    _, ids = route(ours.gate(hidden), top_k, ours.renormalize)
    assert [tuple(row) for row in ids.tolist()] == plan
    counts = torch.bincount(ids.flatten(), minlength=num_experts).tolist()
    assert 0 in counts and 1 in counts and max(counts) >= 5, counts
    hf_logits = hidden @ block.gate.weight.T  # transformers' router: softmax then top-k of these logits
    assert torch.topk(torch.softmax(hf_logits, -1), top_k).indices.tolist() == [list(p) for p in plan]

    with torch.no_grad():
        want = block(hidden.unsqueeze(0))
        want = (want[0] if isinstance(want, tuple) else want)[0]
        got = ours(hidden)
        singles = torch.cat([ours(hidden[i:i + 1]) for i in range(len(plan))])  # top_k experts get 1, the rest 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(singles, want, rtol=1e-5, atol=1e-5)
    # An expert that receives no token contributes nothing: zeroing its weights changes no output.
    idle = counts.index(0)
    with torch.no_grad():
        ours.experts.gate_up_proj[idle].zero_()
        ours.experts.down_proj[idle].zero_()
        torch.testing.assert_close(ours(hidden), got, rtol=0, atol=0)
