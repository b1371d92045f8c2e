"""Which flash-attention tiling reproduces torch's bf16 SDPA bit for bit? (a measurement)

Bit-identical bf16 attention needs the same rounding points, and in flash
attention those depend on the tiling: probabilities are rounded to bf16
relative to the running max of the key tiles seen so far. This script
emulates the algorithm in float32 for key-tile sizes, tile orders and
exponent forms, and counts the output elements equal to torch's
scaled_dot_product_attention (whatever backend torch picks: printed), for
causal prefills and single-query decodes of several lengths; our own CUDA
kernel is measured the same way. The candidate at ~100% is the tiling to copy.

    python bench/numerics/sdpa_numerics.py [--out DIR]     (CUDA GPU + CUDA build)
    python bench/numerics/sdpa_numerics.py --quick         # one prefill and one decode length
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.report import arg_parser, markdown_table, require_cuda, save  # noqa: E402

HEADS, KV_HEADS, DIM = 9, 3, 64  # SmolLM2-135M
LENGTHS = (("prefill", (40, 64, 100, 130, 200, 300)), ("decode", (40, 100, 130, 200, 300, 600)))
LOG2E = 1.4426950408889634


def emulate(q, k, v, scale, tile, order, exp_form, causal):
    """q [H, Lq, D], k/v [H, Lk, D] bf16 (kv heads already repeated) -> bf16 [H, Lq, D]."""
    lq, lk = q.shape[1], k.shape[1]
    scores = q.float() @ k.float().transpose(1, 2)
    if causal:
        visible = torch.arange(lk, device=q.device)[None, :] <= torch.arange(lq, device=q.device)[:, None] + (lk - lq)
        scores = scores.masked_fill(~visible, float("-inf"))
    starts = list(range(0, lk, tile))
    if order == "reverse":
        starts = starts[::-1]
    m = torch.full(scores.shape[:2], float("-inf"), device=q.device)
    l = torch.zeros_like(m)
    acc = torch.zeros(*scores.shape[:2], DIM, device=q.device)
    for a in starts:
        s = scores[..., a:a + tile]
        if exp_form == "log2":  # s * scale * log2(e) first, then exp2(s - m)
            s = s * (scale * LOG2E)
            m_new = torch.maximum(m, s.amax(-1))
            shift = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
            p = torch.exp2(s - shift[..., None])
            rescale = torch.exp2(m - shift)
        else:  # natural: exp(s * scale - m)
            s = s * scale
            m_new = torch.maximum(m, s.amax(-1))
            shift = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - shift[..., None])
            rescale = torch.exp(m - shift)
        l = l * rescale + p.sum(-1)
        acc = acc * rescale[..., None] + p.to(torch.bfloat16).float() @ v[:, a:a + tile].float()
        m = m_new
    return (acc / l[..., None]).to(torch.bfloat16)


def ours(q, k, v, scale, causal):
    """Our CUDA paged attention over a contiguous block table (block size 16)."""
    from pagedserve import ops
    lq, lk = q.shape[1], k.shape[1]
    blocks = math.ceil(lk / 16)
    group = HEADS // KV_HEADS

    def paged(x):  # [KV, Lk, D] -> [blocks, KV, 16, D] (cpp/ops/kv_cache_layout.h)
        padded = torch.zeros(KV_HEADS, blocks * 16, DIM, device="cuda", dtype=torch.bfloat16)
        padded[:, :lk] = x[::group]  # undo the repeat
        return padded.view(KV_HEADS, blocks, 16, DIM).permute(1, 0, 2, 3).contiguous()

    kc, vc = paged(k), paged(v)
    query = q.transpose(0, 1).contiguous()
    out = torch.empty_like(query)
    table = torch.arange(blocks, device="cuda", dtype=torch.int32)[None]
    workspace = ops.paged_attention_workspace(1, HEADS, DIM, lk, "cuda")
    ops.paged_attention(out, query, kc, vc, table, torch.tensor([0, lq], device="cuda", dtype=torch.int32),
                        torch.tensor([lk], device="cuda", dtype=torch.int32), scale, lq, lk,
                        num_decodes=1 if lq == 1 else 0, workspace=workspace)
    return out.transpose(0, 1)


def main() -> None:
    ap = arg_parser(__doc__, "one prefill and one decode length")
    args = ap.parse_args()
    require_cuda(__file__)
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(0)
    scale = DIM ** -0.5
    candidates = [(t, o, e) for t in (16, 32, 64, 128, 256, 100000) for o in ("forward", "reverse")
                  for e in ("log2", "natural")]
    rows = []
    for kind, lengths in LENGTHS:
        for length in lengths[:1] if args.quick else lengths:
            lq = length if kind == "prefill" else 1
            q = (torch.randn(HEADS, lq, DIM, device="cuda", generator=gen) * 2).to(torch.bfloat16)
            k = (torch.randn(KV_HEADS, length, DIM, device="cuda", generator=gen) * 2).to(torch.bfloat16)
            v = torch.randn(KV_HEADS, length, DIM, device="cuda", generator=gen).to(torch.bfloat16)
            k_rep = k.repeat_interleave(HEADS // KV_HEADS, 0)
            v_rep = v.repeat_interleave(HEADS // KV_HEADS, 0)
            causal = kind == "prefill"
            ref = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=causal,
                                                                   enable_gqa=True)[0]
            row = {"kind": kind, "length": length,
                   "ours": round(float((ours(q, k_rep, v_rep, scale, causal) == ref).float().mean()), 4)}
            for t, o, e in candidates:
                got = emulate(q, k_rep, v_rep, scale, t, o, e, causal)
                row[f"{'all' if t > 10000 else t}/{o[0]}/{e}"] = round(float((got == ref).float().mean()), 4)
            rows.append(row)
            print(row, flush=True)
    backend = {}
    for kind, lq in (("prefill", 100), ("decode", 1)):
        q = torch.randn(1, HEADS, lq, DIM, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, KV_HEADS, 100, DIM, device="cuda", dtype=torch.bfloat16)
        choice = torch._fused_sdp_choice(q, k, k, None, 0.0, kind == "prefill", enable_gqa=True)
        names = {int(v): k for k, v in torch.nn.attention.SDPBackend.__members__.items()}
        backend[kind] = names.get(int(choice), str(choice))
    columns = ["kind", "length", "ours"] + [c for c in rows[0] if c not in ("kind", "length", "ours")]
    best = {kind: max(columns[3:], key=lambda c: sum(r[c] for r in rows if r["kind"] == kind))
            for kind in ("prefill", "decode")}
    text = (f"# Fraction of bf16 attention outputs equal to torch SDPA ({backend}), by emulated tiling\n\n"
            f"Columns: key tile / order (f, r) / exponent form. Best: {best}\n\n" + markdown_table(rows, columns))
    print(text)
    save("sdpa_numerics" + ("_quick" if args.quick else ""), {"rows": rows, "backend": backend, "best": best}, text,
         args.out)


if __name__ == "__main__":
    main()
