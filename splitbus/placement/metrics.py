"""Prometheus metrics of placement: the KV index and conditional disaggregation. Named
``splitbus_scheduler_*`` as before they moved here: a scheduler replica exposes them, and so does an
API node that places (``--dispatch api``)."""

from prometheus_client import Counter, Gauge

KV_EVENTS = Counter(
    "splitbus_scheduler_kv_events_total",
    "Workers' KV event batches (one event id each) and snapshots, by what the index did: applied, gap (an id was "
    "missed: resync), resync (a snapshot loaded), stale (already applied, or awaiting a snapshot), overflow (more "
    "blocks than the worker's total_kv_blocks, or larger than such a batch can be: refused, blocks dropped, resync).",
    ["status"],
)
KV_OVERLAP_BLOCKS = Counter(
    "splitbus_scheduler_kv_overlap_blocks",
    "Leading blocks of the request's chain the chosen worker holds, summed over routing decisions.",
)
KV_DECISIONS = Counter(
    "splitbus_scheduler_kv_decisions",
    "Routing decisions by the chosen worker's overlap with the request's chain, in blocks (0, 1-7, 8-63, 64+): "
    "a histogram in blocks, as counters (histograms here measure seconds).",
    ["overlap"],
)
OVERLAP_BUCKETS = ((64, "64+"), (8, "8-63"), (1, "1-7"), (0, "0"))


def overlap_bucket(blocks: int) -> str:
    """The ``overlap`` label of a decision with ``blocks`` blocks of overlap."""
    return next(label for floor, label in OVERLAP_BUCKETS if blocks >= floor)


KV_SILENT_WORKERS = Gauge(
    "splitbus_scheduler_kv_silent_workers",
    "Workers routed to that sent no KV events since, for 10 s or more (events not published: the index is blind).",
)
DISAGG_DECISIONS = Counter(
    "splitbus_scheduler_disagg_decisions_total",
    "splitwise decisions on where a request prefills: decision local (on its decode worker) or disaggregated "
    "(on a prefill worker), by reason (short_prompt, prefill_busy, no_prefill_worker; off, decode_kv_full, "
    "long_prompt).",
    ["decision", "reason"],
)
