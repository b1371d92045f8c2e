"""Which summation order reproduces torch's x.pow(2).mean(-1) on CUDA bit for bit? (a measurement)

transformers' RMSNorm takes the mean of squares with torch's block reduction;
a norm that should match it bit for bit must add in the same order. This
script emulates candidate orders with float32 torch ops (each add rounded
as the GPU does) for the [T, H] shapes of decoder models and counts the rows
whose mean equals torch's exactly. The order at 100% is the one the CUDA norm
kernel must follow (cuda/norm_kernels.cu, TorchRowOrder).

    python bench/numerics/norm_numerics.py [--out DIR]     (CUDA GPU)
    python bench/numerics/norm_numerics.py --quick         # one hidden size, two row counts
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.report import arg_parser, markdown_table, require_cuda, save  # noqa: E402


def last_pow2(n: int) -> int:
    p = 1
    while 2 * p <= n:
        p *= 2
    return p


def torch_width(rows: int, hidden: int) -> int:
    """Threads per row of torch's ReduceConfig (our reading of set_block_dimension)."""
    dim0 = hidden // 4
    dim0_pow2 = last_pow2(dim0) if dim0 < 512 else 512
    dim1_pow2 = last_pow2(rows) if rows < 512 else 512
    width = min(dim0_pow2, 32)
    height = min(dim1_pow2, 512 // width)
    return min(dim0_pow2, 512 // height)


def emulate(squares: torch.Tensor, width: int, warp_up: bool, lanes: int = 4) -> torch.Tensor:
    """Sum of each row of squares [T, H] in the order: thread t adds lane-wise vectors t, t + width, ...;
    lanes combined left to right; shared-memory halving down to 32; then a warp tree."""
    rows, hidden = squares.shape
    vecs = squares.view(rows, hidden // lanes, lanes)
    n_vec = hidden // lanes
    acc = torch.zeros(rows, width, lanes, device=squares.device)
    for start in range(0, n_vec, width):
        chunk = vecs[:, start:start + width]
        acc[:, :chunk.shape[1]] = acc[:, :chunk.shape[1]] + chunk
    v = acc[..., 0]
    for i in range(1, lanes):
        v = v + acc[..., i]
    offset = width // 2
    while offset >= 32:
        v = torch.cat([v[:, :offset] + v[:, offset:2 * offset], v[:, offset:]], dim=1)
        offset //= 2
    v = v[:, :32].clone() if width >= 32 else v
    offsets = [1, 2, 4, 8, 16] if warp_up else [16, 8, 4, 2, 1]
    for off in offsets:
        shifted = torch.cat([v[:, off:], v[:, -off:]], dim=1)  # lanes past the end read their own value
        v = v + shifted
    return v[:, 0]


def main() -> None:
    ap = arg_parser(__doc__, "hidden 576 only, 1 and 16 rows")
    args = ap.parse_args()
    require_cuda(__file__, build=False)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows_out = []
    for hidden in (576,) if args.quick else (576, 1024, 2048, 4096):
        for t in (1, 16) if args.quick else (1, 3, 10, 16, 40, 300):
            trials = max(1, 400 // t)
            x = (torch.randn(trials, t, hidden, device="cuda", generator=gen) * 3).to(torch.bfloat16).float()
            want = torch.stack([x[i].pow(2).mean(-1) for i in range(trials)])  # torch, shape [t, hidden] each
            squares = x * x
            factor = torch.tensor(float(t), dtype=torch.float32) / torch.tensor(float(t * hidden), dtype=torch.float32)
            row = {"hidden": hidden, "rows": t, "width (model)": torch_width(t, hidden)}
            for width in sorted({torch_width(t, hidden), 32, 64, 128, 256, 512}):
                if width > hidden // 4:
                    continue
                for warp_up in (True, False):
                    got = torch.stack([emulate(squares[i], width, warp_up) for i in range(trials)]) * factor.cuda()
                    row[f"w{width}{'up' if warp_up else 'down'}"] = round(float((got == want).float().mean()), 4)
            rows_out.append(row)
            print(row, flush=True)
    columns = sorted({c for r in rows_out for c in r}, key=lambda c: (c[0] != "h", c[0] != "r", c))
    text = "# Rows whose emulated mean of squares equals torch's, by order\n\n" + markdown_table(rows_out, columns)
    print(text)
    save("norm_numerics" + ("_quick" if args.quick else ""), {"rows": rows_out}, text, args.out)


if __name__ == "__main__":
    main()
