"""Random GGUF block matrices for the tests and the benches: quantized from noise where the gguf package can
make the format, else random bytes whose float16 scales are set to a chosen range (the package cannot quantize
the K-quants; their codes may be anything, their scales must be finite and small)."""

from __future__ import annotations

import numpy as np

# Where a K-quant super-block keeps its float16 scales: d and dmin first (Q4_K, Q5_K), d last (Q6_K).
K_QUANT_HALF_OFFSETS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1")


def random_blocks(type_name: str, n: int, k: int, rng: np.random.Generator, scale_low: float = -0.02,
                  scale_high: float = 0.02) -> np.ndarray:
    """[n, row_bytes] uint8 blocks of an [n, k] matrix in the named format: Q8_0 / Q4_0 / Q4_1 quantized from
    standard-normal noise, the K-quants random bytes with their float16 scales uniform in [scale_low,
    scale_high]."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[type_name]
    if type_name in QUANTIZABLE:
        return quants.quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n, k // elems, nbytes), dtype=np.uint8)
    for offset in K_QUANT_HALF_OFFSETS[type_name]:
        scales = rng.uniform(scale_low, scale_high, size=(n, k // elems)).astype(np.float16)
        blocks[:, :, offset:offset + 2] = scales[..., None].view(np.uint8)
    return blocks.reshape(n, -1)
