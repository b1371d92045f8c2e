"""Router: which replica a new request goes to.

Each replica's load is the work it has queued, in tokens: the prompt tokens of its requests not yet
started (no output yet) plus one per running sequence (a decode step's token). A request goes where
load + the prompt tokens it would have to prefill there is the smallest; the prefill is the prompt
less the longest prefix the replica holds in its prefix cache, so a replica that cached the request's
prefix wins unless it is more loaded than the prefix saves ("much more loaded"). Ties go round-robin,
so idle replicas take requests with nothing in common in turn.

What a replica holds is remembered here, not asked: the chained hashes of the whole-block prompt
prefixes the router sent to each replica, in an LRU as large as that replica's KV pool (it cannot
cache more blocks than it has). A prefix the replica evicted early only costs a missed affinity.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence


def prefix_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """hashes[k]: the hash of the prompt's first k + 1 whole blocks (chained, so equal hashes mean
    equal prefixes with overwhelming odds). The prompt's last token never counts as cached."""
    hashes, h = [], 0
    for end in range(block_size, len(token_ids), block_size):  # whole blocks before the last token
        h = hash((h, tuple(token_ids[end - block_size:end])))
        hashes.append(h)
    return hashes


@dataclass
class _Routed:
    replica: int
    prompt_tokens: int
    num_seqs: int
    started: bool = False


class PrefixLRU:
    """Block-prefix hashes one replica was sent, oldest first, at most `capacity`."""

    def __init__(self, capacity: int):
        self.capacity = max(1, capacity)
        self._hashes: OrderedDict[int, None] = OrderedDict()

    def matched_blocks(self, hashes: list[int]) -> int:
        k = 0
        while k < len(hashes) and hashes[k] in self._hashes:
            k += 1
        return k

    def remember(self, hashes: list[int]) -> None:
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)


class Router:
    def __init__(self, num_replicas: int, block_size: int, cache_blocks: Sequence[int]):
        self.block_size = block_size
        self._caches = [PrefixLRU(c) for c in cache_blocks]
        self._load = [0] * num_replicas
        self._requests: dict[str, _Routed] = {}
        self._next = 0  # round-robin start among equal choices

    def load(self, replica: int) -> int:
        return self._load[replica]

    def route(self, request_id: str, prompt_token_ids: Sequence[int], num_seqs: int) -> int:
        """Picks the replica for a request and books it there."""
        hashes = prefix_hashes(prompt_token_ids, self.block_size)
        n = len(self._load)
        costs = []
        for i in range(n):
            cached = self._caches[i].matched_blocks(hashes) * self.block_size
            costs.append((self._load[i] + len(prompt_token_ids) - cached, self._load[i]))
        best = min(costs)
        order = [(self._next + k) % n for k in range(n)]
        replica = next(i for i in order if costs[i] == best)
        self._next = (replica + 1) % n
        self._caches[replica].remember(hashes)
        self._requests[request_id] = _Routed(replica, len(prompt_token_ids), num_seqs)
        self._load[replica] += len(prompt_token_ids)
        return replica

    def started(self, request_id: str) -> None:
        """The request's first output came: its prompt is in, its sequences decode."""
        r = self._requests.get(request_id)
        if r is not None and not r.started:
            r.started = True
            self._load[r.replica] += r.num_seqs - r.prompt_tokens

    def finished(self, request_id: str) -> None:
        r = self._requests.pop(request_id, None)
        if r is not None:
            self._load[r.replica] -= r.num_seqs if r.started else r.prompt_tokens
