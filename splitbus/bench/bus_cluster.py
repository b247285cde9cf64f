"""``splitbus bench bus --redis-cluster N``: the token path on one Redis against a cluster of N.

The token path of ``bench bus`` (engines writing one entry per stream per step through
``ResultWriter``), with the streams split over several API nodes, each a process with its own
``ResultReader`` (one shard: one reader tag), and over ``engines`` writer processes (one by
default; a fleet has many, and one writer alone measures the writer rather than the bus), run
side by side on:

- ``1 primary``: one embedded Redis;
- ``N primaries, hashed tags``: an embedded cluster of N primaries with a replica each, the API
  nodes named ``bench-api-<k>`` and their reader tags left as named (``ResultReader(placed=False)``:
  where such a tag lands is up to CRC16), the comparison;
- ``N primaries, placed tags``: the same cluster, each API node's ``ResultReader`` placing its tag
  itself, as the API does (one ``INCRBY`` for its turn, then a tag on primary ``turn mod N``:
  docs/cluster.md), so the nodes' tags land on distinct primaries.

Each setup reports tokens/s (flat out, median of the runs: every writer's tokens over one window,
from the first writer's first step to the last token read), every primary's share of the
commands it served during the runs (the delta of its ``INFO commandstats``, read as the admin
user; commands a script runs count, as Redis counts them) and commands per token. The issue's
target: the busiest primary's share at most ``1/N + 10 %``.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import redis
from redis.crc import key_slot

from splitbus.bench.bus import _bus_config, _drain_subscriptions, _expect, _in_process, request_id
from splitbus.bus.core import codec
from splitbus.bus.core.connection import connect
from splitbus.bus.results import ResultReader, ResultWriter, shard_name
from splitbus.redis_cluster import ClusterNodeServer, EmbeddedCluster, slot_ranges
from splitbus.redis_server import EmbeddedRedis

API_NODE = "bench-api"
"""API nodes are ``bench-api-<k>``: reader tags ``bench-api-<k>.0`` (hashed), or the first
``bench-api-<k>.0-<j>`` on the node's primary (placed)."""
SPREAD_MARGIN = 0.10
"""The target: the busiest primary serves at most ``1/N`` + this share of the commands."""
MAX_ENGINES = 16
"""The most writer processes a run starts: each is a whole interpreter with its own connections,
and more of them than a host has cores measures their contention, not the bus."""
BARRIER_TIMEOUT_S = 60.0
"""How long a writer waits at the start barrier for the others (spawned processes import the
project first: seconds on a loaded host); past it the run fails rather than hangs."""
STOP_TIMEOUT_S = 5.0
"""How long a run's end waits, in all, for its terminated processes before it kills them."""

Stream = tuple[str, str]
"""A stream an engine writes: (request id, the reader tag that follows it)."""


@dataclass(frozen=True)
class ClusterBenchConfig:
    primaries: int = 3
    """Primaries of the cluster (each with one replica), against one Redis."""
    streams: int = 1000
    """Concurrent result streams, split round-robin over the API nodes and over the engines."""
    steps: int = 40
    """Engine steps, sent flat out (one token per stream per step)."""
    api_nodes: int = 3
    """API processes, each following its streams with one reader shard (one reader tag)."""
    repeat: int = 3
    """Runs per setup: tokens/s is their median, command counts their sum."""
    engines: int = 1
    """Writer processes, each writing its share of the streams; they pass one barrier before
    their first step, so that no writer runs alone."""

    def __post_init__(self) -> None:
        if not 2 <= self.primaries <= 16:
            raise ValueError("--redis-cluster must be between 2 and 16 primaries")
        if min(self.streams, self.steps, self.api_nodes, self.repeat) < 1:
            raise ValueError("streams, steps, API nodes and repeat must be >= 1")
        if self.api_nodes > min(self.streams, 16):
            raise ValueError("API nodes must be at most 16 and at most the number of streams")
        if not 1 <= self.engines <= min(self.streams, MAX_ENGINES):
            raise ValueError(f"--engines must be between 1 and {MAX_ENGINES} and at most the number of streams")


@dataclass(frozen=True)
class Setup:
    """One column of the comparison: where the bus runs and whether the API nodes place their tags."""

    name: str
    url: str
    """The ``splitbus`` user's URL (``redis://`` or ``redis+cluster://``)."""
    placed: bool
    """Whether each API node's ``ResultReader`` places its tag on a primary (on a cluster)."""
    primaries: tuple[Callable[[], redis.Redis], ...]
    """Admin clients of the primaries, in slot order."""
    owner: Callable[[int], int]
    """The primary (index) that serves a slot."""


