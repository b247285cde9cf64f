"""``splitbus bench tenants``: one tenant flooding the fleet beside two steady ones (docs/tenants.md,
"The benchmark").

Three tenants send to one ``splitbus up --engine sim`` fleet (one P, one D) through two API nodes,
each request to the nodes in turn: ``a`` floods at ``flood`` times the fleet's capacity, ``b`` and
``c`` send steady traffic at ``steady`` times it each, ``c`` at an earlier priority. Five runs,
each on a fresh fleet (an empty prefix cache, fresh measurements) with the same seeded arrivals
and prompts and the same settings: ``b`` alone, ``c`` alone, ``b`` and ``c`` without ``a``, all
three with the limits on (``a`` held to an ``rps`` limit, early refusal on) and all three with the
limits off (no limit, no early refusal).

The fleet's capacity is the sim engine's: P prefills ``1 / (prefill_us_per_token x
prompt_tokens)`` requests a second (it is the bottleneck by construction: D's steps are ms).
The client classifies every request by what it saw: refused before the first byte (429, 503),
completed, failed after admission (an error status or an error in the stream: its deadline among
them), or lost (admitted, and no end by the request timeout plus a margin).
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import math
import os
import secrets
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from splitbus.bench.http_client import HttpClient
from splitbus.bench.serve_trace import FIRST_TOKEN_ID, LAST_TOKEN_ID, RequestResult

TENANTS = ("a", "b", "c")
"""The flooding tenant, the steady one of the default priority, the steady one ranked earlier."""
RUNS = ("b_alone", "c_alone", "b_and_c", "limits_on", "limits_off")
RUN_TENANTS = {"b_alone": ("b",), "c_alone": ("c",), "b_and_c": ("b", "c"), "limits_on": TENANTS, "limits_off": TENANTS}
"""The tenants each run sends. ``b_and_c`` (no flood) tells what ``a``'s flood adds from what ``c``'s
priority traffic costs ``b`` anyway."""
API_NODES = 2
LOST_MARGIN_S = 20.0
"""A request with no end this long past the request timeout is lost (the API ends every request
by its deadline: an answer, or an error)."""
C_PRIORITY = -1
"""``c``'s tenant priority: earlier than ``a``'s and ``b``'s 0 (lower first, as vLLM)."""


@dataclass(frozen=True)
class TenantsBenchConfig:
    duration_s: float = 30.0
    """Seconds of arrivals in each run."""
    prompt_tokens: int = 256
    """Tokens of every prompt (random printable bytes, fresh for each request)."""
    output_tokens: int = 16
    """``max_tokens`` of every request (``ignore_eos``: each generates all of them)."""
    prefill_us_per_token: float = 400.0
    """The sim engine's prefill cost (``--sim-prefill-us-per-token``): with ``prompt_tokens`` it sets
    the fleet's capacity (``capacity_rps``)."""
    flood: float = 5.0
    """``a``'s request rate, in multiples of the capacity."""
    steady: float = 0.3
    """``b``'s and ``c``'s request rates, each, in multiples of the capacity."""
    a_rps: float = 0.1
    """``a``'s ``rps`` limit in the limits-on run, in multiples of the capacity: what the fleet has
    beyond ``b``'s and ``c``'s 60 %, less a margin (a fleet run near its capacity queues everyone)."""
    queued_prefill_tokens: int = 512
    """The scheduler's ``--max-queued-prefill-tokens`` in every run: P is given requests only while
    it has fewer prompt tokens queued (two prompts), so the backlog waits in the scheduler's queue,
    in its order (priority, tenants' fair share); 0: no bound (the scheduler's default)."""
    prefill_batch_tokens: int = 256
    """The workers' ``--max-prefill-tokens`` (the most prompt tokens one prefill batch takes), in
    every run; 0: the workers' default (4096). A prefill is not pre-empted, so a request of a higher
    priority waits for the batch in progress: one prompt a batch bounds that wait (the sim engine's
    cost is linear in tokens, so bigger batches gain it nothing)."""
    request_timeout_s: float = 10.0
    """The server's ``--request-timeout``: every request's deadline, and what early refusal judges by."""
    seed: int = 0

    def __post_init__(self) -> None:
        numbers = (self.duration_s, self.prefill_us_per_token, self.flood, self.steady, self.a_rps)
        if not all(math.isfinite(v) and v > 0 for v in (*numbers, self.request_timeout_s)):
            raise ValueError("durations, costs, rates and the timeout must be numbers > 0")
        if not 1 <= self.prompt_tokens <= 4096 or not 1 <= self.output_tokens <= 1024:
            raise ValueError("prompt tokens must be 1-4096 and output tokens 1-1024")
        if min(self.queued_prefill_tokens, self.prefill_batch_tokens) < 0:
            raise ValueError("queued prefill tokens and prefill batch tokens must be >= 0 (0: none, the default)")
        if self.steady * 2 + self.a_rps > 1:
            raise ValueError("b's and c's rates and a's limit must add up to at most the capacity")

    @property
    def capacity_rps(self) -> float:
        """Requests a second the fleet's one P prefills, by the sim engine's cost."""
        return 1e6 / (self.prefill_us_per_token * self.prompt_tokens)

    @property
    def a_rps_limit(self) -> float:
        """``a``'s ``rps`` with the limits on, as its tenant record has it."""
        return round(self.a_rps * self.capacity_rps, 3)

    def rate(self, tenant: str) -> float:
        return self.capacity_rps * (self.flood if tenant == "a" else self.steady)


