"""The planner's advice, ``sb:planner:{cell}``: a hash the planner writes every interval (the
prefill and decode counts it advises, why, and the figures they come from) and whoever acts on
it reads (``splitbus up --autoscale``, dashboards through the planner's gauges). It expires three
intervals after it was written: a planner that stopped leaves no advice, and actors hold.

Whoever can write the cell's keys can forge it, so a reader checks every field
(``Advice.from_hash``): counts within ``MAX_ADVISED``, reasons from ``Reason``, figures finite and
not negative. Redis is imported for types only: the planner's pure core takes ``Reason`` from here
and loads no client."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from splitbus.bus.core.errors import DecodeError
from splitbus.bus.core.keys import Keys
from splitbus.bus.roles import Word

if TYPE_CHECKING:
    import redis.asyncio as aioredis

MAX_ADVISED = 10_000
"""The most workers (or groups) of one role an advice may name."""
MAX_INTERVAL_MS = 3_600_000
"""The longest interval an advice may say it was computed over (an hour)."""
MAX_MS = 2**53
"""The latest time an advice may carry (exact in a float, as every bus time)."""
TTL_INTERVALS = 3
"""An advice lives this many intervals after it was written."""
MAX_VALUE_CHARS = 32
"""Longer than any field's valid value: a longer one is refused before it is parsed."""
_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")
_INT = re.compile(r"[0-9]{1,16}")
_FIGURE = re.compile(r"[0-9]+(?:\.[0-9]*)?(?:e[-+]?[0-9]+)?")


class Reason(Word):
    """What set a role's advised count."""

    MEASURING = "measuring"
    """Not measured yet (the first interval, or no work of the kind done): the current count."""
    SLO = "slo"
    """The predicted arrivals at the target's utilization (prefill) or concurrency (decode)."""
    BACKLOG = "backlog"
    """What waits now: its clearing within the target needs more than the arrivals do."""
    KV_BOUND = "kv_bound"
    """Decode: the KV cache, not the ITL target, bounds the batch."""
    SLO_UNREACHABLE = "slo_unreachable"
    """One request alone misses the target: more workers would not help; the current count."""
    HELD = "held"
    """Kept above what was computed: a count goes down only after the window (or decode has no
    measure of the batch at the target yet)."""


@dataclass(frozen=True)
class Advice:
    """One interval's advice, as the hash holds it (its fields, by name)."""

    at_ms: int
    """When it was computed (the Redis server's clock, ms)."""
    interval_ms: int
    predictor: str
    """The arrival predictor's name."""
    arrivals_rps: float
    """Arrivals measured over the last interval, requests/s."""
    predicted_rps: float
    """Arrivals predicted for the next, requests/s: what the counts are sized for."""
    prompt_tokens: float
    hit_ratio: float
    output_tokens: float
    prefill_tokens_per_s: float | None
    """Uncached prompt tokens one prefill worker computes per second ("" in the hash: unmeasured)."""
    batch_at_slo: int | None
    """Requests per decode worker planned for ("" in the hash: unknown)."""
    desired_prefill: int
    desired_decode: int
    groups_prefill: int
    """DP groups advised (= workers for solo workers)."""
    groups_decode: int
    actual_prefill: int
    """Live workers, not draining, when it was computed."""
    actual_decode: int
    draining_prefill: int
    draining_decode: int
    reason_prefill: Reason
    reason_decode: Reason

    def desired(self, role: str) -> int:
        """The workers advised for ``role`` (``prefill`` or ``decode``)."""
        return int(getattr(self, f"desired_{role}"))

    def to_hash(self) -> dict[str, str]:
        return {name: _field_text(getattr(self, name)) for name in FIELDS}

    @classmethod
    def from_hash(cls, raw: Mapping[str, str]) -> Advice:
        """The advice a hash holds; ``DecodeError`` naming the field when one is missing, too long,
        of the wrong form or out of its range (other fields are ignored)."""
        values: dict[str, Any] = {}
        for name in FIELDS:
            if name not in raw:
                raise DecodeError(f"planner advice: missing {name}")
            if not isinstance(raw[name], str) or len(raw[name]) > MAX_VALUE_CHARS:
                raise DecodeError(f"planner advice: {name} is not a short string")
            values[name] = _parse(name, raw[name])
        return cls(**values)


