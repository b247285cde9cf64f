"""Prometheus metrics of the scheduler process (what placement counts: ``splitbus.placement.metrics``)."""

from collections import Counter as Tally
from collections.abc import Iterable

from prometheus_client import Counter, Gauge, Histogram

from splitbus.placement.metrics import TenantLabels

DISPATCHES = Counter(
    "splitbus_scheduler_dispatches_total",
    "Requests handled, by outcome (dispatched, duplicate, already_acked: acked, or claimed by another replica; "
    "no_worker, deadline; recovering, worker_gone, worker_draining: nothing written, placed again).",
    ["outcome"],
)
TASKS_MOVED = Counter(
    "splitbus_scheduler_tasks_moved_total",
    "Tasks of dead workers (or of workers that gave their lease up: a drain past its bound) the reaper handled, "
    "by outcome: moved (written on a live worker), finished, failed, acked (the request had ended, or moved).",
    ["outcome"],
)
QUEUE_WAIT = Histogram(
    "splitbus_scheduler_queue_wait_seconds",
    "From the API's XADD to the tasks being written.",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
TENANT_QUEUED = Gauge(
    "splitbus_scheduler_tenant_queued_requests",
    "Requests this replica has read and not placed yet (its waiting queue), per tenant (at most "
    "MAX_TENANT_LABELS tenant labels, the rest as (other)).",
    ["tenant"],
)


class QueuedByTenant:
    """``TENANT_QUEUED`` from a waiting queue's tenants: a tenant shown before and waiting no more
    reads 0 (not its last count)."""

    def __init__(self, gauge: Gauge = TENANT_QUEUED, labels: TenantLabels | None = None) -> None:
        self._gauge = gauge
        self._labels = labels or TenantLabels()
        self._shown: set[str] = set()

    def show(self, tenants: Iterable[str]) -> None:
        counts = Tally(map(self._labels, tenants))
        for label in self._shown - counts.keys():
            self._gauge.labels(label).set(0)
        for label, count in counts.items():
            self._gauge.labels(label).set(count)
        self._shown |= counts.keys()