@dataclass(frozen=True)
class Item:
    tenant: str
    arrival_s: float
    prompt_token_ids: list[int]


def make_trace(config: TenantsBenchConfig, tenants: tuple[str, ...]) -> list[Item]:
    """Each tenant's Poisson arrivals over ``duration_s``, seeded by the tenant alone: a tenant's
    requests are the same in every run it is in. In arrival order."""
    items: list[Item] = []
    for tenant in tenants:
        rng = np.random.default_rng([config.seed, TENANTS.index(tenant)])
        at = 0.0
        while (at := at + rng.exponential(1 / config.rate(tenant))) < config.duration_s:
            tokens = rng.integers(FIRST_TOKEN_ID, LAST_TOKEN_ID + 1, config.prompt_tokens).tolist()
            items.append(Item(tenant, at, tokens))
    return sorted(items, key=lambda i: i.arrival_s)


class Outcome(enum.Enum):
    COMPLETED = "completed"
    REFUSED = "refused"
    """429 or 503 before the first byte: never admitted, or admitted to nothing."""
    FAILED = "failed"
    """Admitted, then ended with an error: its deadline passed, among others."""
    LOST = "lost"
    """Admitted, and no end seen by the request timeout plus ``LOST_MARGIN_S``."""
    UNSENT = "unsent"
    """The client could not reach the API (no connection): never admitted, nor refused by it."""


@dataclass
class Sent:
    """One request as the client saw it."""

    tenant: str
    node: int
    arrival_s: float
    outcome: Outcome = Outcome.LOST
    status: int = 0
    code: str = ""
    """The error's ``code`` (``rate_limit_exceeded``, ``overloaded``, ...) or the status's reason."""
    ttft_s: float = 0.0
    output_tokens: int = 0


class Client:
    """Streams completions to the API nodes, each tenant with its own key."""

    def __init__(self, base_urls: list[str], keys: dict[str, str], config: TenantsBenchConfig) -> None:
        import httpx

        timeout = httpx.Timeout(config.request_timeout_s + LOST_MARGIN_S, connect=10)
        limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256)
        self.clients = [httpx.AsyncClient(base_url=u, timeout=timeout, limits=limits) for u in base_urls]
        self.keys, self.config = keys, config

    async def close(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self.clients))

    async def send(self, index: int, item: Item) -> Sent:
        import httpx

        node = index % len(self.clients)
        sent = Sent(item.tenant, node, item.arrival_s)
        body = {
            "model": "tiny",
            "prompt": item.prompt_token_ids,
            "max_tokens": self.config.output_tokens,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream_options": {"include_usage": True},
        }
        headers = {"Authorization": f"Bearer {self.keys[item.tenant]}"}
        started = time.perf_counter()  # TTFT counts from here: the API answers with the first token
        try:
            async with self.clients[node].stream("POST", "/v1/completions", json=body, headers=headers) as response:
                sent.status = response.status_code
                if response.status_code != 200:
                    return refused_or_failed(sent, await response.aread())
                await _relay(sent, response, started)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:  # it never reached the API
            sent.outcome, sent.code = Outcome.UNSENT, type(exc).__name__
        except Exception as exc:  # the client's timeout or a dropped connection: no end seen
            sent.outcome, sent.code = Outcome.LOST, type(exc).__name__
        return sent


