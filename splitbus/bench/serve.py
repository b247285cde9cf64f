"""``splitbus bench serve``: Poisson arrivals against the HTTP API, streamed, measured per token.

Field names follow vLLM's serving benchmark (``completed``, ``request_throughput``,
``output_throughput``, ``mean_ttft_ms``, ``median_ttft_ms``, ``p99_ttft_ms``, ``mean_itl_ms``,
...), so results compare with what users already run. Without ``--base-url`` it starts
``splitbus up --engine sim`` itself and also drives the same sim engine in-process
(``serve_direct``) on the same trace, to report what the API, bus, scheduler and worker add.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import tempfile
from collections.abc import Callable, Coroutine
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from splitbus.bench.http_client import HttpClient, one_at_a_time
from splitbus.bench.serve_trace import (
    ServeConfig,
    TraceItem,
    Workload,
    cdf_samples,
    replay,
    summarize,
)
from splitbus.bench.workloads import ideal_for, make_items, run_config
from splitbus.bus.core import hopmarks
from splitbus.redis_server import embedded_url

Row = tuple[dict[str, Any], dict[str, list[float]]]
"""A run's summary and its CDF samples."""


async def measure_http(base_url: str, config: ServeConfig, rate: float, api_key: str = "") -> Row:
    from tqdm import tqdm

    items = make_items(config, rate)
    client = HttpClient(base_url, config.model, api_key, config.max_concurrency)
    try:
        with tqdm(total=len(items), desc=f"{rate:g} req/s", unit="req", leave=False, disable=None) as bar:
            results, duration = await replay(client.send, items, config.max_concurrency, bar)
    finally:
        await client.close()
    return with_ideal(summarize(results, duration, dict(config.goodput)), config, items), cdf_samples(results)


def with_ideal(summary: dict[str, Any], config: ServeConfig, items: list[TraceItem]) -> dict[str, Any]:
    """The summary with the workload's ideal prefix hit ratio beside the measured one."""
    return {**summary, "ideal_prefix_hit_ratio": ideal_for(config, items)}


MEMORY_FIELDS = ("redis_used_memory_start_bytes", "redis_used_memory_end_bytes", "redis_memory_per_request_bytes")
"""Redis's ``used_memory`` before and after a run, and their difference per request sent (None
in a run without Redis: the direct path's). The difference is what is still held at the end
(streams in their grace, marks in their window) spread over the requests, not what each request
leaves for good: it shrinks as the run grows longer than those windows."""


def redis_memory(url: str | None) -> int | None:
    """Redis's ``used_memory`` (INFO memory) in bytes; None without a URL, or if Redis does not
    answer it (the embedded Redis gives INFO to its admin user only)."""
    if not url:
        return None
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=3)
    try:
        used = client.info("memory").get("used_memory")
    except redis.RedisError:
        return None
    finally:
        client.close()
    return used if isinstance(used, int) and used >= 0 else None


def measure_memory(redis_url: str | None, measure: Coroutine[Any, Any, Row]) -> Row:
    """Run ``measure`` between two reads of Redis's memory; the row gains the start, the end and
    their difference per request sent (all None where Redis's memory cannot be read)."""
    start = redis_memory(redis_url)
    summary, cdf = asyncio.run(measure)
    end = redis_memory(redis_url)
    requests = max(1, summary["completed"] + summary["failed"])
    per_request = None if start is None or end is None else (end - start) / requests
    return {**summary, **dict(zip(MEMORY_FIELDS, (start, end, per_request), strict=True))}, cdf


