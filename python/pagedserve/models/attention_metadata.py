"""AttentionMetadata: how one step's tokens map onto the paged KV cache.

Built by the model runner from the scheduler's StepOutput and passed explicitly
through the model's forward to every attention layer (there is no global
forward context). All tensors live on the model's device; index tensors are
int32. Row s of the batch brings tokens ``query_start_loc[s]:query_start_loc[s+1]``
at positions ``[seq_lens[s] - q_len, seq_lens[s])``; rows ``[0, num_decodes)``
bring exactly one token each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each token (kPadSlot = -1 for padding)
    block_tables: torch.Tensor  # [S, max_blocks]
    query_start_loc: torch.Tensor  # [S + 1]
    seq_lens: torch.Tensor  # [S] context length including this step's tokens
    max_query_len: int  # host-side bounds, for kernel launch shapes
    max_seq_len: int
    num_decodes: int = 0
    workspace: Optional[torch.Tensor] = None  # scratch for split-K decode kernels (CUDA)
    # [S] each row's prompt length: longrope picks a token's rope rows by max(prompt length, position + 1),
    # so a prompt's chunks all take the rows one forward over the whole prompt would. None: seq_lens
    # (a caller that runs whole prompts).
    prompt_lens: Optional[torch.Tensor] = None
    # [num_decodes] the decode rows longest context first: the order the CUDA kernel launches them in, so the
    # short rows fill its last wave (a permutation; it changes no result). None: row order.
    decode_order: Optional[torch.Tensor] = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]