REFUSED_503 = ("overloaded", "service_unavailable")
"""The codes of a 503 the API answers at admission (early refusal; Redis or the model's workers
unreachable): nothing was published. A 503 of another code came after admission (the scheduler's
``no_worker``, the reaper's ``worker_died``): a failure."""


def refused_or_failed(sent: Sent, body: bytes) -> Sent:
    """A status before the first byte: a 429, or a 503 of ``REFUSED_503``, is a refusal; anything
    else a failure of an admitted request (the API answers one that failed before its first token
    so)."""
    try:
        sent.code = str(orjson.loads(body)["error"].get("code") or sent.status)
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        sent.code = str(sent.status)
    refused = sent.status == 429 or (sent.status == 503 and sent.code in REFUSED_503)
    sent.outcome = Outcome.REFUSED if refused else Outcome.FAILED
    return sent


async def _relay(sent: Sent, response: Any, started: float) -> None:
    """Read the stream to its end: COMPLETED with ``[DONE]`` and no error; FAILED with an error
    event; LOST when it stops without either."""
    result = RequestResult(ok=False, prompt_tokens=0)
    last = started
    done = False
    async for line in response.aiter_lines():
        done = done or line == "data: [DONE]"
        last = HttpClient._on_line(line, result, started, last)
    sent.ttft_s, sent.output_tokens = result.ttft_s, result.output_tokens
    if result.error:
        sent.outcome, sent.code = Outcome.FAILED, result.error[:80]
    else:
        sent.outcome = Outcome.COMPLETED if done else Outcome.LOST


async def replay(client: Client, trace: list[Item]) -> tuple[list[Sent], float]:
    """Send each item at its arrival time; returns what each came to and the run's wall time."""
    start = time.perf_counter()

    async def one(index: int, item: Item) -> Sent:
        await asyncio.sleep(max(0.0, item.arrival_s - (time.perf_counter() - start)))
        return await client.send(index, item)

    sent = await asyncio.gather(*(one(i, item) for i, item in enumerate(trace)))
    return list(sent), time.perf_counter() - start


def tenant_summary(sent: list[Sent], duration_s: float) -> dict[str, Any]:
    """One tenant's run: counts by outcome, refusals by code, TTFT of the completed ones, output
    tokens a second over the arrivals' duration."""
    done = [s for s in sent if s.outcome is Outcome.COMPLETED]
    return {
        **_counts(sent),
        **_percentiles("ttft", [s.ttft_s * 1000 for s in done]),
        "output_tokens_per_s": sum(s.output_tokens for s in done) / duration_s,
    }


def _counts(sent: list[Sent]) -> dict[str, Any]:
    """How many were sent, came to each outcome, were admitted (not refused: by node too) and
    refused with 429 and with 503; the other outcomes by code."""
    outcomes = Counter(s.outcome for s in sent)
    refused = Counter(s.status for s in sent if s.outcome is Outcome.REFUSED)
    nodes = Counter(s.node for s in sent if s.outcome not in (Outcome.REFUSED, Outcome.UNSENT))
    return {
        "sent": len(sent),
        **{o.value: outcomes[o] for o in Outcome},
        "admitted": len(sent) - outcomes[Outcome.REFUSED] - outcomes[Outcome.UNSENT],
        "refused_429": refused[429],
        "refused_503": refused[503],
        "by_code": _by_code(s for s in sent if s.outcome is not Outcome.COMPLETED),
        "admitted_by_node": [nodes[n] for n in range(API_NODES)],
    }


def _by_code(sent: Iterable[Sent]) -> dict[str, int]:
    """``outcome:code`` -> how many, sorted."""
    codes = Counter(f"{s.outcome.value}:{s.code}" for s in sent)
    return dict(sorted(codes.items()))


def _percentiles(name: str, ms: list[float]) -> dict[str, float | None]:
    """p50 and p99 of ``ms`` (None for none: JSON null, not NaN)."""
    return {f"{name}_p{p}_ms": float(np.percentile(ms, p)) if ms else None for p in (50, 99)}


