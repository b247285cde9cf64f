"""Conditional disaggregation (splitwise): whether a request prefills on its decode worker itself
instead of on a prefill worker. Pure: decided from a registry snapshot (docs/routing.md,
"Conditional disaggregation").

A short uncached prompt costs more to ship than to compute: its prefill on D takes a few ms of
D's step, where the hand-off takes a hop to P, P's queue, and a KV transfer. Disaggregating
keeps long prefills from stalling D's decodes. So a request prefills locally when what D would
compute is short, or when every prefill worker is over its queue bound (or there is none), and
never when D's KV cache would be nearly full after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from splitbus.bus.messages import GenerateRequest
from splitbus.bus.records import blocks_needed
from splitbus.bus.registry import WorkerInfo
from splitbus.placement import metrics
from splitbus.placement.costs import free_blocks, reserved
from splitbus.placement.ledger import Local


@dataclass(frozen=True)
class Disaggregation:
    """When a splitwise request prefills on its decode worker (all off by default: always on P)."""

    local_prefill_max_tokens: int = 0
    """Prefill on D when D would compute at most this many prompt tokens (its uncached part);
    0: never for this reason."""
    prefill_queue_bound: int = 0
    """Prefill on D when every prefill worker has more than this many prompt tokens queued (or
    none is live); 0: never for this reason."""
    min_free_kv: float = 0.1
    """Never on a D whose free KV blocks, once this request's are taken, would be under this
    share of its total: its running requests need the room to grow."""

    def __post_init__(self) -> None:
        if self.local_prefill_max_tokens < 0 or self.prefill_queue_bound < 0 or not 0 <= self.min_free_kv <= 1:
            raise ValueError("local_prefill_max_tokens and prefill_queue_bound must be >= 0, min_free_kv in [0, 1]")

    @property
    def enabled(self) -> bool:
        return self.local_prefill_max_tokens > 0 or self.prefill_queue_bound > 0


@dataclass(frozen=True)
class Split:
    """Where a splitwise request prefills, and why."""

    local: bool
    """True: on its decode worker (one ``mixed`` task); False: on a prefill worker."""
    reason: str
    """``short_prompt``, ``prefill_busy``, ``no_prefill_worker`` (local); ``off``,
    ``decode_kv_full``, ``long_prompt`` (on P)."""

    @property
    def decision(self) -> str:
        return "local" if self.local else "disaggregated"

    def count(self) -> Split:
        """Counted in ``splitbus_scheduler_disagg_decisions_total``; returns itself."""
        metrics.DISAGG_DECISIONS.labels(self.decision, self.reason).inc()
        return self


def split(
    config: Disaggregation,
    request: GenerateRequest,
    decode: WorkerInfo,
    decode_cached: int,
    prefill_queues: Sequence[int],
    local: Local,
) -> Split:
    """Where ``request`` prefills, given its decode worker, the prompt tokens D holds cached and
    the queued prefill tokens of each live prefill worker that could take it."""
    if not config.enabled:
        return Split(False, "off")
    total = decode.record.load.total_kv_blocks
    left = free_blocks(decode, reserved(local, decode)) - blocks_needed(request, decode.record.block_size)
    if left < config.min_free_kv * total:
        return Split(False, "decode_kv_full")
    if len(request.prompt_token_ids) - decode_cached <= config.local_prefill_max_tokens:
        return Split(True, "short_prompt")
    if not prefill_queues:
        return Split(True, "no_prefill_worker")
    if config.prefill_queue_bound and min(prefill_queues) > config.prefill_queue_bound:
        return Split(True, "prefill_busy")
    return Split(False, "long_prompt")
