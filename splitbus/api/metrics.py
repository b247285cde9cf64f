"""Prometheus metrics of the API. Labels are bounded: route templates, status codes, reasons, and
tenants' names (``splitbus.placement.metrics.TenantLabels``: at most ``MAX_TENANT_LABELS``).

An API in N processes (``--workers N``) keeps them in prometheus_client's multiprocess mode: each
process writes its values to files in a folder the parent made (``shared_across_processes``), and
/metrics, in whichever process a scrape reaches, serves them all summed (``exposition_registry``).
Each gauge says how its processes' values combine (``multiprocess_mode``)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.multiprocess import MultiProcessCollector

from splitbus.placement.metrics import TenantLabels

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

REQUESTS = Counter("splitbus_api_requests_total", "HTTP requests by route and status.", ["route", "status"])
INFLIGHT = Gauge(
    "splitbus_api_inflight_requests", "Generation requests admitted and not finished.", multiprocess_mode="livesum"
)
TTFT = Histogram("splitbus_api_time_to_first_token_seconds", "Arrival to first token.", buckets=_LATENCY_BUCKETS)
ITL = Histogram(
    "splitbus_api_inter_token_latency_seconds", "Time between consecutive token deltas.", buckets=_LATENCY_BUCKETS
)
E2E = Histogram("splitbus_api_e2e_request_latency_seconds", "Arrival to last entry.", buckets=_LATENCY_BUCKETS)
PROMPT_TOKENS = Counter("splitbus_api_prompt_tokens_total", "Prompt tokens of admitted requests.")
GENERATION_TOKENS = Counter("splitbus_api_generation_tokens_total", "Tokens relayed to clients.")
CANCELLATIONS = Counter("splitbus_api_cancellations_total", "Requests cancelled on the bus, by reason.", ["reason"])
TOKENIZING = Gauge(
    "splitbus_api_tokenizing",
    "Prompts being tokenized (or waiting for a tokenizer thread).",
    multiprocess_mode="livesum",
)
BODY_REJECTED = Counter(
    "splitbus_api_body_reads_rejected_total",
    "Requests refused (429) because too many bodies were being read.",
    ["size"],
)
CONNECTIONS_CLOSED = Counter(
    "splitbus_api_connections_closed_total",
    "Connections the API closed before reading a request: headers too slow, too large, or a body too slow.",
    ["reason"],
)
DISPATCHES = Counter(
    "splitbus_api_dispatches_total",
    "Requests this API node placed itself (--dispatch api), by outcome: dispatched; duplicate (its id was "
    "dispatched already); no_worker, recovering, worker_gone, worker_draining (submitted to the schedulers instead).",
    ["outcome"],
)

# Per tenant (docs/tenants.md, "Seeing it"): labels bounded by ``TenantLabels``.
REFUSALS_LOG_EVERY_S = 10.0
"""The refusals of one reason are logged at most this often (a flooding tenant sends thousands)."""

TENANT_REQUESTS = Counter(
    "splitbus_api_tenant_requests_total",
    "Generation requests (a response of n choices is one) per tenant, by outcome: admitted (published to "
    "the bus); refused before the first byte: requests, tokens (its rate limits), concurrency (429), "
    "body_reads (429: too many bodies were being received), inflight, backlog (429: the API's own bounds), "
    "unavailable (503: Redis could not take it), no_worker (503: no live worker serves its model), "
    "overloaded (503: the queue ahead was predicted to outlast its timeout).",
    ["tenant", "outcome"],
)
TENANT_PROMPT_TOKENS = Counter(
    "splitbus_api_tenant_prompt_tokens_total", "Prompt tokens of admitted requests, per tenant.", ["tenant"]
)
TENANT_GENERATION_TOKENS = Counter(
    "splitbus_api_tenant_generation_tokens_total", "Tokens relayed to clients, per tenant.", ["tenant"]
)
TENANT_TTFT = Histogram(
    "splitbus_api_tenant_time_to_first_token_seconds",
    "Arrival to first token, per tenant.",
    ["tenant"],
    buckets=_LATENCY_BUCKETS,
)


TENANT_LABEL = TenantLabels()


class Refusals:
    """Requests refused before their first byte, per tenant and reason: counted, and logged once
    per reason per ``REFUSALS_LOG_EVERY_S`` (with how many, and of how many tenants), as the
    connection guard logs its closes."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.unlogged: dict[str, set[str]] = {}
        self.counts: dict[str, int] = {}
        self.logged_at: dict[str, float] = {}

    def add(self, tenant: str, reason: str, why: str) -> None:
        """One request of ``tenant`` refused for ``reason`` (a ``TENANT_REQUESTS`` outcome); ``why``
        says it in the log."""
        TENANT_REQUESTS.labels(TENANT_LABEL(tenant), reason).inc()
        self.unlogged.setdefault(reason, set()).add(TENANT_LABEL(tenant))
        self.counts[reason] = self.counts.get(reason, 0) + 1
        now = self._clock()
        if now - self.logged_at.get(reason, -REFUSALS_LOG_EVERY_S) >= REFUSALS_LOG_EVERY_S:
            self._log(reason, why, now)

    def _log(self, reason: str, why: str, now: float) -> None:
        count, tenants = self.counts.pop(reason), sorted(self.unlogged.pop(reason))
        self.logged_at[reason] = now
        shown = ", ".join(tenants[:5]) + (f" and {len(tenants) - 5} more" if len(tenants) > 5 else "")
        log.warning("refused %d request%s (%s) %s; tenants: %s", count, "" if count == 1 else "s", reason, why, shown)


REFUSALS = Refusals()


def admitted(tenant: str, prompt_tokens: int) -> None:
    """A response of ``tenant`` was published to the bus, its prompt of ``prompt_tokens``."""
    label = TENANT_LABEL(tenant)
    TENANT_REQUESTS.labels(label, "admitted").inc()
    TENANT_PROMPT_TOKENS.labels(label).inc(prompt_tokens)


MULTIPROCESS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
"""Where prometheus_client's multiprocess mode keeps the values (read once, when it is imported)."""


@contextlib.contextmanager
def shared_across_processes() -> Iterator[str]:
    """A private, empty folder (mode 0700) in ``MULTIPROCESS_DIR_ENV`` while the processes that
    read it are started and run: they inherit it from this environment (``spawn`` starts each
    with it, before it imports prometheus_client). Removed, and the variable put back, after."""
    folder = tempfile.mkdtemp(prefix="splitbus-api-metrics-")
    previous = os.environ.get(MULTIPROCESS_DIR_ENV)
    os.environ[MULTIPROCESS_DIR_ENV] = folder
    try:
        yield folder
    finally:
        if previous is None:
            os.environ.pop(MULTIPROCESS_DIR_ENV, None)
        else:
            os.environ[MULTIPROCESS_DIR_ENV] = previous
        shutil.rmtree(folder, ignore_errors=True)


def exposition_registry() -> CollectorRegistry:
    """What /metrics serves: this process's registry, or in multiprocess mode (the folder set)
    every process's values, combined, read at each scrape. (That registry has no ``process_*``
    or ``python_*`` metrics: they describe one process.)"""
    if not os.environ.get(MULTIPROCESS_DIR_ENV):
        return REGISTRY
    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    return registry