@dataclass(frozen=True)
class Run:
    tokens: int
    """Tokens the API nodes read, all of them together."""
    seconds: float
    """From the first engine's first step to the last token read."""
    calls: list[dict[str, int]]
    """Per primary: commands served during the run, by name."""
    readers: tuple[str, ...]
    """Each API node's reader tag, as its ``ResultReader`` named its shard."""
    written: int
    """Tokens the engines wrote, all of them together: each should reach a reader."""
    start_spread_us: int
    """From the first engine's first step to the last engine's: how together they started."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


# ---------------------------------------------------------------- roles (child processes)


async def api_node(conn: Any, url: str, prefix: str, name: str, rids: list[str], steps: int, placed: bool) -> tuple:
    """An API process: one reader shard (placed on a primary as the API places it, or hashed)
    follows its streams, one task per request; tells the parent its tag once it follows them."""
    config = _bus_config(url, prefix)
    client = connect(config, max_connections=2)
    reader = ResultReader(config, client, name=name, placed=placed)
    await reader.start()
    subs = [await reader.subscribe(rid) for rid in rids]
    conn.send(("ok", ("ready", reader.names[0])))
    count, last_us, _ = await _drain_subscriptions(subs, steps)
    await reader.close()
    await client.aclose()
    return count, last_us


async def engine(
    conn: Any, url: str, prefix: str, streams: list[Stream], steps: int, start: threading.Barrier
) -> tuple[int, int]:
    """An engine: one entry per (request, reader tag) per step, one ``flush`` per step, once
    every engine has reached ``start``. Its first step's time (µs) and the tokens it wrote."""
    config = _bus_config(url, prefix)
    client = connect(config)
    writer = ResultWriter(client, config)
    for rid, tag in streams:
        writer.open(rid, reader=tag)
    # Blocking the event loop is harmless here (this process has no task yet), and waiting in a
    # thread would add a wake-up of its own to each engine's start.
    start.wait(BARRIER_TIMEOUT_S)
    start_us = codec.now_us()
    for step in range(steps):
        stamp = str(codec.now_us())
        for rid, _ in streams:
            writer.tokens(rid, [step], stamp)
        await writer.flush()
    await client.aclose()
    return start_us, len(streams) * steps


# ---------------------------------------------------------------- one run


def assignment(cfg: ClusterBenchConfig) -> list[list[str]]:
    """The request ids each API node follows: stream ``i`` goes to node ``i mod api_nodes``."""
    return [[request_id(i) for i in range(k, cfg.streams, cfg.api_nodes)] for k in range(cfg.api_nodes)]


def split(streams: list[Stream], engines: int) -> list[list[Stream]]:
    """The streams each engine writes: the ``i``-th goes to engine ``i mod engines`` (so each
    engine writes to every API node's tag when there are streams enough)."""
    return [streams[e::engines] for e in range(engines)]


def run_once(setup: Setup, prefix: str, cfg: ClusterBenchConfig, timeout_s: float = 120) -> Run:
    """Start the API nodes, wait until each follows its streams, run the engines flat out (from
    one barrier), and count what every primary served meanwhile."""
    ctx = mp.get_context("spawn")
    groups = assignment(cfg)
    # Held here until the engines have answered: the barrier's semaphores go when the last
    # reference in this process does, and a spawned engine may open them only later.
    start = ctx.Barrier(cfg.engines)
    procs: list[mp.process.BaseProcess] = []
    try:  # (from the first start: a node that fails to start stops those started before it)
        pipes = _start_api_nodes(ctx, procs, setup, prefix, cfg, groups)
        readers = tuple(_ready(pipe, timeout_s) for pipe in pipes)
        streams = [(rid, readers[k]) for k, rids in enumerate(groups) for rid in rids]
        before = [commandstats(client()) for client in setup.primaries]
        engines = _start_engines(ctx, procs, (setup.url, prefix, cfg.steps), split(streams, cfg.engines), start)
        starts = [_expect(pipe, None, timeout_s) for pipe in engines]
        ends = [_expect(pipe, None, timeout_s) for pipe in pipes]
        after = [commandstats(client()) for client in setup.primaries]
    finally:
        _stop(procs)
    calls = [delta(b, a) for b, a in zip(before, after, strict=True)]
    return _run(starts, ends, calls, readers)