def run_serve_bench(
    config: ServeConfig,
    base_url: str | None,
    api_key: str,
    progress: Callable[[str], None],
    redis_url: str | None = None,
) -> dict[str, Any]:
    """Measure ``base_url`` (or a ``splitbus up --engine sim`` started here, against the sim
    engine driven directly) at each rate; Redis's memory through ``redis_url`` (with
    ``base_url``: the deployment's Redis, if given) before and after each run."""
    runs: list[dict[str, Any]] = []
    if base_url:
        check_target(base_url, config.model, api_key)
        for i, rate in enumerate(config.rates):
            progress(f"{base_url}: {rate:g} req/s, {config.workload.dataset} requests")
            row = measure_memory(redis_url, measure_http(base_url, run_config(config, i), rate, api_key))
            runs.append(_run_row("http", base_url, _rate(config, rate), *row))
        return {"config": asdict(config), "target": base_url, "runs": runs}
    if config.policies:
        return compare_policies(config, progress)
    hops: dict[str, dict[str, dict[str, float]]] = {}
    steps: dict[str, list[dict[str, Any]]] = {}
    for first, dispatch in enumerate(config.dispatch):
        hops[dispatch], steps[dispatch] = _measure_stack(config, dispatch, runs, progress, with_direct=first == 0)
    progress("the HTTP floor: the same client and one HTTP server with nothing behind it, 50 requests one at a time")
    floor = measure_http_floor(config.model, config.input_len)
    return {
        "config": asdict(config),
        "target": "splitbus up --engine sim --mixed 1",
        "runs": runs,
        "overhead": overhead(runs),
        "hops_ms": hops[config.dispatch[0]],
        "hops_ms_by_dispatch": hops,
        "hop_steps_us": steps[config.dispatch[0]],
        "hop_steps_us_by_dispatch": steps,
        "http_floor_ttft_ms": floor,
    }


def stack_path(dispatch: str) -> str:
    """A run row's ``path`` for the stack with this dispatch (``splitbus`` for the scheduler's)."""
    return "splitbus" if dispatch == "scheduler" else f"splitbus:{dispatch}"


def _measure_stack(
    config: ServeConfig, dispatch: str, runs: list[dict[str, Any]], progress: Callable[[str], None], with_direct: bool
) -> tuple[dict[str, dict[str, float]], list[dict[str, Any]]]:
    """One ``splitbus up --dispatch DISPATCH``, hop marks on: its hops and their steps
    (``hop_trace.breakdown``), then each rate (after the engine driven directly at that rate,
    with ``with_direct``); rows are added to ``runs``. The i-th rate's requests are drawn with
    seed ``seed + i`` (``run_config``) on both paths: the stack serves every rate, and the same
    prompts again would hit what the earlier rates cached. The marks stay on for the rates (a
    tuple appended at each site, written out before a blocking read)."""
    from splitbus.bench import hop_trace
    from splitbus.bench.serve_direct import measure_direct
    from splitbus.bench.system import LocalSystem

    with tempfile.TemporaryDirectory(prefix="splitbus-marks-") as marks:
        system = LocalSystem("--engine", "sim", "--mixed", "1", "--dispatch", dispatch, environ={hopmarks.ENV: marks})
        admin_url = embedded_url(system.data_dir / "redis", admin=True)
        try:
            model_dir = system.data_dir / "models" / "tiny"
            progress(f"--dispatch {dispatch}: where the time to first token goes: 50 requests one at a time, each step")
            probe = hop_trace.breakdown(
                system.base_url, system.redis_url, Path(marks), config.model, config.input_len, dispatch=dispatch
            )
            hops = asyncio.run(probe)
            for i, rate in enumerate(config.rates):
                fresh = run_config(config, i)
                if with_direct:
                    progress(f"direct (sim engine in-process): {rate:g} req/s, {config.workload.dataset} requests")
                    row = measure_direct(model_dir, fresh, rate)
                    runs.append(_run_row("direct", "in-process", _rate(config, rate), *row))
                progress(f"splitbus --dispatch {dispatch} (API + bus + scheduler + worker): {rate:g} req/s")
                row = measure_memory(admin_url, measure_http(system.base_url, fresh, rate))
                runs.append(_run_row(stack_path(dispatch), system.base_url, _rate(config, rate), *row))
        finally:
            system.stop()
    return hops


VS_DIRECT_HTTP_LEVELS = (1, 16, 64)
"""``--vs-direct-http``'s max concurrencies by default: where the Rust routers' overhead is known."""
WARMUP_REQUESTS = 4
"""Requests each side of ``--vs-direct-http`` serves, untimed, before its first level: the first
requests of a fresh process pay for its imports, connections and first allocations, and only one
side would otherwise pay them inside a level (the side that starts second at each level does not)."""


