"""The batched sampler: one call per step turns [R, V] logits into token ids.

Order of operations (vLLM v1's): raw logprobs are taken from the unprocessed
logits; then allowed_token_ids -> bad_words -> logit_bias -> min_tokens masking ->
repetition penalty -> frequency/presence
penalties -> greedy rows take the argmax -> temperature -> min_p -> top_k ->
top_p -> an exponential race draws the token. A row asking for n samples is
processed once and raced n times with independent noise.

Randomness: a row with its own generator (a request with a seed) draws its
noise from that generator alone, in a fixed shape, so its tokens do not depend
on what else is in the batch or where. Every other row draws from the
sampler's generator in one batched call.

The caller's logits are never modified. Results reach the host in exactly one
device-to-host copy.
"""

from __future__ import annotations

import random
from typing import Optional, Sequence

import numpy as np
import torch

from pagedserve import ops
from pagedserve.sample.grammar_mask import GrammarMask, apply_mask
from pagedserve.sample.pending import PendingSamples, SampleLogprobs, SamplerOutput
from pagedserve.sample.sampling_ops import (apply_logits_processors, apply_min_p_, apply_min_tokens,
                                            apply_penalties, apply_top_k_top_p_, exponential_race)
from pagedserve.sampling_params import SamplingParams
from pagedserve.sample.sampling_tensors import SamplingBatch, SamplingRow, build_sampling_batch

__all__ = ["PendingSamples", "Sampler", "SamplerOutput", "SampleLogprobs", "SamplingRow"]

# An odd 64-bit constant (the golden ratio's fraction) that spreads fork seeds apart.
_FORK_SEED_STRIDE = 0x9E3779B97F4A7C15


