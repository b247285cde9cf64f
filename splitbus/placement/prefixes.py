"""What a policy knows of the workers' prefix caches: how many of a request's prompt tokens each
worker holds cached (docs/routing.md, "The cost").

A policy asks ``Prefixes.cached`` while it decides; the scheduler tells ``Prefixes.routed`` where
a decision sent each request, once it is made. ``IndexPrefixes`` answers from this replica's
``KvIndex`` (fed by the workers' KV events); ``NO_PREFIXES`` knows of no cache, which makes every
policy place by load alone.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from splitbus.bus.blocks import block_hashes, root_of, split_hex
from splitbus.bus.messages import GenerateRequest
from splitbus.bus.messages.kv_events import block_hash
from splitbus.bus.registry import WorkerInfo
from splitbus.placement.kv_index import KvIndex

PREDICT_S = 5.0
"""How long a routed request's prompt blocks count as held by its worker before that worker's
events confirm them: the sibling requests arriving meanwhile follow it."""
CHAINS_KEPT = 4096
"""Requests whose hash chains are kept (a waiting request is decided again on every loop step;
a request's chain is dropped once it is routed)."""


@dataclass(frozen=True)
class Candidates:
    """The workers a policy asks about: each one's block size (a chain is hashed per size)."""

    block_size: Mapping[str, int]
    """By worker id."""
    sizes: frozenset[int]
    """The block sizes among them."""

    @classmethod
    def of(cls, workers: Sequence[WorkerInfo]) -> Candidates:
        block_size = {w.record.worker_id: w.record.block_size for w in workers}
        return cls(block_size, frozenset(block_size.values()))


class Prefixes(Protocol):
    def cached(self, request: GenerateRequest, candidates: Candidates) -> dict[str, int]:
        """Called by a policy while it decides ``request``: the prompt tokens each of
        ``candidates`` holds cached, by worker id (a worker not in it holds none). At most the
        prompt's length less one token: the engine always computes the last one, for its logits.
        A policy builds ``candidates`` once per registry snapshot, not per decision."""
        ...

    def routed(self, request: GenerateRequest, worker: WorkerInfo) -> None:
        """Called by the scheduler once a decision sends ``request`` to ``worker`` to prefill
        there (a prefill or mixed task)."""
        ...


class NoPrefixes:
    """No cache is known: every worker holds nothing."""

    def cached(self, request: GenerateRequest, candidates: Candidates) -> dict[str, int]:
        return {}

    def routed(self, request: GenerateRequest, worker: WorkerInfo) -> None:
        pass


NO_PREFIXES = NoPrefixes()


class IndexPrefixes:
    """The workers' caches as this replica's ``KvIndex`` knows them.

    A request's chain is the block hashes of its prompt less the last token (what an engine can
    reuse, ``splitbus.worker.engines.prefix.BlockPool.match``), once per request and block size:
    the one the API sent with it (``GenerateRequest.prefix_hashes``) when its block size is the
    worker's, else hashed here (~65 ns a token), salted with the request's ``cache_salt`` either
    way (the API salts its chain with it). ``routed`` predicts the chain on the chosen worker
    for ``predict_s``."""

    def __init__(self, index: KvIndex, extra: str = "", predict_s: float = PREDICT_S) -> None:
        self.index = index
        self.extra = extra
        self.predict_s = predict_s
        self._chains: OrderedDict[int, tuple[GenerateRequest, dict[int, list[str]]]] = OrderedDict()
        """By the request object (a waiting request is the same object at each decision; kept
        here, so its id is not reused meanwhile), then by block size."""

    def chain(self, request: GenerateRequest, block_size: int) -> list[str]:
        kept = self._chains.get(id(request))
        if kept is None or kept[0] is not request:
            kept = self._chains[id(request)] = (request, {})
            if len(self._chains) > CHAINS_KEPT:
                self._chains.popitem(last=False)
        chains = kept[1]
        if block_size not in chains:
            if request.prefix_block_size == block_size and not self.extra:
                chains[block_size] = split_hex(request.prefix_hashes)  # the API hashed it as it tokenized
            else:
                root = root_of(request.cache_salt)  # salted as the worker salts it
                hashes = block_hashes(request.prompt_token_ids[:-1], block_size, self.extra, root)
                chains[block_size] = [block_hash(h) for h in hashes]
        return chains[block_size]

    def cached(self, request: GenerateRequest, candidates: Candidates) -> dict[str, int]:
        found: dict[str, int] = {}
        for size in candidates.sizes:
            for worker, blocks in self.index.overlaps(self.chain(request, size)).items():
                if candidates.block_size.get(worker) == size:  # a holder among the candidates, of this size
                    found[worker] = blocks * size
        return found

    def routed(self, request: GenerateRequest, worker: WorkerInfo) -> None:
        chain = self.chain(request, worker.record.block_size)
        self.index.decided(worker.record.worker_id, chain)
        self.index.predict(worker.record.worker_id, chain, self.predict_s)
        # Decided: its chain is not asked for again. Kept, the last CHAINS_KEPT requests (their
        # prompts) would outlive their decisions long enough to reach the oldest GC generation,
        # whose collections scan all of them (tens of ms at 500 req/s: docs/benchmarks.md).
        self._chains.pop(id(request), None)  # every block size's
