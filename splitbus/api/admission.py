"""Early refusal (docs/tenants.md, "Early refusal"): a request the fleet cannot start before its
deadline is refused at admission (503, ``Retry-After``) rather than admitted and left to time out.

The prediction is in requests, from what the registry already carries: the requests ahead of a
new one (the request stream's entries no scheduler has read yet, and those waiting at or reserved
for the live prefill and mixed workers of its model) divided by the rate at which those workers start them (their
``prefills_done`` counters' growth, as an EWMA). The rate is measured only over intervals in which
prefills were done and requests waited at the workers at both ends: a fleet with nothing waiting
runs below its capacity and its rate is the demand's, which would predict a burst's wait too
long; a fleet that did none in an interval is left to its other guards rather than made to
refuse everything. With no measurement
yet (a cold start) nothing is refused.

The queue ahead is priority-blind (the registry counts requests, not their priorities), but the
queues are not: schedulers and workers start a lower priority number first. So a request of
priority p counts only the share of the queue ahead at priority p or earlier, estimated from this
API node's own requests that have not started yet (``Waiting``, ``ahead_at``): the API nodes are
assumed to see similar mixes of priorities. Under overload the lowest priority is refused first.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from splitbus.bus.records import counter_growth
from splitbus.bus.registry import WorkerInfo
from splitbus.bus.roles import Role

PREFILLING = (Role.PREFILL.value, Role.MIXED.value)
"""The roles whose workers start requests (their prefill)."""
MIN_WINDOW_S = 2.0
"""The shortest interval one rate sample spans: a shorter one counts too few prefills to say much."""
EWMA_ALPHA = 0.3
"""The weight of a new sample in the rate: about the last five samples (ten seconds) count."""
MAX_RETRY_AFTER_S = 60
"""The longest ``Retry-After`` a refusal advises: a queue may drain faster than predicted."""


@dataclass(frozen=True)
class Refusal:
    """Why a request is refused: the predicted wait and when to come back."""

    wait_s: float
    retry_after_s: int


def queued_ahead(workers: Iterable[WorkerInfo], model: str, held: int) -> int:
    """The requests a new one for ``model`` waits behind in queues ordered by priority: those a
    scheduler read and holds for a worker (``held``, every model's; a bounded prefill queue leaves
    them there: ``Unplaced.held``) and the waiting and reserved ones of the live workers that
    prefill ``model``. The request stream's unread entries come on top of these whatever the
    priority: the schedulers read them in arrival order (``ApiState.refuse_late``)."""
    return held + sum(
        w.record.load.waiting + w.reserved.reserved_requests
        for w in workers
        if w.alive and w.record.model == model and w.record.role in PREFILLING
    )


def prefills_done(workers: Iterable[WorkerInfo], model: str) -> dict[str, int]:
    """Each live prefilling worker of ``model``'s ``prefills_done`` counter, by worker id."""
    return {
        w.record.worker_id: w.record.load.prefills_done
        for w in workers
        if w.alive and w.record.model == model and w.record.role in PREFILLING
    }


def predicted_wait_s(ahead: int, rate: float | None) -> float | None:
    """How long ``ahead`` requests take to start at ``rate`` per second; None without a rate."""
    if ahead <= 0:
        return 0.0
    if rate is None or rate <= 0:
        return None
    return ahead / rate


def ahead_at(ahead: int, mix: Mapping[int, int], priority: int) -> int:
    """The requests of ``ahead`` that a request of ``priority`` waits behind, with ``mix`` the
    priorities of the requests not started yet as one API node sees them (requests by priority):
    the share at ``priority`` or earlier (a number not larger), rounded up. With none in ``mix``
    the share is 1: every request ahead. An estimate: the queue's own priorities are not
    reported, and ``mix`` is taken to be the fleet's."""
    total = sum(mix.values())
    if total <= 0:
        return ahead
    before = sum(count for p, count in mix.items() if p <= priority)
    return -(-ahead * before // total)  # the ceiling, in integers: exact for any counts


def judge(wait_s: float | None, deadline_s: float) -> Refusal | None:
    """A refusal when the predicted wait passes the deadline; None (admit) otherwise or unknown."""
    if wait_s is None or wait_s <= deadline_s:
        return None
    retry = min(max(math.ceil(wait_s - deadline_s), 1), MAX_RETRY_AFTER_S)
    return Refusal(wait_s, retry)


def ewma(rate: float | None, sample: float, alpha: float = EWMA_ALPHA) -> float:
    """The rate with ``sample`` in (the first sample is the rate)."""
    return sample if rate is None else alpha * sample + (1 - alpha) * rate


@dataclass
class _Model:
    """One model's prefill rate as measured so far."""

    counters: dict[str, int]
    since: float
    busy: bool
    """Whether its workers had requests waiting at the reading that began the window."""
    rate: float | None = None


@dataclass
class PrefillRates:
    """The measured prefill rate of each model's fleet (requests started per second), fed with the
    registry view's rows at the API's registry pace (``observe``)."""

    min_window_s: float = MIN_WINDOW_S
    models: dict[str, _Model] = field(default_factory=dict)

    def observe(self, workers: list[WorkerInfo], now: float) -> None:
        """Take a reading of every model's counters; a model whose window is long enough gets a
        sample when prefills were done in it."""
        for model in {w.record.model for w in workers}:
            busy = queued_ahead(workers, model, 0) > 0
            self._observe(model, prefills_done(workers, model), busy, now)

    def _observe(self, model: str, counters: dict[str, int], busy: bool, now: float) -> None:
        known = self.models.get(model)
        if known is None:
            self.models[model] = _Model(counters, now, busy)
            return
        if now - known.since < self.min_window_s:
            return
        done = counter_growth(known.counters, counters)
        if done > 0 and known.busy and busy:
            known.rate = ewma(known.rate, done / (now - known.since))
        known.counters, known.since, known.busy = counters, now, busy

    def rate(self, model: str) -> float | None:
        """Requests per second ``model``'s fleet started, or None before a measurement."""
        known = self.models.get(model)
        return None if known is None else known.rate


@dataclass
class Waiting:
    """The requests this API node published that have not started yet (no first result: a token
    or a failure), by priority: the mix ``ahead_at`` shares the queue ahead by. Keyed by request
    id, so that ending a request twice (its first result, then its close) counts once, and one
    never added (refused or failed before it was published) counts nothing."""

    priorities: dict[str, int] = field(default_factory=dict)
    """Each request's priority, by request id."""
    mix: Counter[int] = field(default_factory=Counter)
    """How many requests wait at each priority (a priority with none is removed: bounded by the
    requests in flight)."""

    def __len__(self) -> int:
        return len(self.priorities)

    def add(self, request_id: str, priority: int) -> None:
        """A request published (submitted, or placed by this node), its first result not come."""
        if request_id not in self.priorities:
            self.priorities[request_id] = priority
            self.mix[priority] += 1

    def started(self, request_id: str) -> None:
        """The request has its first result, or ended without one: it waits no longer."""
        priority = self.priorities.pop(request_id, None)
        if priority is None:
            return
        self.mix[priority] -= 1
        if self.mix[priority] <= 0:
            del self.mix[priority]
