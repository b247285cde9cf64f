"""Prometheus metrics of a worker. Labels are bounded (step kind, finish reason, error code):
never request ids. Load gauges are read from the worker when scraped."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import REGISTRY, Collector

PROMPT_TOKENS = Counter("splitbus_worker_prompt_tokens_total", "Prompt tokens prefilled.")
GENERATION_TOKENS = Counter(
    "splitbus_worker_generation_tokens_total", "Tokens generated (prefill's first token included)."
)
REQUESTS_FINISHED = Counter(
    "splitbus_worker_requests_finished_total",
    "Requests that ended on this worker, by finish reason or error code.",
    ["outcome"],
)
ENGINE_STEP = Histogram(
    "splitbus_worker_engine_step_seconds",
    "Duration of one engine call.",
    ["kind"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
KV_TRANSFER = Histogram(
    "splitbus_worker_kv_transfer_seconds",
    "P -> D KV hand-off: export and send, on the prefill worker.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
)
KV_TRANSFER_BYTES = Counter("splitbus_worker_kv_transfer_bytes_total", "KV cache bytes sent to decode workers.")

GAUGES = {
    "running": ("splitbus_worker_requests_running", "Requests decoding or handing off their KV cache."),
    "waiting": ("splitbus_worker_requests_waiting", "Requests queued to prefill or waiting for KV."),
    "queued_prefill_tokens": ("splitbus_worker_queued_prefill_tokens", "Prompt tokens queued to prefill."),
    "free_kv_blocks": ("splitbus_worker_kv_blocks_free", "Free KV cache blocks."),
    "total_kv_blocks": ("splitbus_worker_kv_blocks_capacity", "KV cache blocks in all, free or used."),
}
COUNTERS = {  # field: (name, help, scale)
    "steps": ("splitbus_worker_dp_steps", "DP ranks: group steps taken.", 1),
    "idle_forwards": (
        "splitbus_worker_dp_idle_forwards",
        "DP ranks: idle forwards run so that the group could step.",
        1,
    ),
    "step_time_us": ("splitbus_worker_dp_step_seconds", "DP ranks: time in group steps, barrier wait included.", 1e-6),
    "idle_time_us": ("splitbus_worker_dp_idle_seconds", "DP ranks: time in steps spent on an idle forward.", 1e-6),
    "busy_time_us": (
        "splitbus_worker_dp_busy_seconds",
        "DP ranks: time computing this rank's own prefill or decode.",
        1e-6,
    ),
}


class LoadCollector(Collector):
    """The load as gauges, and the step counters, read at scrape time from the workers of this
    process (one in a deployment; tests may run several, and then they are summed)."""

    def __init__(self) -> None:
        self.loads: list[Callable[[], Any]] = []

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        loads = [load() for load in self.loads]
        for field, (name, doc) in GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=sum(getattr(load, field) for load in loads))
        for field, (name, doc, scale) in COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=scale * sum(getattr(load, field) for load in loads))


_LOADS = LoadCollector()
REGISTRY.register(_LOADS)


def watch_load(load: Callable[[], Any]) -> Callable[[], None]:
    """Report this load at scrapes; returns the function that stops it."""
    _LOADS.loads.append(load)
    return lambda: _LOADS.loads.remove(load)
