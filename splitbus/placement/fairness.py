"""The order of a scheduler's waiting queue: priority, then tenants' weighted fair share of prompt
tokens, then arrival (docs/routing.md, "The waiting queue"). Pure logic: the scheduler keeps the
state (``ServedTokens``) and passes it in.

Fair share is start-time fair queueing on prompt tokens: each request of a priority gets a
virtual start, its tenant's served tokens (decayed) over the tenant's weight, at least the
virtual time (the start of the request dispatched last), plus the tokens of that tenant's
requests ahead of it in the queue over its weight; the least first. A tenant with a deep
backlog has its later requests' starts pushed far ahead, so one request of a tenant with a
trickle (little served, nothing ahead) goes before them, and over a backlog two tenants of
weights 2 and 1 get prompt tokens 2:1. Prompt tokens, not requests, because prefill is what the
queue waits for (a tenant of long prompts must not take more by sending fewer).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import groupby
from typing import TypeVar

from splitbus.bus.core.streams import entry_order
from splitbus.bus.messages import GenerateRequest
from splitbus.placement.decision import Waiting

T = TypeVar("T")
DEFAULT_WEIGHT = 1.0
"""A tenant's weight when none is given."""
MIN_WEIGHT = 1e-3
"""The smallest weight counted: a weight of 0 or below (a bad store entry) is this, not a division by 0."""
HALF_LIFE_S = 30.0
"""How fast served tokens are forgotten: a tenant's share counts its recent traffic (the last
minute or so), so a tenant that was busy an hour ago is not behind now, and the state stays bounded."""
DECAY_EVERY_S = 0.1
"""Served tokens are decayed at most this often (a 0.2 % error at a 30 s half-life): not at every
dispatch, which would rebuild the table thousands of times a second."""
FORGET_BELOW = 1.0
"""Served tokens under this are forgotten (the tenant's entry is dropped)."""
MAX_TENANTS = 4096
"""Most tenants whose served tokens are kept: past it the least served are forgotten (a bound on
names read from the bus, which are untrusted)."""


def fair_order(
    items: Sequence[T],
    tenant: Callable[[T], str],
    tokens: Callable[[T], int],
    served: Mapping[str, float],
    weights: Mapping[str, float],
    floor: float = 0.0,
) -> list[T]:
    """``items`` (of one priority, in arrival order) by virtual start: the tenant's ``served``
    tokens over its weight (``weights``, else ``DEFAULT_WEIGHT``), at least ``floor`` (the
    virtual time: ``ServedTokens.floor``), plus its tokens ahead in ``items`` over its weight;
    ties in arrival order."""
    ahead: dict[str, float] = {}
    starts: list[float] = []
    for item in items:
        name = tenant(item)
        weight = _weight(weights, name)
        start = ahead.get(name, max(served.get(name, 0.0) / weight, floor))
        ahead[name] = start + tokens(item) / weight
        starts.append(start)
    return [items[i] for i in sorted(range(len(items)), key=starts.__getitem__)]  # sorted is stable


def _weight(weights: Mapping[str, float], name: str) -> float:
    return max(weights.get(name, DEFAULT_WEIGHT), MIN_WEIGHT)


def queue_order(
    items: Sequence[T],
    priority: Callable[[T], int],
    tenant: Callable[[T], str],
    tokens: Callable[[T], int],
    served: Mapping[str, float],
    weights: Mapping[str, float],
    floor: float = 0.0,
) -> list[T]:
    """``items`` (in arrival order) by priority (lower first, as vLLM's), then by fair share
    among those of one priority (``fair_order``), then by arrival."""
    by_priority = sorted(items, key=priority)
    return [
        item
        for _, level in groupby(by_priority, key=priority)
        for item in fair_order(list(level), tenant, tokens, served, weights, floor)
    ]


@dataclass
class ServedTokens:
    """Prompt tokens dispatched per tenant, halved every ``half_life_s``: the ``served`` of
    ``fair_order``, as one scheduler replica saw it (replicas each keep their own: each orders
    only the queue it holds)."""

    half_life_s: float = HALF_LIFE_S
    tokens: dict[str, float] = field(default_factory=dict)
    at: float | None = None
    """When ``tokens`` were last decayed (monotonic seconds)."""
    floor: float = 0.0
    """The virtual time: the virtual start of the request dispatched last. A tenant's requests
    start no earlier (``fair_order``), so a tenant that comes back, or comes new, after others
    were served takes its share from now on, instead of everything until it has caught up with
    their past (start-time fair queueing's virtual time)."""

    def charge(self, tenant: str, tokens: int, now: float, weight: float = DEFAULT_WEIGHT) -> None:
        """Count ``tokens`` served to ``tenant`` (of ``weight``) at ``now``: its request started at
        its virtual start, which the virtual time moves to."""
        self.decayed(now)
        weight = max(weight, MIN_WEIGHT)
        start = max(self.tokens.get(tenant, 0.0) / weight, self.floor)
        self.floor = start
        self.tokens[tenant] = start * weight + tokens
        if len(self.tokens) > MAX_TENANTS:  # the least served other than this one: it comes back at the floor
            del self.tokens[min((t for t in self.tokens if t != tenant), key=self.tokens.__getitem__)]

    def decayed(self, now: float) -> Mapping[str, float]:
        """The served tokens as of ``now``; entries decayed under ``FORGET_BELOW`` are dropped."""
        if self.at is None:
            self.at = now
        elif now - self.at >= DECAY_EVERY_S:  # a clock that went back decays nothing
            factor = 0.5 ** ((now - self.at) / self.half_life_s)
            kept = {name: value * factor for name, value in self.tokens.items()}
            self.tokens = {name: value for name, value in kept.items() if value >= FORGET_BELOW}
            self.floor *= factor
            self.at = now
        return self.tokens


def priority_of(waiting: Waiting) -> int:
    """A waiting entry's priority (0 for an entry that is not a request: it is dropped when decided)."""
    request = waiting.delivery.message
    return request.priority if isinstance(request, GenerateRequest) else 0


def tenant_of(waiting: Waiting) -> str:
    request = waiting.delivery.message
    return request.tenant if isinstance(request, GenerateRequest) else ""


def prompt_tokens(waiting: Waiting) -> int:
    request = waiting.delivery.message
    return len(request.prompt_token_ids) if isinstance(request, GenerateRequest) else 0


def waiting_order(
    waiting: Sequence[Waiting], served: Mapping[str, float], weights: Mapping[str, float], floor: float = 0.0
) -> list[Waiting]:
    """A scheduler's waiting entries in the order it decides them (``queue_order``), arrival being
    the order of their entry ids in the requests stream."""
    arrived = sorted(waiting, key=lambda w: entry_order(w.delivery.entry_id))
    return queue_order(arrived, priority_of, tenant_of, prompt_tokens, served, weights, floor)