def run_vs_direct_http(config: ServeConfig, levels: tuple[int, ...], progress: Callable[[str], None]) -> dict[str, Any]:
    """splitbus against the sim engine behind its own HTTP server (``sim_http``), closed loop at
    each max concurrency of ``levels`` (every request at once, ``max_concurrency`` in flight):
    rows ``direct-http`` and ``splitbus[:DISPATCH]``, and an ``overhead`` row per level and
    dispatch with ``"baseline": "direct-http"``. Both sides get the same requests at a level,
    the i-th level's drawn with seed ``seed + i`` (``run_config``), and neither runs while the
    other is measured: the server is stopped before the stack starts. Each side is warmed first
    (``warm_up``). The JSON's ``config`` has the levels; the rates and max concurrency it would
    otherwise show are not used (every request is sent at once, at each level's concurrency)."""
    runs: list[dict[str, Any]] = []
    direct = _measure_direct_http(config, levels, progress)
    runs += direct
    rows: list[dict[str, Any]] = []
    for dispatch in config.dispatch:
        stack = _measure_stack_levels(config, levels, dispatch, progress)
        runs += stack
        rows += [_level_overhead(run, base) for run, base in zip(stack, direct, strict=True)]
    target = "splitbus up --engine sim --mixed 1 vs the sim engine behind its own HTTP server (bench/sim_http.py)"
    return {"config": levels_config(config, levels), "target": target, "runs": runs, "overhead": rows}


def levels_config(config: ServeConfig, levels: tuple[int, ...]) -> dict[str, Any]:
    """``config`` as ``--vs-direct-http`` uses it: its levels, not the rates and max concurrency."""
    row = {k: v for k, v in asdict(config).items() if k not in ("rates", "max_concurrency")}
    return {**row, "vs_direct_http_max_concurrency": list(levels), "warmup_requests": WARMUP_REQUESTS}


def _level_config(config: ServeConfig, i: int, level: int) -> ServeConfig:
    return replace(run_config(config, i), max_concurrency=level)


def warm_up(base_url: str, config: ServeConfig, levels: tuple[int, ...]) -> None:
    """``WARMUP_REQUESTS`` random requests one at a time, not recorded, on a seed no level uses
    (``seed + len(levels)``): nothing they cache is asked for again by a level."""
    spare = replace(run_config(config, len(levels)), num_prompts=WARMUP_REQUESTS, max_concurrency=1)
    measure_memory(None, measure_http(base_url, replace(spare, workload=Workload()), math.inf))


def _measure_direct_http(
    config: ServeConfig, levels: tuple[int, ...], progress: Callable[[str], None]
) -> list[dict[str, Any]]:
    """The sim engine's own HTTP server at each level, over the model ``up`` makes for the sim
    engine (made here, in a folder of its own)."""
    import tempfile

    from splitbus.bench.sim_http import serving

    runs = []
    with (
        tempfile.TemporaryDirectory(prefix="splitbus-sim-http-") as folder,
        serving(_tiny_model(Path(folder)), config.model) as base_url,
    ):
        progress(f"direct-http: {WARMUP_REQUESTS} requests to warm it, not recorded")
        warm_up(base_url, config, levels)
        for i, level in enumerate(levels):
            progress(f"direct-http (the sim engine behind its own HTTP server): max concurrency {level}")
            row = measure_memory(None, measure_http(base_url, _level_config(config, i, level), math.inf))
            runs.append({**_run_row("direct-http", base_url, "inf", *row), "max_concurrency": level})
    return runs


def _tiny_model(folder: Path) -> Path:
    """The model ``splitbus up --engine sim`` serves when given none, written into ``folder``."""
    from splitbus.worker import engines

    model = folder / "tiny"
    model.mkdir()
    engines.get("sim").make_default_model(model)
    return model


def _measure_stack_levels(
    config: ServeConfig, levels: tuple[int, ...], dispatch: str, progress: Callable[[str], None]
) -> list[dict[str, Any]]:
    """One ``splitbus up --dispatch DISPATCH`` at each level."""
    from splitbus.bench.system import LocalSystem

    system = LocalSystem("--engine", "sim", "--mixed", "1", "--dispatch", dispatch)
    admin_url = embedded_url(system.data_dir / "redis", admin=True)
    runs = []
    try:
        progress(f"splitbus --dispatch {dispatch}: {WARMUP_REQUESTS} requests to warm it, not recorded")
        warm_up(system.base_url, config, levels)
        for i, level in enumerate(levels):
            progress(f"splitbus --dispatch {dispatch}: max concurrency {level}")
            row = measure_memory(admin_url, measure_http(system.base_url, _level_config(config, i, level), math.inf))
            runs.append({**_run_row(stack_path(dispatch), system.base_url, "inf", *row), "max_concurrency": level})
    finally:
        system.stop()
    return runs