def _run(
    starts: list[tuple[int, int]], ends: list[tuple[int, int]], calls: list[dict[str, int]], readers: tuple[str, ...]
) -> Run:
    """A run from what its engines said (first step's µs, tokens written) and its API nodes
    (tokens read, last read's µs): one window over all of them."""
    first_us, last_us = min(s for s, _ in starts), max(s for s, _ in starts)
    seconds = (max(last for _, last in ends) - first_us) / 1e6
    read, written = sum(n for n, _ in ends), sum(n for _, n in starts)
    if read != written:  # a token lost (or read twice) would pass for the bus's rate
        raise RuntimeError(f"the API nodes read {read} tokens, the engines wrote {written}")
    return Run(read, seconds, calls, readers, written, last_us - first_us)


def _start_api_nodes(
    ctx: Any,
    procs: list[mp.process.BaseProcess],
    setup: Setup,
    prefix: str,
    cfg: ClusterBenchConfig,
    groups: list[list[str]],
) -> list[Any]:
    """One process per API node (appended to ``procs`` as it starts), following its group of
    streams; their pipes."""
    pipes = []
    for name, rids in zip(api_names(cfg), groups, strict=True):
        parent, child = ctx.Pipe()
        args = (api_node, child, setup.url, prefix, name, rids, cfg.steps, setup.placed)
        procs.append(ctx.Process(target=_in_process, args=args))
        pipes.append(parent)
        procs[-1].start()
    return pipes


def _start_engines(
    ctx: Any,
    procs: list[mp.process.BaseProcess],
    where: tuple[str, str, int],
    shares: list[list[Stream]],
    start: threading.Barrier,
) -> list[Any]:
    """One process per share of the streams (appended to ``procs``), all behind ``start`` (a
    barrier for as many); ``where`` is (URL, key prefix, steps). Their pipes."""
    url, prefix, steps = where
    pipes = []
    for streams in shares:
        parent, child = ctx.Pipe()
        procs.append(ctx.Process(target=_in_process, args=(engine, child, url, prefix, streams, steps, start)))
        pipes.append(parent)
        procs[-1].start()
    return pipes


