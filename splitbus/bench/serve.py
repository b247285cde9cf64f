"""``splitbus bench serve``: Poisson arrivals against the HTTP API, streamed, measured per token.

Field names follow vLLM's serving benchmark (``completed``, ``request_throughput``,
``output_throughput``, ``mean_ttft_ms``, ``median_ttft_ms``, ``p99_ttft_ms``, ``mean_itl_ms``,
...), so results compare with what users already run. Without ``--base-url`` it starts
``splitbus up --engine sim`` itself and also drives the same sim engine in-process
(``serve_direct``) on the same trace, to report what the API, bus, scheduler and worker add.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import orjson

from splitbus.bus.keys import Keys

PERCENTILES = (50, 90, 99)
FIRST_TOKEN_ID, LAST_TOKEN_ID = 32, 126
"""Prompt token ids are drawn from here: printable bytes, present in any byte-level vocabulary."""


@dataclass(frozen=True)
class ServeConfig:
    rates: tuple[float, ...] = (10.0, 25.0, 50.0)
    """Requests per second of the Poisson arrivals, one run each; ``inf`` sends all at once."""
    num_prompts: int = 200
    max_concurrency: int = 512
    input_len: int = 128
    output_len: int = 64
    len_range: float = 0.5
    """Lengths are uniform in [len * (1 - range), len * (1 + range)]."""
    model: str = "tiny"
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.rates or any(r <= 0 for r in self.rates):
            raise ValueError("rates must be > 0 (inf: all at once)")
        if min(self.num_prompts, self.max_concurrency, self.input_len, self.output_len) < 1:
            raise ValueError("num_prompts, max_concurrency, input_len and output_len must be >= 1")
        if not 0 <= self.len_range < 1:
            raise ValueError("len_range must be in [0, 1)")


@dataclass(frozen=True)
class TraceItem:
    arrival_s: float
    prompt_token_ids: list[int]
    max_tokens: int


def make_trace(config: ServeConfig, rate: float) -> list[TraceItem]:
    """Seeded: the same config and rate give the same requests at the same times."""
    rng = np.random.default_rng(config.seed)
    n = config.num_prompts
    gaps = np.zeros(n) if math.isinf(rate) else rng.exponential(1.0 / rate, n)
    arrivals = np.cumsum(gaps) - gaps[0]
    inputs = _lengths(rng, config.input_len, config.len_range, n)
    outputs = _lengths(rng, config.output_len, config.len_range, n)
    return [
        TraceItem(float(a), rng.integers(FIRST_TOKEN_ID, LAST_TOKEN_ID + 1, i).tolist(), int(o))
        for a, i, o in zip(arrivals, inputs, outputs, strict=True)
    ]


def _lengths(rng: np.random.Generator, mean: int, spread: float, n: int) -> np.ndarray:
    return rng.integers(max(1, int(mean * (1 - spread))), int(mean * (1 + spread)) + 1, n)


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds from its send."""

    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    e2el_s: float = 0.0
    error: str = ""


class HttpClient:
    """Streams completions over HTTP, parsing SSE with orjson; one connection per stream."""

    def __init__(self, base_url: str, model: str, api_key: str, max_concurrency: int) -> None:
        import httpx

        limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(base_url=base_url.rstrip("/"), limits=limits, timeout=600, headers=headers)
        self.model = model

    async def close(self) -> None:
        await self._client.aclose()

    async def send(self, item: TraceItem) -> RequestResult:
        body = {
            "model": self.model,
            "prompt": item.prompt_token_ids,
            "max_tokens": item.max_tokens,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream_options": {"include_usage": True},
        }
        result = RequestResult(ok=False, prompt_tokens=len(item.prompt_token_ids))
        started = last = time.perf_counter()
        try:
            async with self._client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                    return result
                async for line in response.aiter_lines():
                    last = self._on_line(line, result, started, last)
        except Exception as exc:  # a failed request is a result, not the end of the run
            result.error = f"{type(exc).__name__}: {exc}"
            return result
        result.e2el_s = time.perf_counter() - started
        result.ok = result.output_tokens > 0 and not result.error
        return result

    @staticmethod
    def _on_line(line: str, result: RequestResult, started: float, last: float) -> float:
        if not line.startswith("data: ") or line == "data: [DONE]":
            return last
        chunk = orjson.loads(line[6:])
        if chunk.get("usage"):
            result.output_tokens = chunk["usage"]["completion_tokens"]
        if "error" in chunk:
            result.error = str(chunk["error"].get("message"))
        if not chunk.get("choices") or not chunk["choices"][0].get("text"):
            return last
        now = time.perf_counter()
        if result.ttft_s == 0.0:
            result.ttft_s = now - started
        else:
            result.itl_s.append(now - last)
        return now