def _level_overhead(run: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """What the stack added over the HTTP engine at one max concurrency, in ms."""
    head = {"path": run["path"], "baseline": "direct-http", "request_rate": run["request_rate"]}
    return {**head, "max_concurrency": run["max_concurrency"], **added(run, base)}


def policy_up_args(policy: str, up_args: tuple[str, ...]) -> list[str]:
    """``splitbus up``'s arguments for one ``MODE[:ARG...]`` of ``--policy``: the scheduler's
    ``--mode`` and arguments come after the ones ``up`` gives it, so they win."""
    mode, *extra = policy.split(":")
    scheduler = [f"--scheduler-arg={arg}" for arg in ("--mode", mode, *extra)]
    return ["--engine", "sim", *up_args, *scheduler]


def compare_policies(config: ServeConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    """Each policy on its own fresh ``splitbus up`` (an empty cache), the same requests at each
    rate: rows ``splitbus:<policy>``. The run at the i-th rate draws its requests with seed
    ``seed + i`` (``run_config``): one system serves every rate, and the same prompts again would
    find the prefixes its earlier runs cached (a hit ratio over the ideal one)."""
    from splitbus.bench.system import LocalSystem

    runs: list[dict[str, Any]] = []
    for policy in config.policies:
        system = LocalSystem(*policy_up_args(policy, config.up_args))
        admin_url = embedded_url(system.data_dir / "redis", admin=True)
        try:
            for i, rate in enumerate(config.rates):
                progress(f"policy {policy}: {rate:g} req/s, {config.workload.dataset} requests")
                row = measure_memory(admin_url, measure_http(system.base_url, run_config(config, i), rate))
                runs.append(_run_row(f"splitbus:{policy}", system.base_url, _rate(config, rate), *row))
        finally:
            system.stop()
    target = " ".join(["splitbus up --engine sim", *config.up_args])
    return {"config": asdict(config), "target": target, "runs": runs}


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


def _rate(config: ServeConfig, rate: float) -> float | str:
    """A run's ``request_rate`` field: a trace's own times set the rate."""
    if config.workload.dataset == "trace":
        return "trace"
    return "inf" if math.isinf(rate) else rate


def _run_row(
    path: str, target: str, rate: float | str, summary: dict[str, Any], cdf: dict[str, list[float]]
) -> dict[str, Any]:
    return {
        "path": path,
        "target": target,
        "request_rate": rate,
        **dict.fromkeys(MEMORY_FIELDS),
        **summary,
        "cdf_ms": cdf,
    }


OVERHEAD_FIELDS = (
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
"""The latencies an ``overhead`` row gives the difference of, as ``added_<field>``."""


def overhead(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the stack adds over the direct engine, per rate, in ms."""
    direct = {r["request_rate"]: r for r in runs if r["path"] == "direct"}
    return [
        {"path": run["path"], "request_rate": run["request_rate"], **added(run, direct[run["request_rate"]])}
        for run in runs
        if run["path"].startswith("splitbus") and run["request_rate"] in direct
    ]


def added(run: dict[str, Any], base: dict[str, Any]) -> dict[str, float | None]:
    """``run``'s latencies minus ``base``'s (ms), as ``added_<field>``."""
    return {f"added_{f}": _minus(run[f], base[f]) for f in OVERHEAD_FIELDS}


def _p50_p90(values: list[float]) -> dict[str, float]:
    return {"p50": float(np.median(values)), "p90": float(np.percentile(values, 90))}


def measure_http_floor(model: str, prompt_len: int, count: int = 50) -> dict[str, float]:
    """TTFT p50 and p90 (ms) through this benchmark's client and one HTTP server with nothing
    behind it (``splitbus.bench.http_floor``): ``count`` requests one at a time, after
    ``PROBE_WARMUP`` of warm-up, as ``hop_trace.breakdown`` times the stack's."""
    from splitbus.bench.http_floor import serving

    async def ttft_ms(base_url: str) -> list[float]:
        async with contextlib.aclosing(one_at_a_time(base_url, model, prompt_len, count)) as probes:
            return [result.ttft_s * 1000 async for _, result in probes]

    with serving() as base_url:
        return _p50_p90(asyncio.run(ttft_ms(base_url)))


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b
