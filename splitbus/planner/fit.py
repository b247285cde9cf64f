"""The decode step time as a line in the batch size, ``itl(b) = a + c·b``, fitted by least
squares to what the decode workers measured; the batch that meets an ITL target follows."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

MIN_SPREAD = 1.5
"""The largest batch measured must be this many times the smallest for a fit: over a narrower
range the slope is noise."""
_EPSILON = 1e-9
"""Slack for ``floor``: a batch computed as 139.99999999 from decimal inputs is 140."""


@dataclass(frozen=True)
class Point:
    """One decode worker over one interval."""

    batch: float
    """Mean requests per decode step (tokens emitted / steps)."""
    itl_s: float
    """Mean time from one decode step's start to the next's, seconds."""


@dataclass(frozen=True)
class Line:
    """``itl(b) = a + c·b`` (seconds), with ``c > 0``."""

    a: float
    c: float

    def itl_s(self, batch: float) -> float:
        return self.a + self.c * batch

    def batch_at(self, itl_s: float) -> int:
        """The largest batch whose step time is at most ``itl_s`` (0: none)."""
        return max(math.floor((itl_s - self.a) / self.c + _EPSILON), 0)


def fit_line(points: Sequence[Point]) -> Line | None:
    """The least-squares line through ``points``; None when their batches do not spread by
    ``MIN_SPREAD`` or the slope is not positive (a step that gets faster with more requests
    is noise, not a cost)."""
    batches = [p.batch for p in points]
    if not batches or min(batches) <= 0 or max(batches) < MIN_SPREAD * min(batches):
        return None
    mean_b = sum(batches) / len(points)
    mean_t = sum(p.itl_s for p in points) / len(points)
    spread = sum((p.batch - mean_b) ** 2 for p in points)
    c = sum((p.batch - mean_b) * (p.itl_s - mean_t) for p in points) / spread
    return Line(mean_t - c * mean_b, c) if c > 0 else None


def feedback_batch(points: Sequence[Point], itl_slo_s: float) -> int | None:
    """Without a line: the batch the slowest worker should shrink to, in proportion, when it
    misses the target; None when every worker meets it (nothing says how far they could grow)."""
    slowest = max(points, key=lambda p: p.itl_s, default=None)
    if slowest is None or slowest.itl_s <= itl_slo_s:
        return None
    return max(math.floor(slowest.batch * itl_slo_s / slowest.itl_s + _EPSILON), 1)


def largest_met(points: Sequence[Point], itl_s: float) -> Point | None:
    """The point of the largest batch whose step time was at most ``itl_s``: that batch is a lower
    bound for the batch at the target (the line, unmeasured, may allow more); None when none met it."""
    return max((p for p in points if p.itl_s <= itl_s), key=lambda p: p.batch, default=None)
