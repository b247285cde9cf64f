"""Prometheus metrics of the planner (``splitbus planner --metrics-port``): what it advises per
role, what it sees, and how often each count went up or down. A Kubernetes autoscaler (or KEDA)
scales on ``splitbus_planner_desired_workers`` (docs/planner.md)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from splitbus.bus.roles import ROLES
from splitbus.planner.core import SIZED, Decision, Reading

DESIRED_WORKERS = Gauge(
    "splitbus_planner_desired_workers", "Workers the planner advises, per role (DP ranks for a grouped role).", ["role"]
)
DESIRED_GROUPS = Gauge(
    "splitbus_planner_desired_groups", "DP groups the planner advises, per role (= workers for solo ones).", ["role"]
)
ACTUAL_WORKERS = Gauge("splitbus_planner_actual_workers", "Live workers not draining, per role.", ["role"])
DRAINING_WORKERS = Gauge("splitbus_planner_draining_workers", "Live workers draining, per role.", ["role"])
WAITING_REQUESTS = Gauge(
    "splitbus_planner_waiting_requests",
    "Requests waiting at the workers or reserved for them (tasks not taken yet), per role.",
    ["role"],
)
UNPLACED_REQUESTS = Gauge(
    "splitbus_planner_unplaced_requests", "Requests no scheduler has placed yet: unread in the request stream, or held."
)
ARRIVALS = Gauge(
    "splitbus_planner_arrival_requests_per_second",
    "Requests that arrived per second over the last interval (started, plus growth of those not started).",
)
PREDICTED = Gauge(
    "splitbus_planner_predicted_requests_per_second", "Requests per second predicted for the next interval."
)
HIT_RATIO = Gauge("splitbus_planner_prefix_hit_ratio", "Share of prompt tokens served from the prefix cache (EWMA).")
DECISIONS = Counter(
    "splitbus_planner_decisions",
    "Decisions per role by direction of the advised count: up, down or same.",
    ["role", "direction"],
)


def show(decision: Decision, reading: Reading, before: Decision | None) -> None:
    """Set every gauge from one interval's decision and the reading it came from."""
    for role in SIZED:
        sizing = decision.sizing(role)
        DESIRED_WORKERS.labels(role).set(sizing.desired)
        DESIRED_GROUPS.labels(role).set(sizing.groups)
        ACTUAL_WORKERS.labels(role).set(sizing.actual)
        DRAINING_WORKERS.labels(role).set(sizing.draining)
        DECISIONS.labels(role, _direction(sizing.desired, before.sizing(role).desired if before else None)).inc()
    for role in ROLES:
        WAITING_REQUESTS.labels(role).set(_waiting(reading, role))
    UNPLACED_REQUESTS.set(reading.unread + reading.held)
    ARRIVALS.set(decision.arrivals_rps)
    PREDICTED.set(decision.predicted_rps)
    HIT_RATIO.set(decision.hit_ratio)


def _waiting(reading: Reading, role: str) -> int:
    return sum(w.load.waiting + w.reserved.reserved_requests for w in reading.of_role(role))


def _direction(now: int, before: int | None) -> str:
    if before is None or now == before:
        return "same"
    return "up" if now > before else "down"
