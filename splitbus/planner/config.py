"""The planner's settings (``splitbus planner``'s options)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from splitbus.planner.predictors import PREDICTORS

MAX_WORKERS = 10_000
"""The most workers of one role the planner advises (``Advice`` refuses more)."""


@dataclass(frozen=True)
class PlannerConfig:
    """What the planner sizes for, and how cautiously (docs/planner.md, "Formulas")."""

    ttft_slo_s: float
    """Time to first token each request should meet (``--ttft-slo-ms``)."""
    itl_slo_s: float
    """Mean time between output tokens each request should meet (``--itl-slo-ms``)."""
    interval_s: float = 5.0
    """Seconds between two decisions; the rates are measured over one interval."""
    predictor: str = "last"
    """How the next interval's arrivals are predicted from the measured ones (``PREDICTORS``): the
    last interval's by default, which ``splitbus bench planner`` found best (docs/planner.md)."""
    target_utilization: float = 0.8
    """The busiest a prefill worker is planned to be, even where the TTFT target would allow more:
    a queue near saturation grows with any burst."""
    ttft_reserve: float = 0.1
    """The share of the TTFT target kept for what is not prefill: the bus hops, placement, the
    first token's way back."""
    itl_headroom: float = 0.9
    """The share of the ITL target a decode batch is sized to: the fitted line is a mean."""
    start_delay_s: float = 30.0
    """From asking for a worker to its first request (``--start-delay-s``): a prefill backlog the
    workers serving now clear sooner gets no worker for it (``model.backlog_workers``). 30 s: an 8B
    model's 16 GB of weights loaded from local NVMe, CUDA graphs captured, the worker registered;
    set it to what the fleet's workers take (a cold node, a larger model, take minutes)."""
    scale_down_window_s: float = 30.0
    """A count goes down only to the highest one computed over this many seconds (up at once)."""
    min_workers: int = 0
    """The fewest workers advised for each role."""
    max_workers: int = 1000
    """The most workers advised for each role."""
    fit_window: int = 60
    """Decode measurements (one per decode worker and interval) the ITL line is fitted to."""
    min_busy_s: float = 0.2
    """The least prefill time one measurement of the prefill rate spans (intervals add up until
    they hold it): a few short prompts say little of the rate at real batch sizes."""
    min_decode_steps: int = 20
    """The least decode steps a worker must have run in an interval to give a measurement."""
    model: str = ""
    """Size only the workers serving this model ("": every worker; one model per planner)."""

    def __post_init__(self) -> None:
        for field in fields(self):  # inf passes every bound below, then overflows math.floor
            _require(field.type != "float" or math.isfinite(getattr(self, field.name)), f"{field.name} must be finite")
        for name in ("ttft_slo_s", "itl_slo_s", "interval_s"):
            _require(getattr(self, name) > 0, f"{name} must be > 0")
        _require(self.predictor in PREDICTORS, f"predictor must be one of {sorted(PREDICTORS)}")
        for name in ("target_utilization", "itl_headroom"):
            _require(0 < getattr(self, name) <= 1, f"{name} must be in (0, 1]")
        _require(0 <= self.ttft_reserve < 1, "ttft_reserve must be in [0, 1)")
        _require(
            min(self.scale_down_window_s, self.min_busy_s, self.start_delay_s) >= 0,
            "windows and start_delay_s must be >= 0",
        )
        _require(0 <= self.min_workers <= self.max_workers <= MAX_WORKERS, f"need 0 <= min <= max <= {MAX_WORKERS}")
        _require(self.fit_window >= 2 and self.min_decode_steps >= 1, "fit_window >= 2, min_decode_steps >= 1")

    @property
    def prefill_budget_s(self) -> float:
        """The share of the TTFT target a prompt may spend queued and prefilled (``S``)."""
        return self.ttft_slo_s * (1 - self.ttft_reserve)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
