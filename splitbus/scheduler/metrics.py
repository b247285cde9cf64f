"""Prometheus metrics of the scheduler."""

from prometheus_client import Counter, Gauge, Histogram

DISPATCHES = Counter(
    "splitbus_scheduler_dispatches_total",
    "Requests handled, by outcome (dispatched, duplicate, already_acked: acked, or claimed by another replica; "
    "no_worker, deadline).",
    ["outcome"],
)
QUEUE_WAIT = Histogram(
    "splitbus_scheduler_queue_wait_seconds",
    "From the API's XADD to the tasks being written.",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)

KV_EVENTS = Counter(
    "splitbus_scheduler_kv_events_total",
    "Workers' KV event batches (one event id each) and snapshots, by what the index did: applied, gap (an id was "
    "missed: resync), resync (a snapshot loaded), stale (already applied, or awaiting a snapshot).",
    ["status"],
)
KV_OVERLAP_BLOCKS = Histogram(
    "splitbus_scheduler_kv_overlap_blocks",
    "Leading blocks of a request's chain the chosen worker holds, per routing decision.",
    buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096),
)
KV_SILENT_WORKERS = Gauge(
    "splitbus_scheduler_kv_silent_workers",
    "Workers routed to that sent no KV events since, for 10 s or more (events not published: the index is blind).",
)