def _stop(procs: list[mp.process.BaseProcess], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Terminate every started process, then join them all within ``timeout_s`` in all and kill
    what is left: a failed run with every process stuck waits once, not once per process."""
    started = [proc for proc in procs if proc.pid is not None]  # (not started: an earlier one failed first)
    for proc in started:
        proc.terminate()
    deadline = time.monotonic() + timeout_s
    for proc in started:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in started:
        if proc.is_alive():
            proc.kill()
            proc.join()


def _ready(pipe: Any, timeout_s: float) -> str:
    """An API node's reader tag, once it follows its streams."""
    what, tag = _expect(pipe, None, timeout_s)
    if what != "ready" or not isinstance(tag, str):
        raise RuntimeError(f"expected an API node's reader tag, got {(what, tag)!r}")
    return tag


def commandstats(client: redis.Redis) -> dict[str, int]:
    """Calls so far by command name (``INFO commandstats``), without the ``INFO`` that asks."""
    info = client.info("commandstats")
    calls = {key.removeprefix("cmdstat_"): int(value["calls"]) for key, value in info.items()}
    calls.pop("info", None)
    return calls


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    diff = {name: calls - before.get(name, 0) for name, calls in after.items()}
    return {name: calls for name, calls in sorted(diff.items()) if calls > 0}


# ---------------------------------------------------------------- setups


def api_names(cfg: ClusterBenchConfig) -> tuple[str, ...]:
    """The API nodes' reader names; each one's shard is ``<name>.0`` unless it places it."""
    return tuple(f"{API_NODE}-{k}" for k in range(cfg.api_nodes))


def hashed_readers(cfg: ClusterBenchConfig) -> tuple[str, ...]:
    """The API nodes' tags left as named: where they land is CRC16's choice."""
    return tuple(shard_name(name, 0) for name in api_names(cfg))


def writers(cfg: ClusterBenchConfig) -> str:
    """How many engines write, as each setup's name ends (the plot's and the table's labels)."""
    return f"{cfg.engines} writer" + ("s" if cfg.engines > 1 else "")


@contextlib.contextmanager
def single_setups(server: EmbeddedRedis, cfg: ClusterBenchConfig) -> Iterator[list[Setup]]:
    """The one-Redis setup on a running server."""
    admin = server.admin_client()
    try:
        yield [Setup(f"1 primary, {writers(cfg)}", server.url, False, (lambda: admin,), lambda slot: 0)]
    finally:
        admin.close()


def cluster_setups(embedded: EmbeddedCluster, cfg: ClusterBenchConfig) -> list[Setup]:
    """The cluster's two setups (hashed tags, placed tags) on a running cluster of ``cfg.primaries``."""
    ranges = slot_ranges(cfg.primaries)
    nodes: list[ClusterNodeServer] = [embedded.primary_of_slot(low) for low, _ in ranges]

    def owner(slot: int) -> int:
        return next(i for i, (low, high) in enumerate(ranges) if low <= slot <= high)

    admins = tuple(node.admin for node in nodes)
    n, w = cfg.primaries, writers(cfg)
    return [
        Setup(f"{n} primaries, hashed tags, {w}", embedded.url, False, admins, owner),
        Setup(f"{n} primaries, placed tags, {w}", embedded.url, True, admins, owner),
    ]


@contextlib.contextmanager
def single_redis(folder: Path, cfg: ClusterBenchConfig) -> Iterator[list[Setup]]:
    with EmbeddedRedis(folder, appendonly=False) as server, single_setups(server, cfg) as setups:
        yield setups


@contextlib.contextmanager
def cluster(folder: Path, cfg: ClusterBenchConfig) -> Iterator[list[Setup]]:
    with EmbeddedCluster(folder, primaries=cfg.primaries, replicas=1, appendonly=False) as embedded:
        yield cluster_setups(embedded, cfg)


# ---------------------------------------------------------------- report


def summarize(setup: Setup, runs: list[Run], engines: int) -> dict[str, Any]:
    primaries = len(setup.primaries)
    by_primary = _by_primary(primaries, runs)
    totals = [sum(calls.values()) for calls in by_primary]
    commands, tokens = sum(totals), sum(run.tokens for run in runs)
    shares = [_ratio(t, commands) for t in totals]
    return {
        "name": setup.name,
        "primaries": primaries,
        "engines": engines,
        "readers": [_reader(setup, tag) for tag in runs[0].readers],
        "runs_primaries": [[_reader(setup, tag)["primary"] for tag in run.readers] for run in runs],
        "tokens_per_s": round(statistics.median(run.tokens_per_s for run in runs), 1),
        "runs_tokens_per_s": [round(run.tokens_per_s, 1) for run in runs],
        "tokens": tokens,
        **_writers(runs),
        "commands": commands,
        "commands_per_token": _ratio(commands, tokens),
        "primary_shares": shares,
        "busiest_share": max(shares),
        "commands_by_primary": by_primary,
    }


def _writers(runs: list[Run]) -> dict[str, Any]:
    """What the engines wrote (all runs), and the widest spread of their starts in one run."""
    return {
        "written": sum(run.written for run in runs),
        "start_spread_ms": round(max(run.start_spread_us for run in runs) / 1000, 3),
    }


def _by_primary(primaries: int, runs: list[Run]) -> list[dict[str, int]]:
    """Each primary's calls by command, all runs summed."""
    return [_sum([run.calls[p] for run in runs]) for p in range(primaries)]


def _ratio(part: int, whole: int) -> float:
    """``part / whole`` to 4 places; 0.0 of nothing."""
    return round(part / whole, 4) if whole else 0.0


def _reader(setup: Setup, tag: str) -> dict[str, Any]:
    """A reader's tag, its slot and the primary that serves that slot."""
    slot = key_slot(tag.encode())
    return {"tag": tag, "slot": slot, "primary": setup.owner(slot)}


def _sum(counts: list[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for calls in counts:
        for name, n in calls.items():
            total[name] = total.get(name, 0) + n
    return dict(sorted(total.items()))


def run_cluster_bench(cfg: ClusterBenchConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    """Every setup, side by side: one Redis, then the cluster (started and stopped here)."""
    report: dict[str, Any] = {
        "config": asdict(cfg),
        "target_busiest_share": round(1 / cfg.primaries + SPREAD_MARGIN, 4),
    }
    results = []
    with tempfile.TemporaryDirectory(prefix="splitbus-bench-cluster-") as data:
        for start in (single_redis, cluster):
            progress(
                "starting " + ("one Redis" if start is single_redis else f"a {cfg.primaries}+{cfg.primaries} cluster")
            )
            with start(Path(data) / start.__name__, cfg) as setups:
                for setup in setups:
                    results.append(summarize(setup, _runs(setup, cfg, progress), cfg.engines))
    report["setups"] = results
    placed = results[-1]
    report["target_met"] = placed["busiest_share"] <= report["target_busiest_share"]
    # The same engines on both: how much the cluster's placed tags carry over one Redis.
    single = results[0]["tokens_per_s"]
    report["placed_over_one_primary"] = round(placed["tokens_per_s"] / single, 3) if single else 0.0
    return report


def _runs(setup: Setup, cfg: ClusterBenchConfig, progress: Callable[[str], None]) -> list[Run]:
    runs = []
    for r in range(cfg.repeat):
        progress(f"{setup.name}: run {r + 1}/{cfg.repeat}")
        runs.append(run_once(setup, f"bench-{uuid.uuid4().hex[:8]}", cfg))
    return runs
