"""Prometheus metrics of the API. Labels are bounded: route templates and status codes."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

REQUESTS = Counter("splitbus_api_requests_total", "HTTP requests by route and status.", ["route", "status"])
INFLIGHT = Gauge("splitbus_api_inflight_requests", "Generation requests admitted and not finished.")
TTFT = Histogram("splitbus_api_time_to_first_token_seconds", "Arrival to first token.", buckets=_LATENCY_BUCKETS)
ITL = Histogram(
    "splitbus_api_inter_token_latency_seconds", "Time between consecutive token deltas.", buckets=_LATENCY_BUCKETS
)
E2E = Histogram("splitbus_api_e2e_request_latency_seconds", "Arrival to last entry.", buckets=_LATENCY_BUCKETS)
PROMPT_TOKENS = Counter("splitbus_api_prompt_tokens_total", "Prompt tokens of admitted requests.")
GENERATION_TOKENS = Counter("splitbus_api_generation_tokens_total", "Tokens relayed to clients.")
CANCELLATIONS = Counter("splitbus_api_cancellations_total", "Requests cancelled on the bus, by reason.", ["reason"])
TOKENIZING = Gauge("splitbus_api_tokenizing", "Prompts being tokenized (or waiting for a tokenizer thread).")
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
    "dispatched already); no_worker, recovering, worker_gone (submitted to the schedulers instead).",
    ["outcome"],
)