def limit_share(config: TenantsBenchConfig, trace: list[Item], summary: dict[str, Any]) -> dict[str, float]:
    """How closely the two API nodes held ``a`` to its ``rps`` together: its admitted requests
    against what one exact bucket of that rate admits of the same arrivals (``one_bucket``), and
    against the most any bucket allows over them (``allowed``: its size, one second of requests,
    plus the rate over the time from the first arrival to the last)."""
    times = [i.arrival_s for i in trace if i.tenant == "a"]
    rps = config.a_rps_limit
    allowed = max(rps, 1.0) + rps * (times[-1] - times[0]) if times else 0.0
    exact = one_bucket(times, rps)
    return {
        "rps_limit": rps,
        "allowed": allowed,
        "one_bucket": exact,
        "admitted": summary["admitted"],
        "ratio": summary["admitted"] / exact if exact else 0.0,
    }


def one_bucket(times: list[float], rps: float) -> int:
    """How many of requests arriving at ``times`` (seconds, ascending) one token bucket of ``rps``
    admits, kept as the admission script keeps it (GCRA: the time it is full again; it holds one
    second of requests, at least one; a full bucket takes any request)."""
    per, room = 1 / rps, max(rps, 1.0) / rps
    full_at, admitted = -math.inf, 0
    for now in times:
        base = max(full_at, now)
        if base <= now or base + per - now <= room:
            full_at, admitted = base + per, admitted + 1
    return admitted


@dataclass
class Fleet:
    """One fresh ``splitbus up --engine sim`` and a second API node on its Redis."""

    config: TenantsBenchConfig
    limits: bool
    folder: Path
    keys: dict[str, str] = field(default_factory=lambda: {t: "sb-bench-" + secrets.token_hex(16) for t in TENANTS})
    """Each tenant's API key, fresh for each fleet (its tenants file holds their digests)."""

    def tenants_file(self) -> Path:
        """The three tenants, their keys as digests (the file holds no secret); ``a`` limited
        with the limits on."""
        records: dict[str, Any] = {t: {"keys_sha256": [_sha256(self.keys[t])]} for t in TENANTS}
        records["c"]["priority"] = C_PRIORITY
        if self.limits:
            records["a"]["rps"] = self.config.a_rps_limit
        path = self.folder / ("tenants-on.json" if self.limits else "tenants-off.json")
        path.write_bytes(orjson.dumps({"tenants": records}))
        return path

    def up_args(self) -> list[str]:
        return [
            "--engine",
            "sim",
            "--prefill",
            "1",
            "--decode",
            "1",
            "--request-timeout",
            f"{self.config.request_timeout_s:g}",
            "--tenants-file",
            str(self.tenants_file()),
            f"--worker-arg=--sim-prefill-us-per-token={self.config.prefill_us_per_token:g}",
            f"--scheduler-arg=--max-queued-prefill-tokens={self.config.queued_prefill_tokens}",
            *self.worker_args(),
            *self.api_args(),
        ]

    def worker_args(self) -> list[str]:
        batch = self.config.prefill_batch_tokens
        return [f"--worker-arg=--max-prefill-tokens={batch}"] if batch else []

    def api_args(self) -> list[str]:
        return [] if self.limits else ["--api-arg=--no-early-refusal"]


def _sha256(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _second_api(system: Any, fleet: Fleet) -> tuple[subprocess.Popen[bytes], str]:
    """Another API node on the fleet's Redis (its URL, with a password, in the environment)."""
    from splitbus.bench.api_load import _wait_ready
    from splitbus.redis_server import die_with_parent, free_port

    port = free_port()
    env = {**os.environ, "SPLITBUS_REDIS_URL": system.redis_url, "SPLITBUS_LOG_LEVEL": "WARNING"}
    env.pop("SPLITBUS_PREFIX", None)
    env.pop("SPLITBUS_API_KEYS", None)
    args = ["--request-timeout", f"{fleet.config.request_timeout_s:g}", "--port", str(port)]
    off = [] if fleet.limits else ["--no-early-refusal"]
    model = ["--model", str(system.data_dir / "models" / "tiny"), "--served-model-name", "tiny"]
    cmd = [sys.executable, "-m", "splitbus.cli.main", "api", *model, *args, *off]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, preexec_fn=die_with_parent)
    url = f"http://127.0.0.1:{port}"
    _wait_ready(url)
    return proc, url


