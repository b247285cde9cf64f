"""Prometheus metrics of the scheduler process (what placement counts: ``splitbus.placement.metrics``)."""

from prometheus_client import Counter, Histogram

DISPATCHES = Counter(
    "splitbus_scheduler_dispatches_total",
    "Requests handled, by outcome (dispatched, duplicate, already_acked: acked, or claimed by another replica; "
    "no_worker, deadline; recovering, worker_gone: nothing written, placed again).",
    ["outcome"],
)
QUEUE_WAIT = Histogram(
    "splitbus_scheduler_queue_wait_seconds",
    "From the API's XADD to the tasks being written.",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
