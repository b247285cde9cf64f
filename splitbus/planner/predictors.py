"""Predictors of the next interval's arrival rate from the rates measured so far. Each is fed
one measurement per interval (``observe``) and says what it expects next (``predict``);
``splitbus bench planner`` measures each one's error, so the default is chosen by data."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

EWMA_ALPHA = 0.3
"""The weight of a new measurement in an EWMA: about the last five intervals count."""


class Predictor(Protocol):
    def observe(self, value: float) -> None:
        """The rate measured over the interval that just ended."""

    def predict(self) -> float:
        """The rate expected over the next interval (0 before any measurement)."""


class Last:
    """The next interval is the last one: follows every change at once, noise included."""

    def __init__(self) -> None:
        self._last = 0.0

    def observe(self, value: float) -> None:
        self._last = value

    def predict(self) -> float:
        return self._last


class Ewma:
    """An exponentially weighted mean: smooth, and late by a few intervals both ways."""

    def __init__(self, alpha: float = EWMA_ALPHA) -> None:
        self._alpha = alpha
        self._mean: float | None = None

    def observe(self, value: float) -> None:
        self._mean = value if self._mean is None else self._alpha * value + (1 - self._alpha) * self._mean

    def predict(self) -> float:
        return 0.0 if self._mean is None else self._mean


class Peak:
    """The larger of the last rate and its EWMA: up within one interval, down over about five
    (a burst is served at once; a lull is not trusted until it lasts)."""

    def __init__(self) -> None:
        self._last = Last()
        self._mean = Ewma()

    def observe(self, value: float) -> None:
        self._last.observe(value)
        self._mean.observe(value)

    def predict(self) -> float:
        return max(self._last.predict(), self._mean.predict())


PREDICTORS: dict[str, Callable[[], Predictor]] = {"last": Last, "ewma": Ewma, "peak": Peak}
"""Every predictor by name: ``splitbus planner --predictor``'s choices."""