def run_once(config: TenantsBenchConfig, run: str, folder: Path) -> tuple[list[Item], list[Sent], float]:
    """One run on a fresh fleet: its trace sent, every request's end awaited."""
    from splitbus.bench.system import LocalSystem

    fleet = Fleet(config, limits=run != "limits_off", folder=folder)
    system = LocalSystem(*fleet.up_args())
    second = None
    try:
        second, url = _second_api(system, fleet)
        trace = make_trace(config, RUN_TENANTS[run])
        client = Client([system.base_url, url], fleet.keys, config)

        async def go() -> tuple[list[Sent], float]:
            try:
                return await replay(client, trace)
            finally:
                await client.close()

        sent, wall = asyncio.run(go())
    finally:
        try:
            _stop(second)
        finally:
            system.stop()
    return trace, sent, wall


def _stop(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM, then SIGKILL after 30 s."""
    if proc is None:
        return
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_tenants_bench(config: TenantsBenchConfig, folder: Path, progress: Callable[[str], None]) -> dict[str, Any]:
    """The five runs, each tenant's summary in each, and the targets."""
    cap = config.capacity_rps
    progress(
        f"capacity {cap:.2f} req/s (one P: {config.prompt_tokens} tokens x {config.prefill_us_per_token:g} us); "
        f"a at {config.rate('a'):.1f} req/s, b and c at {config.rate('b'):.2f} each, {config.duration_s:g} s a run"
    )
    runs: dict[str, Any] = {}
    share: dict[str, float] = {}
    for run in RUNS:
        progress(f"run {run}: a fresh splitbus up --engine sim (1 P, 1 D) and a second API node")
        trace, sent, wall = run_once(config, run, folder)
        runs[run] = {
            "wall_s": wall,
            "tenants": {
                t: tenant_summary([s for s in sent if s.tenant == t], config.duration_s) for t in RUN_TENANTS[run]
            },
        }
        progress(f"run {run}: {_line(runs[run]['tenants'])}")
        if run == "limits_on":
            share = limit_share(config, trace, runs[run]["tenants"]["a"])
    return {
        "config": {**asdict(config), "capacity_rps": cap},
        "target": "splitbus up --engine sim --prefill 1 --decode 1, and a second API node",
        "runs": runs,
        "a_limit_share": share,
        "targets": targets(runs, share),
    }


def _line(tenants: dict[str, Any]) -> str:
    return "; ".join(
        f"{t}: {s['completed']}/{s['sent']} done, {s['refused']} refused, {s['failed']} failed, {s['lost']} lost, "
        f"TTFT p99 {_ms(s['ttft_p99_ms'])}"
        for t, s in tenants.items()
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def _p99_ratio(summary: dict[str, Any], base: dict[str, Any]) -> float:
    """``summary``'s TTFT p99 over ``base``'s (inf when there is none to compare)."""
    return (summary["ttft_p99_ms"] or math.inf) / (base["ttft_p99_ms"] or math.inf)


def targets(runs: dict[str, Any], share: dict[str, float]) -> dict[str, Any]:
    """The issue's targets, each with what was measured and whether it was met."""
    on = runs["limits_on"]["tenants"]
    ratios = {t: _p99_ratio(on[t], runs[f"{t}_alone"]["tenants"][t]) for t in ("b", "c")}
    beside = {t: _p99_ratio(on[t], runs["b_and_c"]["tenants"][t]) for t in ("b", "c")}
    lost = {run: sum(s["lost"] for s in r["tenants"].values()) for run, r in runs.items()}
    return {
        "b_ttft_p99_ratio": {"measured": ratios["b"], "bound": 1.5, "met": ratios["b"] <= 1.5},
        "c_ttft_p99_ratio": {"measured": ratios["c"], "bound": 1.2, "met": ratios["c"] <= 1.2},
        "a_refused_early": {
            "refused": on["a"]["refused"],
            "failed_after_admission": on["a"]["failed"],
            "met": on["a"]["refused"] > 0 and on["a"]["failed"] == 0 and on["a"]["lost"] == 0,
        },
        "zero_lost": {"lost_by_run": lost, "met": not any(lost.values())},
        "limit_across_two_nodes": {"ratio": share.get("ratio"), "met": abs(share.get("ratio", 0) - 1) <= 0.05},
        "ttft_p99_over_no_flood": beside,
    }