FIELDS = tuple(f.name for f in dataclasses.fields(Advice))
"""The hash's fields, in order."""


def _field_text(value: object) -> str:
    if value is None:
        return ""
    return repr(value) if isinstance(value, float) else str(value)


def _parse(name: str, text: str) -> object:
    try:
        return _PARSERS.get(name, _count)(text)
    except ValueError as exc:
        raise DecodeError(f"planner advice: {name} {exc}, got {text!r}") from None


def _int(text: str, high: int) -> int:
    if _INT.fullmatch(text) is None or int(text) > high:
        raise ValueError(f"must be an integer in [0, {high}]")
    return int(text)


def _count(text: str) -> int:
    return _int(text, MAX_ADVISED)


def _figure(text: str, high: float = math.inf) -> float:
    # Digits only: float() would take " 1", "1_0", "nan" and "inf" too.
    value = float(text) if _FIGURE.fullmatch(text) else math.nan
    if not (math.isfinite(value) and value <= high):
        raise ValueError(f"must be a finite number in [0, {high}]")
    return value


def _optional_figure(text: str) -> float | None:
    return None if text == "" else _figure(text)


def _optional_count(text: str) -> int | None:
    return None if text == "" else _count(text)


def _name(text: str) -> str:
    if _NAME.fullmatch(text) is None:
        raise ValueError("must be a lowercase name")
    return text


def _reason(text: str) -> Reason:
    try:
        return Reason(text)
    except ValueError:
        raise ValueError(f"must be one of {[r.value for r in Reason]}") from None


_PARSERS: dict[str, Callable[[str], Any]] = {
    "at_ms": lambda text: _int(text, MAX_MS),
    "interval_ms": lambda text: max(_int(text, MAX_INTERVAL_MS), 1),
    "predictor": _name,
    "arrivals_rps": _figure,
    "predicted_rps": _figure,
    "prompt_tokens": _figure,
    "hit_ratio": lambda text: _figure(text, 1.0),
    "output_tokens": _figure,
    "prefill_tokens_per_s": _optional_figure,
    "batch_at_slo": _optional_count,
    "reason_prefill": _reason,
    "reason_decode": _reason,
}
"""How each field is read; every other field is a worker count (``_count``)."""


async def publish(client: aioredis.Redis, keys: Keys, advice: Advice) -> None:
    """Write the advice and its expiry (``TTL_INTERVALS`` intervals) in one round trip."""
    pipe = client.pipeline(transaction=False)
    pipe.hset(keys.planner, mapping=advice.to_hash())  # type: ignore[arg-type]  # str values: what hset takes
    pipe.pexpire(keys.planner, TTL_INTERVALS * advice.interval_ms)
    await pipe.execute()


class ReadsHash(Protocol):
    """A sync client (``up``'s autoscaler): what ``read_advice`` needs of it."""

    def hgetall(self, name: str) -> object: ...


def read_advice(client: ReadsHash, keys: Keys) -> Advice | None:
    """The current advice, on a sync client; None when there is none (no planner, or it stopped
    more than three intervals ago). ``DecodeError`` for a hash that is not a sane advice."""
    raw = client.hgetall(keys.planner)
    if not isinstance(raw, dict) or not raw:
        return None
    return Advice.from_hash({_text(name): _text(value) for name, value in raw.items()})


def _text(value: object) -> str:
    if isinstance(value, bytes):
        if len(value) > 4 * MAX_VALUE_CHARS:  # before decoding: a forged hash may hold megabytes
            return "\ufffd" * (MAX_VALUE_CHARS + 1)
        return value.decode(errors="replace")
    return str(value)
