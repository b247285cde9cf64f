from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

from splitbus.bus.core.config import BusConfig
from splitbus.placement import policies
from splitbus.placement.costs import DEFAULT_COST, CacheCost
from splitbus.placement.disagg import Disaggregation
from splitbus.placement.policies.base import PolicyOptions


def default_name() -> str:
    return f"scheduler-{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class SchedulerConfig:
    bus: BusConfig
    mode: str = "splitwise"
    """The routing policy's name (``policies.names()``); ``dp`` with ``stagger`` is ``stagger``."""
    name: str = field(default_factory=default_name)
    """Consumer name in the ``schedulers`` group; stable across restarts of one replica."""
    refresh_s: float = 0.1
    """Age bound of the registry snapshot used for placement."""
    batch: int = 256
    """Requests read per XREADGROUP."""
    no_worker_wait_s: float = 10.0
    """How long a request waits for an eligible worker before its client gets a 503."""
    dispatched_ttl_s: int = 60
    """How long a request's dispatched mark is kept: the window in which a duplicate request entry
    is still found a duplicate (it is only acked). A duplicate exists because an API's XADD was
    retried after its reply was lost (redis-py retries twice, each after up to the 5 s socket
    timeout: ~16 s), and it is dispatched after the original by at most that, plus one replica
    stuck while it holds it (claimed after ``bus.claim_idle_ms``, 30 s; a dead one's after
    ``lease_ms``), plus the wait for a worker (``no_worker_wait_s``, 10 s), plus one claim pass
    and one registry refresh: ~56 s (checked, ``duplicate_window_s``). It matters only once the
    request ended: while it runs, its hand-off id (kept until then) makes any copy a duplicate."""
    lease_ms: int = 2000
    """The replica's lease (``sb:scheduler-lease:{cell}:<name>``): once it has not been renewed for this
    long (the replica died, hung, or lost Redis), the others claim the entries pending with it."""
    heartbeat_s: float = 0.5
    """How often the lease is renewed, by a loop of its own (a slow step does not lose it)."""
    claim_every_s: float = 0.25
    """How often this replica looks for replicas whose lease is gone, and for entries pending
    longer than ``bus.claim_idle_ms`` with any replica (alive but stuck), takes them over and
    places them at once: a request read by a replica that then hung waits at most ``lease_ms``
    + one round (2.25 s)."""
    dead_consumer_keep_s: float = 600.0
    """A replica whose lease is gone and that has nothing pending is deleted from the group once
    it has been idle this long (consumer names carry a pid: restarts would pile them up)."""
    recovery_grace_s: float = 3.0
    """After the Redis server's run changed (a restart or failover: the latest writes may be lost),
    how long this replica dispatches nothing, so that the workers re-assert the dispatches they
    hold first (each looks at every heartbeat, 0.5 s; docs/reliability.md, "Writes Redis loses")."""
    reap_every_s: float = 1.0
    """How often this replica looks for workers whose lease expired, to move their tasks."""
    stagger: bool = True
    """dp and splitwise_dp modes: hold (prefill) arrivals and release them as one batch spread
    over a group's ranks."""
    stagger_max_wait_s: float = 0.5
    """dp and splitwise_dp modes: the longest an arrival is held. The window closes as the group's
    running step ends; this bounds the hold only when a step runs longer (or a rank announced a
    wrong end), so it sits above a long prefill step (docs/dp.md, "Scheduler side")."""

    cost: CacheCost = DEFAULT_COST
    """How a worker's cached prompt tokens weigh against its load (``--overlap-weight``,
    ``--overlap-load-cap``; docs/routing.md, "The cost")."""
    disagg: Disaggregation = Disaggregation()
    """splitwise: when a request prefills on its decode worker (``--local-prefill-max-tokens``,
    ``--prefill-queue-bound``, ``--local-prefill-min-free-kv``; off by default)."""
    max_queued_prefill_tokens: int = 0
    """splitwise, mixed: give a worker a request to prefill only while its queued prefill tokens
    are under this (``--max-queued-prefill-tokens``; 0: no bound). The rest waits here, where
    priority and tenants' fair share order it (``PolicyOptions.max_queued_prefill_tokens``)."""
    kv_events: bool = True
    """Follow the workers' KV events into this replica's index (``--no-kv-events``: place as if no
    worker cached anything)."""

    @property
    def uses_kv_index(self) -> bool:
        """Whether the index is fed: it is read only by a cost that credits cached tokens or by
        conditional disaggregation."""
        return self.kv_events and (self.cost.overlap_weight > 0 or self.disagg.enabled)

    @property
    def policy(self) -> str:
        """The name of the policy this replica places with: ``--mode dp`` staggers unless told not
        to (its meaning since staggering was added), any other mode is its policy's name."""
        return "stagger" if self.mode == "dp" and self.stagger else self.mode

    def policy_options(self) -> PolicyOptions:
        return PolicyOptions(
            replica=self.name,
            stagger_max_wait_s=self.stagger_max_wait_s,
            stagger=self.stagger,
            cost=self.cost,
            disagg=self.disagg,
            max_queued_prefill_tokens=self.max_queued_prefill_tokens,
        )

    def duplicate_window_s(self) -> float:
        """How long after the first copy of a request entry another copy may still be dispatched
        (``dispatched_ttl_s``): the API's XADD retries (3 socket timeouts), a stuck replica's copy
        claimed after ``claim_idle_ms`` (at the next claim pass), then its wait for a worker (seen
        at a registry refresh)."""
        bus = self.bus
        retries_s = 3 * bus.socket_timeout_s
        return retries_s + bus.claim_idle_ms / 1000 + self.claim_every_s + self.no_worker_wait_s + self.refresh_s

    def __post_init__(self) -> None:
        self._check_mode()
        self._check_periods()
        self._check_bound()
        if self.dispatched_ttl_s < self.duplicate_window_s():
            raise ValueError(
                f"dispatched_ttl_s must cover the XADD retries, claim_idle_ms, no_worker_wait_s, one claim pass and"
                f" one refresh ({self.duplicate_window_s():.1f} s): a duplicate request entry held that long"
                " by a stuck replica would be dispatched again"
            )

    def _check_bound(self) -> None:
        if self.max_queued_prefill_tokens < 0:
            raise ValueError("max_queued_prefill_tokens must be >= 0 (0: no bound)")
        if self.max_queued_prefill_tokens and self.mode not in ("splitwise", "mixed"):
            raise ValueError(
                "--max-queued-prefill-tokens bounds single workers' queues: modes splitwise and mixed only"
            )

    def _check_mode(self) -> None:
        if self.mode not in policies.names():
            raise ValueError(f"mode must be one of {tuple(policies.names())}, got {self.mode!r}")
        if self.mode == "stagger" and not self.stagger:
            raise ValueError("--no-stagger contradicts --mode stagger (the naive placement is --mode dp --no-stagger)")

    def _check_periods(self) -> None:
        if self.refresh_s <= 0 or self.no_worker_wait_s <= 0 or self.batch < 1:
            raise ValueError("refresh_s, no_worker_wait_s and batch must be positive")
        if self.heartbeat_s <= 0 or self.lease_ms < self.heartbeat_s * 2000:
            raise ValueError("lease_ms must cover at least two heartbeats (heartbeat_s > 0)")
        if self.recovery_grace_s < 0:
            raise ValueError("recovery_grace_s must be >= 0")
        if self.claim_every_s <= 0 or self.dead_consumer_keep_s < 0:
            raise ValueError("claim_every_s must be positive and dead_consumer_keep_s >= 0")