async def replay(
    send: Callable[[TraceItem], Any], trace: list[TraceItem], max_concurrency: int, progress: Any = None
) -> tuple[list[RequestResult], float]:
    """Send the trace at its arrival times, at most ``max_concurrency`` at once; returns the
    results and the run's duration."""
    gate = asyncio.Semaphore(max_concurrency)
    start = time.perf_counter()

    async def one(item: TraceItem) -> RequestResult:
        await asyncio.sleep(max(0.0, item.arrival_s - (time.perf_counter() - start)))
        async with gate:
            result = await send(item)
        if progress is not None:
            progress.update(1)
        return result

    results = await asyncio.gather(*(one(item) for item in trace))
    return list(results), time.perf_counter() - start


def summarize(results: list[RequestResult], duration_s: float) -> dict[str, Any]:
    """vLLM's serving-benchmark fields, from the client's view of each request."""
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    summary: dict[str, Any] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration_s,
        "output_throughput": out_tokens / duration_s,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s,
    }
    tpot = [(r.e2el_s - r.ttft_s) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    series = {
        "ttft": [r.ttft_s for r in done],
        "tpot": tpot,
        "itl": [g for r in done for g in r.itl_s],
        "e2el": [r.e2el_s for r in done],
    }
    for name, values in series.items():
        summary.update(_stats(name, values))
    errors = sorted({r.error for r in results if r.error})
    if errors:
        summary["errors"] = errors[:5]
    return summary


def _stats(name: str, seconds: list[float]) -> dict[str, float | None]:
    """Mean, median, std and percentiles in ms; None when nothing was measured (JSON null,
    not NaN)."""
    keys = [f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms", *(f"p{p}_{name}_ms" for p in PERCENTILES)]
    if not seconds:
        return dict.fromkeys(keys)
    ms = np.array(seconds) * 1000
    values = [np.mean(ms), np.median(ms), np.std(ms), *(np.percentile(ms, p) for p in PERCENTILES)]
    return {k: float(v) for k, v in zip(keys, values, strict=True)}


def cdf_samples(results: list[RequestResult], points: int = 200) -> dict[str, list[float]]:
    """Quantiles of TTFT, ITL and E2EL in ms, for the plot's CDFs (the JSON stays small)."""
    done = [r for r in results if r.ok]
    series = {
        "ttft": [r.ttft_s for r in done],
        "itl": [g for r in done for g in r.itl_s],
        "e2el": [r.e2el_s for r in done],
    }
    qs = np.linspace(0, 100, points)
    return {k: (np.percentile(np.array(v) * 1000, qs).round(3).tolist() if v else []) for k, v in series.items()}


async def measure_http(
    base_url: str, config: ServeConfig, rate: float, api_key: str = ""
) -> tuple[dict[str, Any], dict[str, list[float]]]:
    from tqdm import tqdm

    client = HttpClient(base_url, config.model, api_key, config.max_concurrency)
    try:
        with tqdm(total=config.num_prompts, desc=f"{rate:g} req/s", unit="req", leave=False, disable=None) as bar:
            results, duration = await replay(client.send, make_trace(config, rate), config.max_concurrency, bar)
    finally:
        await client.close()
    return summarize(results, duration), cdf_samples(results)


def run_serve_bench(
    config: ServeConfig, base_url: str | None, api_key: str, progress: Callable[[str], None]
) -> dict[str, Any]:
    """Measure ``base_url`` (or a ``splitbus up --engine sim`` started here, against the sim
    engine driven directly) at each rate."""
    runs: list[dict[str, Any]] = []
    if base_url:
        check_target(base_url, config.model, api_key)
        for rate in config.rates:
            progress(f"{base_url}: {rate:g} req/s, {config.num_prompts} requests")
            runs.append(_run_row("http", base_url, rate, *asyncio.run(measure_http(base_url, config, rate, api_key))))
        return {"config": asdict(config), "target": base_url, "runs": runs}
    from splitbus.bench.serve_direct import measure_direct
    from splitbus.bench.system import LocalSystem

    system = LocalSystem("--engine", "sim", "--mixed", "1")
    try:
        model_dir = system.data_dir / "models" / "tiny"
        progress("where the time to first token goes: 50 requests one at a time, timed at each hop")
        hops = asyncio.run(hop_breakdown(system.base_url, system.redis_url, config.model, config.input_len))
        for rate in config.rates:
            progress(f"direct (sim engine in-process): {rate:g} req/s, {config.num_prompts} requests")
            runs.append(_run_row("direct", "in-process", rate, *measure_direct(model_dir, config, rate)))
            progress(f"splitbus (API + bus + scheduler + worker): {rate:g} req/s")
            runs.append(
                _run_row("splitbus", system.base_url, rate, *asyncio.run(measure_http(system.base_url, config, rate)))
            )
    finally:
        system.stop()
    return {
        "config": asdict(config),
        "target": "splitbus up --engine sim --mixed 1",
        "runs": runs,
        "overhead": overhead(runs),
        "hops_ms": hops,
    }


class TargetError(Exception):
    """The deployment to measure cannot be reached, or does not serve the model."""


def check_target(base_url: str, model: str, api_key: str) -> None:
    """Fail at once, saying why, rather than report a run in which every request failed."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{base_url.rstrip('/')}/v1/models", headers=headers, timeout=10)
    except httpx.HTTPError as exc:
        raise TargetError(f"cannot reach {base_url}: {exc}") from None
    if response.status_code != 200:
        raise TargetError(f"{base_url}/v1/models answered HTTP {response.status_code}: {response.text[:200]}")
    served = [m.get("id") for m in response.json().get("data", [])]
    if model not in served:
        raise TargetError(f"{base_url} does not serve model {model!r} (it serves {served}); pass --model")


def _run_row(
    path: str, target: str, rate: float, summary: dict[str, Any], cdf: dict[str, list[float]]
) -> dict[str, Any]:
    return {
        "path": path,
        "target": target,
        "request_rate": "inf" if math.isinf(rate) else rate,
        **summary,
        "cdf_ms": cdf,
    }


def overhead(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the stack adds over the direct engine, per rate, in ms."""
    fields = (
        "mean_ttft_ms",
        "median_ttft_ms",
        "p99_ttft_ms",
        "mean_tpot_ms",
        "median_tpot_ms",
        "p99_tpot_ms",
        "mean_itl_ms",
        "median_itl_ms",
        "p99_itl_ms",
    )
    direct = {r["request_rate"]: r for r in runs if r["path"] == "direct"}
    rows = []
    for run in (r for r in runs if r["path"] == "splitbus" and r["request_rate"] in direct):
        base = direct[run["request_rate"]]
        rows.append({"request_rate": run["request_rate"], **{f"added_{f}": _minus(run[f], base[f]) for f in fields}})
    return rows


HOPS = (
    "client send -> request XADD",
    "request XADD -> task XADD",
    "task XADD -> first token XADD",
    "first token XADD -> client",
    "TTFT",
)


async def hop_breakdown(
    base_url: str, redis_url: str, model: str, prompt_len: int, count: int = 50
) -> dict[str, dict[str, float]]:
    """Requests one at a time (an idle system), each timed at every hop by the ``ts`` that its
    request, task and first result entries carry (one machine, one clock)."""
    import redis.asyncio as aioredis

    r = aioredis.Redis.from_url(redis_url)
    client = HttpClient(base_url, model, "", 1)
    rows = []
    try:
        for i in range(count):
            item = TraceItem(0.0, [FIRST_TOKEN_ID + i % 50] * prompt_len, 2)
            sent = time.time()
            result = await client.send(item)
            rows.append(await _hops(r, sent, result))
            await asyncio.sleep(0.02)
    finally:
        await client.close()
        await r.aclose()
    rows = rows[5:]  # warm-up
    return {
        name: {
            "p50": float(np.median([row[k] for row in rows])),
            "p90": float(np.percentile([row[k] for row in rows], 90)),
        }
        for k, name in enumerate(HOPS)
    }


async def _hops(r: Any, sent: float, result: RequestResult) -> list[float]:
    keys = Keys()  # the system the benchmark started uses the default prefix
    request = await r.xrevrange(keys.requests, count=1)
    workers = [w.decode() for w in await r.zrange(keys.workers, 0, -1)]
    tasks = [e for w in workers for e in await r.xrevrange(keys.tasks(w), count=1)]
    request_ts, task_ts = int(request[0][1][b"ts"]) / 1e6, max(int(e[1][b"ts"]) for e in tasks) / 1e6
    request_id = orjson.loads(request[0][1][b"data"])["request_id"]
    token_ts = int((await r.xrange(keys.out(request_id), count=1))[0][1][b"ts"]) / 1e6
    first = sent + result.ttft_s
    return [
        (request_ts - sent) * 1000,
        (task_ts - request_ts) * 1000,
        (token_ts - task_ts) * 1000,
        (first - token_ts) * 1000,
        result.ttft_s * 1000,
    ]


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b