class Sampler:
    def __init__(self, device: torch.device | str, vocab_size: int, eos_token_ids: Sequence[int],
                 seed: Optional[int] = None):
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be at least 1, got {vocab_size}")
        self.device = torch.device(device)
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.generator = torch.Generator(device=self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        # Seeds for the fused Gumbel-max path (ops.sample_tokens): drawn on the host, so no
        # generator state lives on the device and one seed per step covers every row.
        self._step_seeds = random.Random(seed)

    def generator_for(self, params: SamplingParams,
                      sample_index: int = 0) -> Optional[torch.Generator]:
        """The generator a seeded request (or its sample_index-th fork) keeps for its lifetime.

        Forks of one seeded request get distinct, reproducible streams, so a
        child's tokens do not depend on where its siblings sit in the batch.
        """
        if params.seed is None:
            return None
        seed = (params.seed + sample_index * _FORK_SEED_STRIDE) % 2**64
        return torch.Generator(device=self.device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        return self.launch(logits, rows).result()

    def launch(self, logits: torch.Tensor, rows: Sequence[SamplingRow], grammar=None) -> "PendingSamples":
        """Queues the sampling on the logits' device; result() waits for the ids on the host.
        `grammar` (optional): the structured-output token bitmask, applied before any sampling parameter
        (on a copy: the caller's logits stay unmodified), as a filled sample.grammar_mask.GrammarMask or a
        MaskSource to fill it from (where every row samples plainly, a threaded source is handed the queued
        draw, and where it says checking pays, only the rows whose unmasked draw it refuses get a mask:
        _launch_gumbel_max)."""
        self._check_inputs(logits, rows)
        logits = logits[:, :self.vocab_size]
        if not rows:
            return PendingSamples.ready(SamplerOutput(token_ids=[], logprobs=None))
        plain = self._is_plain_temperature(rows)
        if (grammar is not None and not isinstance(grammar, GrammarMask)
                and not (plain and (grammar.check_first or grammar.threaded))):
            grammar = grammar.mask()  # every constrained row's mask, now
        if plain:  # a grammar's mask goes into the same pass
            return self._launch_gumbel_max(logits, rows, grammar)
        if grammar is not None:
            logits = apply_mask(logits, grammar)
        batch = build_sampling_batch(rows, self.vocab_size, self.eos_token_ids, self.device)
        logits = logits.float()
        raw_logprobs = logits.log_softmax(dim=-1) if batch.max_logprobs is not None else None
        if batch.processors is not None:
            logits = apply_logits_processors(logits, batch.processors)
        if batch.min_tokens_block is not None:
            logits = apply_min_tokens(logits, batch.min_tokens_block)
        if batch.penalties is not None:
            logits = apply_penalties(logits, batch.penalties)
        token_ids = self._sample(logits, batch)
        if raw_logprobs is None:
            ids = token_ids.to(torch.int32)
            return PendingSamples.copy(ids, lambda host: SamplerOutput(token_ids=host.tolist(), logprobs=None),
                                       device_ids=ids)
        assert batch.max_logprobs is not None
        packed = _pack_logprobs(token_ids, raw_logprobs, batch.max_logprobs, batch)
        return PendingSamples.copy(packed, lambda host: _unpack_logprobs(host, batch),
                                   device_ids=packed[:batch.num_samples])

    # -- sampling -------------------------------------------------------------------

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """[S] token ids, one per sample."""
        greedy_ids = logits.argmax(dim=-1) if batch.greedy_rows is not None else None
        if batch.all_greedy:
            assert greedy_ids is not None
            return self._per_sample(greedy_ids, batch)
        random_ids = self._sample_random(logits, batch)
        if greedy_ids is None:
            return random_ids
        assert batch.greedy_rows is not None
        return torch.where(self._per_sample(batch.greedy_rows, batch),
                           self._per_sample(greedy_ids, batch), random_ids)

    def _sample_random(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        assert batch.temperature is not None
        logits = logits / batch.temperature  # a fresh tensor: the in-place steps below own it
        if batch.min_p is not None:
            apply_min_p_(logits, batch.min_p)
        if batch.top_k is not None or batch.top_p is not None:
            apply_top_k_top_p_(logits, batch.top_k, batch.top_p, batch.max_top_k)
        if not batch.seeded:
            return self._gumbel_max(self._per_sample(logits, batch))
        probs = self._per_sample(logits.softmax(dim=-1), batch)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for seeded in batch.seeded:
            noise[seeded.start:seeded.start + seeded.count].exponential_(generator=seeded.generator)
        return exponential_race(probs, noise)

    def _gumbel_max(self, logits: torch.Tensor) -> torch.Tensor:
        """[R] int64: one unseeded draw from softmax(logits[r]) a row (-inf: excluded), by ops.sample_tokens'
        hashed noise in one pass. A softmax and torch's exponential_ noise for the race took ~120 ms a step
        for 64 rows of 49,152 on 2 CPU threads (Intel VM, session 42); seeded rows keep their generators."""
        out = torch.empty(logits.shape[0], dtype=torch.int32, device=logits.device)
        ones = torch.ones(logits.shape[0], dtype=torch.float32, device=logits.device)
        ops.sample_tokens(out, logits.contiguous(), ones, self._step_seeds.getrandbits(64))
        return out.long()

    @staticmethod
    def _per_sample(per_row: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        return per_row if batch.sample_rows is None else per_row[batch.sample_rows]

    # -- checks ---------------------------------------------------------------------

    def _launch_gumbel_max(self, logits: torch.Tensor, rows: Sequence[SamplingRow], grammar=None) -> "PendingSamples":
        """Temperature sampling (greedy rows included) in one pass over the logits, which may stay
        in the model's dtype: Gumbel-max with noise hashed from a per-step seed. A grammar's mask is
        read by the same pass (no masked float32 copy of the logits, no second kernel: on an H200 host
        those were ~0.25 ms a step of a JSON-constrained batch, bench/results/h200/session11.md).

        Given a threaded MaskSource (the grammar thread fills its masks: the mask's copy waits for them on
        the device), the queued pass is handed to it, whose thread takes the tokens as they reach the host.
        Given one where checking pays, the pass runs unmasked, and the rows whose token the grammar refuses
        run it again under their masks with the same seed.
        Exact: a row's noise depends on (seed, row, token) only, so an accepted token beat every other
        token, the allowed ones included, and is what the masked pass draws too (ties go to the lowest
        id in both)."""
        inv_t = torch.tensor([0.0 if row.params.greedy else 1.0 / row.params.temperature for row in rows],
                             dtype=torch.float32).to(logits.device, non_blocking=True)
        logits, seed = logits.contiguous(), self._step_seeds.getrandbits(64)

        def draw(mask: Optional[GrammarMask]) -> torch.Tensor:
            out = torch.empty(len(rows), dtype=torch.int32, device=logits.device)
            allowed = None if mask is None else mask.allowed(len(rows), logits.device)
            ops.sample_tokens(out, logits, inv_t, seed, allowed)
            return out

        def ids(host: np.ndarray) -> SamplerOutput:
            return SamplerOutput(token_ids=host.tolist(), logprobs=None)

        source = None if grammar is None or isinstance(grammar, GrammarMask) else grammar
        if source is None or source.threaded:
            drawn = draw(grammar if source is None else source.threaded_mask())
            pending = PendingSamples.copy(drawn, ids, device_ids=drawn)
            if source is not None:
                source.drawn(pending)
            return pending

        def checked(host: np.ndarray) -> SamplerOutput:
            token_ids = host.tolist()
            refused = grammar.refused(token_ids)
            mask = grammar.mask(refused) if refused else None
            if mask is not None:  # the other rows draw their accepted tokens again
                with torch.inference_mode():  # result() may be called outside it; the buffers were made in it
                    token_ids = draw(mask).cpu().tolist()
            return SamplerOutput(token_ids=token_ids, logprobs=None)

        return PendingSamples.copy(draw(None), checked)

    def _is_plain_temperature(self, rows: Sequence[SamplingRow]) -> bool:
        """True when every row is one unseeded (or greedy) draw from softmax(logits / T):
        no truncation, penalties, logprobs, parallel samples or min_tokens masking."""
        for row in rows:
            if not row.plain_settings:  # parallel samples, penalties, logprobs, processors, truncation
                return False
            p = row.params
            blocks_eos = bool(self.eos_token_ids) and not p.ignore_eos  # as _min_tokens_block decides
            if p.min_tokens and len(row.output_token_ids) < p.min_tokens and (p.stop_token_ids or blocks_eos):
                return False
            if row.generator is not None and not p.greedy:
                return False
        return True

    def _check_inputs(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        if logits.dim() != 2 or not logits.is_floating_point():
            raise ValueError(f"logits must be a 2-D floating tensor, got shape "
                             f"{tuple(logits.shape)} dtype {logits.dtype}")
        if logits.shape[0] != len(rows):
            raise ValueError(f"logits has {logits.shape[0]} rows but {len(rows)} rows were given")
        if logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits has {logits.shape[1]} columns, fewer than "
                             f"vocab_size={self.vocab_size}")
        if logits.device.type != self.device.type:
            raise ValueError(f"logits are on {logits.device} but the sampler is on {self.device}")
        for i, row in enumerate(rows):
            if row.num_samples < 1:
                raise ValueError(f"rows[{i}].num_samples must be at least 1, got {row.num_samples}")
            if row.generator is not None and row.generator.device.type != self.device.type:
                raise ValueError(f"rows[{i}].generator is on {row.generator.device}, "
                                 f"the sampler on {self.device}")


def _pack_logprobs(token_ids: torch.Tensor, raw_logprobs: torch.Tensor, top_n: int,
                   batch: SamplingBatch) -> torch.Tensor:
    """Everything the host needs as one int32 tensor (float32 values bit-cast).

    Layout: ids[S] | ranks[S] | sampled logprob bits[S] | top ids[R*N] | top logprob bits[R*N].
    """
    per_sample = raw_logprobs if batch.sample_rows is None else raw_logprobs[batch.sample_rows]
    sampled = per_sample.gather(1, token_ids.unsqueeze(1))
    ranks = (per_sample > sampled).sum(dim=-1) + 1
    top_values, top_ids = raw_logprobs.topk(top_n, dim=-1)
    return torch.cat([
        token_ids.to(torch.int32), ranks.to(torch.int32), sampled.view(-1).view(torch.int32),
        top_ids.reshape(-1).to(torch.int32), top_values.reshape(-1).view(torch.int32),
    ])


def _unpack_logprobs(host: np.ndarray, batch: SamplingBatch) -> SamplerOutput:
    s, r = batch.num_samples, batch.num_rows
    n = batch.max_logprobs
    assert n is not None
    ids = host[:s].tolist()
    ranks = host[s:2 * s].tolist()
    sampled = host[2 * s:3 * s].view(np.float32).tolist()
    top_ids = host[3 * s:3 * s + r * n].reshape(r, n).tolist()
    top_values = host[3 * s + r * n:].view(np.float32).reshape(r, n).tolist()
    logprobs: list[Optional[SampleLogprobs]] = []
    for i, row in enumerate(batch.sample_rows_host):
        asked = batch.requested_logprobs[row]
        if asked is None:
            logprobs.append(None)
            continue
        top = list(zip(top_ids[row][:asked], top_values[row][:asked]))
        logprobs.append(SampleLogprobs(ids[i], sampled[i], ranks[i], top))
    return SamplerOutput(token_ids=ids, logprobs=logprobs)
