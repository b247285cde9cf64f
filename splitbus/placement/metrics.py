"""Prometheus metrics of placement: the KV index and conditional disaggregation. Named
``splitbus_scheduler_*`` as before they moved here: a scheduler replica exposes them, and so does an
API node that places (``--dispatch api``). Also the bound on tenant labels that the API's and the
scheduler's per-tenant metrics share (``TenantLabels``)."""

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
    multiprocess_mode="livemax",  # each API process placing (--dispatch api) keeps its own index of the same workers
)
DISAGG_DECISIONS = Counter(
    "splitbus_scheduler_disagg_decisions_total",
    "splitwise decisions on where a request prefills: decision local (on its decode worker) or disaggregated "
    "(on a prefill worker), by reason (short_prompt, prefill_busy, no_prefill_worker; off, decode_kv_full, "
    "long_prompt).",
    ["decision", "reason"],
)


# Tenants as labels (docs/tenants.md, "Seeing it"). Tenants' names come from the store, which only
# operators write, but a label per name is a series per name for as long as the process runs: the
# first MAX_TENANT_LABELS names seen keep their own label, any later one is counted as OTHER_TENANT.
MAX_TENANT_LABELS = 100
"""Distinct tenant labels one API process (or scheduler) gives; the rest share ``OTHER_TENANT``."""
OTHER_TENANT = "(other)"
"""The label of tenants past ``MAX_TENANT_LABELS``: not a tenant's name (names are letters, digits, ``_.-``)."""
DEFAULT_LABEL = "default"
"""The label of the default tenant (the keys the API was started with, or none), whose name is ""
on the bus."""


class TenantLabels:
    """Bounded tenant labels: a name keeps its own label if it is among the first ``cap`` seen."""

    def __init__(self, cap: int = MAX_TENANT_LABELS) -> None:
        self.cap = cap
        self._seen: set[str] = set()

    def __call__(self, tenant: str) -> str:
        name = tenant or DEFAULT_LABEL
        if name in self._seen:
            return name
        if len(self._seen) >= self.cap:
            return OTHER_TENANT
        self._seen.add(name)
        return name
