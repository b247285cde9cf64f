"""Prometheus metrics of the bus. Labels are stream kinds (``requests``, ``out``, ...), never
key names or request ids, so cardinality stays bounded."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

ENTRIES_PRODUCED = Counter("splitbus_bus_entries_produced_total", "Stream entries written (XADD).", ["stream"])
ENTRIES_CONSUMED = Counter("splitbus_bus_entries_consumed_total", "Stream entries read by consumers.", ["stream"])
ENTRIES_ACKED = Counter("splitbus_bus_entries_acked_total", "Stream entries acknowledged.", ["stream"])
ENTRIES_CLAIMED = Counter(
    "splitbus_bus_entries_claimed_total", "Idle pending entries taken over (XAUTOCLAIM).", ["stream"]
)
ENTRIES_DEAD_LETTERED = Counter(
    "splitbus_bus_entries_dead_lettered_total",
    "Entries moved to the dead-letter stream.",
    ["stream", "reason"],
)
DUPLICATES_DROPPED = Counter(
    "splitbus_bus_duplicates_dropped_total", "Result entries dropped as duplicates by sequence number."
)
PUBLISH_TO_READ = Histogram(
    "splitbus_bus_publish_to_read_seconds",
    "Time from XADD (publisher clock) to a consumer reading the entry.",
    ["stream"],
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
)
REGISTRY_ROWS_REJECTED = Counter(
    "splitbus_bus_registry_rows_rejected_total",
    "Worker records and registry-log entries refused (a field missing, malformed or out of range), by where they were "
    "read (snapshot, log, field): the worker is left out of placement until a good record comes; experts: only its "
    "expert load is dropped.",
    ["source"],
)

DEAD_LETTER_REASONS = ("undecodable", "max_deliveries", "handler_failed", "engine_error", "invalid_task")
