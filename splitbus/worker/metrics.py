"""Prometheus metrics of a worker. Labels are bounded (step kind, finish reason, error code, an
expert's number below ``MAX_EXPERTS``, a weight part): never request ids. Load gauges are read
from the worker when scraped."""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import REGISTRY, Collector

from splitbus.bus.records import MAX_EXPERTS, ExpertLoad

PROMPT_TOKENS = Counter("splitbus_worker_prompt_tokens_total", "Prompt tokens prefilled.")
PROMPT_CACHED_TOKENS = Counter(
    "splitbus_worker_prompt_cached_tokens_total",
    "Of the prompt tokens prefilled, those not computed here: prefix cache hits, and twins' prompts.",
)
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
    "draining": ("splitbus_worker_draining", "1 while the worker drains (takes no new task), else 0."),
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
    "idle_forward_us": (
        "splitbus_worker_dp_idle_forward_seconds",
        "DP ranks: time inside idle forwards (under EP: their exchanges and experts' work for other ranks).",
        1e-6,
    ),
}

EXPERTS = ("splitbus_worker_experts", "MoE workers: experts in each MoE layer of the model (0: a dense model).")
EXPERT_HELD = (
    "splitbus_worker_expert_held",
    "MoE workers: 1 for each expert this worker holds in every MoE layer (expert parallelism: its rank's share).",
)
EXPERT_TOKENS = (
    "splitbus_worker_expert_tokens",
    "MoE workers: tokens each held expert took since the start, every MoE layer's added (expert parallelism: "
    "tokens of every rank of the group).",
)
WEIGHT_BYTES = (
    "splitbus_worker_weight_bytes",
    "MoE workers: bytes of the weights held, by part (dense: attention, embeddings and dense layers; experts: "
    "its experts).",
)


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
        yield from expert_families([e for e in (getattr(load, "experts", None) for load in loads) if e is not None])


def expert_families(loads: list[ExpertLoad]) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """MoE workers: the experts each holds and the tokens they took, by expert (summed over the
    workers of this process), and the bytes of its weights; families without samples for a
    dense model."""
    held, tokens = Tally[int](), Tally[int]()
    for load in loads:
        first, end = load.held[0], min(load.held[1], MAX_EXPERTS)  # the label stays bounded
        for expert, total in zip(range(first, end), load.total, strict=False):
            held[expert] += 1
            tokens[expert] += total
    yield GaugeMetricFamily(*EXPERTS, value=max((load.experts for load in loads), default=0))
    held_family = GaugeMetricFamily(*EXPERT_HELD, labels=["expert"])
    token_family = CounterMetricFamily(*EXPERT_TOKENS, labels=["expert"])
    for expert in sorted(held):
        held_family.add_metric([str(expert)], held[expert])
        token_family.add_metric([str(expert)], tokens[expert])
    weights = GaugeMetricFamily(*WEIGHT_BYTES, labels=["part"])
    for part, index in (("dense", 0), ("experts", 1)) if loads else ():
        weights.add_metric([part], sum(load.weight_bytes[index] for load in loads))
    yield from (held_family, token_family, weights)


_LOADS = LoadCollector()
REGISTRY.register(_LOADS)


def watch_load(load: Callable[[], Any]) -> Callable[[], None]:
    """Report this load at scrapes; returns the function that stops it."""
    _LOADS.loads.append(load)
    return lambda: _LOADS.loads.remove(load)
