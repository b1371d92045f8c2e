"""The int8 weight format of ops.int8_linear (cpp/ops/int8_weight_layout.h): a float weight quantized per
output channel and packed into the kernel's 16-row tiles. Made once per linear when a model loads with
``--quantization int8``; the kernels only read it."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Int8Weight(NamedTuple):
    """A weight [N, K] as int8 channels (cpp/ops/int8_weight_layout.h): packed [ceil(N / 16), round_up(K, 64) / 4,
    16] int32, 4 bytes q + 128 per word; scales [N] float32 (W ~ q * scale)."""
    packed: torch.Tensor
    scales: torch.Tensor


_INT8_ROWS_PER_BLOCK = 1024  # a multiple of the 16-row tiles


def quantize_int8_weight(weight: torch.Tensor) -> Int8Weight:
    """Symmetric per-output-channel int8 of a float weight [N, K]: scale[n] = max_k |W[n, k]| / 127,
    q = round_half_even(W / scale) in [-127, 127] (a zero row keeps scale 0), packed for int8_linear."""
    out_features, in_features = weight.shape
    k_pad, n_pad = (in_features + 63) // 64 * 64, (out_features + 15) // 16 * 16
    packed = torch.empty(n_pad // 16, k_pad // 4, 16, dtype=torch.int32)
    scales = torch.empty(out_features, dtype=torch.float32)
    # A block of rows at a time (every row is quantized on its own): the float32 temporaries of a whole
    # LM head (SmolLM2's 49152 x 576) would add some 300 MiB to the peak while it loads.
    for first in range(0, n_pad, _INT8_ROWS_PER_BLOCK):
        end = min(first + _INT8_ROWS_PER_BLOCK, n_pad)
        w = weight[first:min(end, out_features)].detach().float()
        block_scales = w.abs().amax(dim=1) / 127.0
        q = torch.round(w / torch.where(block_scales > 0, block_scales, 1.0)[:, None]).clamp_(-127, 127)
        padded = torch.full((end - first, k_pad), 128, dtype=torch.uint8)  # q = 0 past N and K
        padded[:w.shape[0], :in_features] = (q.to(torch.int16) + 128).to(torch.uint8)
        # byte j of packed[t, g, c] = q[16t + c, 4g + j] + 128
        tiles = padded.view((end - first) // 16, 16, k_pad // 4, 4).permute(0, 2, 1, 3).contiguous()
        packed[first // 16:end // 16] = tiles.view(torch.int32).view(-1, k_pad // 4, 16)
        scales[first:first + w.shape[0]] = block_scales
    return Int8Weight(packed, scales)
