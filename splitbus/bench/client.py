"""``splitbus bench client``: the bus's hot Redis operations through each candidate client, side
by side, on one Redis, from one asyncio process on the loop every service runs (``splitbus.aio``).

The clients: redis-py's asyncio client as the bus builds it (``connect()``: the bus's pool of
guarded connections, health checks, retries), the same client bare (``from_url``, redis-py's
parser choice: hiredis where it is installed), bare on redis-py's pure-Python RESP2 parser, and
valkey-glide (a Rust core with asyncio bindings) where it can be imported. Each client holds two
connections: one that writes, and one that blocks in a read so a write can wake it.

The operations, each timed per call at concurrency 1 (a hop's cost, not a throughput):

* ``ping``: ``PING``, the floor of a round trip;
* ``xadd``: a request's ``XADD`` (a 128-token ``generate`` entry on the requests stream, trimmed
  as the producer trims);
* ``wake_xreadgroup`` / ``wake_xread``: from the ``XADD``'s call until the other connection's
  ``XREADGROUP`` (a scheduler taking a request) or ``XREAD`` (an API reader taking a token) returns
  it; each wake waits for the reader to be blocked in Redis first (``INFO clients``);
* ``evalsha``: the worker's ``write_step`` script, one engine step's token entries for
  ``step_streams`` requests of one reader shard;
* ``pipeline``: ``pipeline`` ``XADD`` commands in one non-transactional pipeline (``Producer.send_many``).

Every round runs every client in turn (the order rotated each round) on keys of its own, deleted
after; the reported p50 and p99 pool the rounds' samples. Each round's p50 is kept to show the
spread: ``p50_by_round_us`` in round order, and ``round_p50_us`` their [min, max].

The wakes count Redis's blocked clients (``INFO clients``) to know the reader is blocked: the
Redis measured must be idle, as the embedded one the command starts by default is.
"""

from __future__ import annotations

import asyncio
import importlib
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import unquote, urlparse

import redis.asyncio as aioredis
from redis._parsers import _AsyncRESP2Parser

import splitbus.bus.results  # noqa: F401  (declares write_step, the script the worker publishes tokens with)
from splitbus import aio
from splitbus.bus.core import codec
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.connection import connect
from splitbus.bus.core.keys import SCHEDULER_GROUP, Keys
from splitbus.bus.core.scripts import SCRIPTS
from splitbus.bus.messages import GenerateRequest, SamplingParams
from splitbus.bus.messages.results import TokenDelta

OPS = ("ping", "xadd", "wake_xreadgroup", "wake_xread", "evalsha", "pipeline")
CLIENTS = ("bus-connect", "bus-settings", "redis-py", "redis-py-pure", "glide")
"""``bus-connect``: redis-py as ``splitbus.bus.core.connection.connect`` builds it; ``bus-settings``:
the same connections and settings on redis-py's default pool, which never waits (what the
bus's pool costs beside it); ``redis-py``: bare (``from_url``, RESP2), its parser redis-py's choice;
``redis-py-pure``: bare on the pure-Python RESP2 parser; ``glide``: valkey-glide."""
GLIDE = "glide"
PROMPT_TOKENS = 128
"""As ``bench scheduler``'s requests: the request's JSON is most of what its XADD carries."""
REQUESTS_MAXLEN = 100_000
"""Trimmed as a producer trims its stream (``MAXLEN ~``), so each XADD pays for the trim check."""
BLOCK_MS = 5000
"""A reader's BLOCK: long enough never to end before its wake on a loaded host."""
BLOCKED_WAIT_S = 10.0
ADMIN_TIMEOUT_S = 10.0
"""The admin connection's socket timeout (its INFO, SCAN and DEL): a Redis that stops answering
fails the run instead of hanging it."""
_GROUP = (SCHEDULER_GROUP, "bench")
"""The group and consumer of the XREADGROUP wake."""

Fields = dict[bytes, bytes]


@dataclass(frozen=True)
class ClientBenchConfig:
    """What ``bench client`` runs."""

    rounds: int = 5
    """Rounds; each runs every client in turn, the order rotated, on keys of its own."""
    calls: int = 2000
    """Timed calls of each operation but the wakes, per client and round."""
    wakes: int = 200
    """Timed wake-ups of each read kind per client and round (each waits for its reader to block)."""
    pipeline: int = 32
    """XADDs in one pipeline."""
    step_streams: int = 8
    """Result streams one ``write_step`` call writes (requests of one reader shard in one engine step)."""
    clients: tuple[str, ...] = CLIENTS

    def __post_init__(self) -> None:
        if min(self.rounds, self.calls, self.wakes, self.pipeline, self.step_streams) < 1:
            raise ValueError("rounds, calls, wakes, pipeline and step streams must be >= 1")
        unknown = set(self.clients) - set(CLIENTS)
        if unknown or not self.clients:
            raise ValueError(f"clients are some of {', '.join(CLIENTS)}; not {', '.join(sorted(unknown))}")

    @classmethod
    def quick(cls, clients: tuple[str, ...] = CLIENTS) -> ClientBenchConfig:
        """One small round: checks that it works."""
        return cls(rounds=1, calls=40, wakes=5, pipeline=8, step_streams=4, clients=clients)


class Side(Protocol):
    """One connection of a client, as the bench drives it (replies are awaited, not decoded)."""

    async def ping(self) -> object: ...
    async def xadd(self, key: str, fields: Fields) -> object: ...
    async def xadd_pipeline(self, key: str, fields: Fields, n: int) -> object: ...
    async def evalsha(self, keys: list[str], args: list[bytes]) -> object: ...
    async def create_group(self, key: str, group: str) -> object: ...
    async def xreadgroup(self, key: str, group: str, consumer: str) -> object: ...
    async def xread(self, key: str) -> object: ...
    async def parser(self) -> str: ...
    async def close(self) -> None: ...


class RedisPySide:
    """A redis-py asyncio client: the bus's calls, as the bus makes them (``Producer``,
    ``OrderedWriter``'s ``EVALSHA``, ``GroupConsumer``, the result reader)."""

    def __init__(self, client: aioredis.Redis, source: str) -> None:
        self._client, self._source, self._sha = client, source, ""

    async def ping(self) -> object:
        return await self._client.ping()

    async def xadd(self, key: str, fields: Fields) -> object:
        return await self._client.xadd(key, fields, maxlen=REQUESTS_MAXLEN, approximate=True)  # type: ignore[arg-type]

    async def xadd_pipeline(self, key: str, fields: Fields, n: int) -> object:
        pipe = self._client.pipeline(transaction=False)
        for _ in range(n):
            pipe.xadd(key, fields)  # type: ignore[arg-type]
        return await pipe.execute()

    async def evalsha(self, keys: list[str], args: list[bytes]) -> object:
        if not self._sha:
            self._sha = await self._client.script_load(self._source)
        return await self._client.evalsha(self._sha, len(keys), *keys, *args)

    async def create_group(self, key: str, group: str) -> object:
        return await self._client.xgroup_create(key, group, id="$", mkstream=True)

    async def xreadgroup(self, key: str, group: str, consumer: str) -> object:
        return await self._client.xreadgroup(group, consumer, {key: ">"}, count=1, block=BLOCK_MS)

    async def xread(self, key: str) -> object:
        return await self._client.xread({key: "$"}, count=1, block=BLOCK_MS)

    async def parser(self) -> str:
        """The class that parses this client's replies, read off one of its pool's connections."""
        pool = self._client.connection_pool
        connection = await pool.get_connection()
        try:
            return type(connection._parser).__name__
        finally:
            await pool.release(connection)

    async def close(self) -> None:
        await self._client.aclose()


class GlideSide:
    """A valkey-glide client (RESP2, as the bus's clients speak), making the same calls."""

    def __init__(self, glide: Any, client: Any, source: str) -> None:
        self._glide, self._client, self._script = glide, client, glide.Script(source)

    async def ping(self) -> object:
        return await self._client.ping()

    async def xadd(self, key: str, fields: Fields) -> object:
        trim = self._glide.TrimByMaxLen(exact=False, threshold=REQUESTS_MAXLEN)
        return await self._client.xadd(key, list(fields.items()), self._glide.StreamAddOptions(trim=trim))

    async def xadd_pipeline(self, key: str, fields: Fields, n: int) -> object:
        batch = self._glide.Batch(is_atomic=False)
        for _ in range(n):
            batch.xadd(key, list(fields.items()))
        return await self._client.exec(batch, raise_on_error=True)

    async def evalsha(self, keys: list[str], args: list[bytes]) -> object:
        return await self._client.invoke_script(self._script, keys=keys, args=args)  # EVALSHA, loaded once

    async def create_group(self, key: str, group: str) -> object:
        return await self._client.xgroup_create(key, group, "$", self._glide.StreamGroupOptions(make_stream=True))

    async def xreadgroup(self, key: str, group: str, consumer: str) -> object:
        options = self._glide.StreamReadGroupOptions(block_ms=BLOCK_MS, count=1)
        return await self._client.xreadgroup({key: ">"}, group, consumer, options)

    async def xread(self, key: str) -> object:
        return await self._client.xread({key: "$"}, self._glide.StreamReadOptions(block_ms=BLOCK_MS, count=1))

    async def parser(self) -> str:
        return "glide (Rust)"

    async def close(self) -> None:
        await self._client.close()


def glide_module() -> tuple[Any, str]:
    """valkey-glide's module, or None and why it cannot be measured."""
    try:
        glide = importlib.import_module("glide")  # optional: not a dependency, so not for the type checker
    except ImportError as exc:
        return None, f"not importable ({exc}); pip install valkey-glide, or pass --glide-path"
    return glide, ""


async def open_side(name: str, url: str) -> Side:
    """One connection of the client ``name`` to ``url``."""
    source = SCRIPTS["write_step"].source
    if name == GLIDE:
        return await _open_glide(url, source)
    if name in ("bus-connect", "bus-settings"):
        bus = connect(BusConfig(redis_url=url), name="bench-client")
        if name == "bus-settings":
            plain = on_plain_pool(bus)
            await bus.aclose()  # it made no connection: only its settings were read
            return RedisPySide(plain, source)
        return RedisPySide(bus, source)
    settings: dict[str, Any] = {"protocol": 2}  # as connect(): RESP2 reply shapes
    if name == "redis-py-pure":
        settings["parser_class"] = _AsyncRESP2Parser
    return RedisPySide(aioredis.Redis.from_url(url, **settings), source)


def on_plain_pool(bus: aioredis.Redis) -> aioredis.Redis:
    """A client with ``bus``'s connection class and settings on redis-py's default pool."""
    pool = bus.connection_pool
    kwargs = dict(pool.connection_kwargs)
    plain = aioredis.ConnectionPool(
        connection_class=pool.connection_class, max_connections=pool.max_connections, **kwargs
    )
    return aioredis.Redis.from_pool(plain)


async def _open_glide(url: str, source: str) -> Side:
    glide, why = glide_module()
    if glide is None:
        raise RuntimeError(why)
    parsed = urlparse(url)
    if parsed.scheme != "redis":
        raise ValueError(f"the glide side takes a plain redis:// URL, not {parsed.scheme}://")
    credentials = None
    if parsed.password:
        credentials = glide.ServerCredentials(unquote(parsed.password), unquote(parsed.username or "") or None)
    config = glide.GlideClientConfiguration(
        [glide.NodeAddress(parsed.hostname or "localhost", parsed.port or 6379)],
        credentials=credentials,
        database_id=int(parsed.path.strip("/") or 0),
        protocol=glide.ProtocolVersion.RESP2,
        request_timeout=BLOCK_MS,
    )
    return GlideSide(glide, await glide.GlideClient.create(config), source)


@dataclass(frozen=True)
class _Payload:
    """What the timed calls write: built once, as the bus's writers build theirs."""

    request: Fields
    token_args: list[bytes]

    @classmethod
    def build(cls, step_streams: int) -> _Payload:
        tokens = [t % 50_000 for t in range(PROMPT_TOKENS)]
        request = GenerateRequest("bench-client", "m", tokens, SamplingParams(max_tokens=64), "api", 0)
        token: list[bytes] = []
        for i in range(step_streams):
            kind, data, ts = codec.script_argv(TokenDelta(seq=i, token_ids=[1234], text=" the"))
            token += [kind, data, ts, b"-300"]  # minus: the TTL set only on a stream this entry creates
        return cls(dict(codec.encode(request)), token)


class _Round:
    """One client's measurements in one round, on keys of its own."""

    def __init__(self, writer: Side, reader: Side, admin: aioredis.Redis, config: ClientBenchConfig) -> None:
        self.writer, self.reader, self.admin, self.config = writer, reader, admin, config
        self.keys = Keys(f"bench-client-{uuid.uuid4().hex[:8]}")
        self.payload = _Payload.build(config.step_streams)

    async def run(self) -> dict[str, list[float]]:
        """Each operation's per-call µs."""
        await self._timed(self.config.pipeline, self.ping)  # connections made, scripts loaded: untimed
        await self._timed(2, self.evalsha)
        samples = {op: await self._timed(self.config.calls, getattr(self, op)) for op in ("ping", "xadd")}
        requests, tokens = self.keys.wake("r"), self.keys.out("r", "wake")  # a request stream, a result stream
        await self.writer.create_group(requests, SCHEDULER_GROUP)
        samples["wake_xreadgroup"] = await self._wakes(requests, lambda: self.reader.xreadgroup(requests, *_GROUP))
        samples["wake_xread"] = await self._wakes(tokens, lambda: self.reader.xread(tokens))
        samples["evalsha"] = await self._timed(self.config.calls, self.evalsha)
        samples["pipeline"] = await self._timed(max(1, self.config.calls // self.config.pipeline), self.pipeline)
        return samples

    def ping(self) -> Awaitable[object]:
        return self.writer.ping()

    def xadd(self) -> Awaitable[object]:
        return self.writer.xadd(self.keys.requests, self.payload.request)

    def evalsha(self) -> Awaitable[object]:
        keys = [self.keys.out("r", f"req-{i}") for i in range(self.config.step_streams)]
        return self.writer.evalsha(keys, self.payload.token_args)

    def pipeline(self) -> Awaitable[object]:
        return self.writer.xadd_pipeline(self.keys.requests, self.payload.request, self.config.pipeline)

    async def _timed(self, n: int, call: Callable[[], Awaitable[object]]) -> list[float]:
        samples = []
        for _ in range(n):
            started = time.perf_counter_ns()
            await call()
            samples.append((time.perf_counter_ns() - started) / 1000)
        return samples

    async def _wakes(self, stream: str, read: Callable[[], Awaitable[object]]) -> list[float]:
        return [await self._wake(stream, read) for _ in range(self.config.wakes)]

    async def _wake(self, stream: str, read: Callable[[], Awaitable[object]]) -> float:
        """µs from the XADD's call until the blocked read returns its entry."""
        blocked = await _blocked_clients(self.admin)
        reading = asyncio.ensure_future(read())
        await _until_blocked(self.admin, blocked + 1, reading)
        started = time.perf_counter_ns()
        writing = asyncio.ensure_future(self.writer.xadd(stream, self.payload.request))
        reply = await reading
        elapsed = (time.perf_counter_ns() - started) / 1000
        await writing
        if not reply:
            raise RuntimeError(f"the blocked read on {stream} returned nothing: it timed out before its wake")
        return elapsed

    async def forget(self) -> None:
        async for key in self.admin.scan_iter(match=f"{self.keys.prefix}:*", count=1000):
            await self.admin.delete(key)


async def _blocked_clients(admin: aioredis.Redis) -> int:
    return int((await admin.info("clients"))["blocked_clients"])


async def _until_blocked(admin: aioredis.Redis, count: int, reading: asyncio.Future[object]) -> None:
    """Wait until ``count`` clients are blocked in Redis: the reader's read has arrived. If it does
    not, ``reading`` is cancelled before the error is raised (no read is left pending)."""
    try:
        await _poll_blocked(admin, count, reading)
    except BaseException:
        reading.cancel()
        raise


async def _poll_blocked(admin: aioredis.Redis, count: int, reading: asyncio.Future[object]) -> None:
    deadline = time.monotonic() + BLOCKED_WAIT_S
    while await _blocked_clients(admin) < count:
        if reading.done():
            raise RuntimeError(f"the read returned before it blocked: {reading.result()!r}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the reader did not block within {BLOCKED_WAIT_S:.0f} s")
        await asyncio.sleep(0.0002)


async def _client_round(name: str, url: str, admin: aioredis.Redis, config: ClientBenchConfig) -> dict[str, Any]:
    writer = await open_side(name, url)
    try:
        reader = await open_side(name, url)
    except BaseException:
        await writer.close()
        raise
    measured = _Round(writer, reader, admin, config)
    try:
        samples = await measured.run()
        return {"parser": await writer.parser(), "samples": samples}
    finally:
        await measured.forget()
        await writer.close()
        await reader.close()


async def measure(url: str, config: ClientBenchConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    """Every available client's samples, by operation, pooled over the rounds."""
    names, skipped = _available(config.clients)
    pooled: dict[str, dict[str, Any]] = {
        n: {"parser": "", "ops": {op: [] for op in OPS}, "round_p50": []} for n in names
    }
    admin = aioredis.Redis.from_url(url, protocol=2, socket_timeout=ADMIN_TIMEOUT_S)
    try:
        for r in range(config.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                one = await _client_round(name, url, admin, config)
                _pool(pooled[name], one)
                progress(f"round {r + 1}/{config.rounds}, {name}: " + _brief(one["samples"]))
    finally:
        await admin.aclose()
    return {"clients": {n: _summary(p) for n, p in pooled.items()}, "skipped": skipped}


def _available(clients: tuple[str, ...]) -> tuple[list[str], dict[str, str]]:
    names, skipped = [], {}
    for name in clients:
        why = glide_module()[1] if name == GLIDE else ""
        if why:
            skipped[name] = why
        else:
            names.append(name)
    return names, skipped


def _pool(into: dict[str, Any], one: dict[str, Any]) -> None:
    into["parser"] = one["parser"]
    for op, samples in one["samples"].items():
        into["ops"][op] += samples
    into["round_p50"].append({op: statistics.median(s) for op, s in one["samples"].items()})


def _brief(samples: dict[str, list[float]]) -> str:
    return ", ".join(f"{op} {statistics.median(s):.0f}" for op, s in samples.items()) + " µs p50"


def _summary(pooled: dict[str, Any]) -> dict[str, Any]:
    ops = {}
    for op, samples in pooled["ops"].items():
        per_round = [r[op] for r in pooled["round_p50"]]
        ops[op] = {
            "n": len(samples),
            "p50_us": _quantile(samples, 0.5),
            "p99_us": _quantile(samples, 0.99),
            "round_p50_us": [min(per_round), max(per_round)],
            "p50_by_round_us": per_round,
        }
    return {"parser": pooled["parser"], "ops": ops}


def _quantile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_client_bench(url: str, config: ClientBenchConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    result = aio.run(measure(url, config, progress))
    config_row = asdict(config)
    config_row["clients"] = list(config.clients)
    result["config"] = config_row
    return result


def table(report: dict[str, Any]) -> str:
    clients = report["clients"]
    lines = [f"{'operation':<16}" + "".join(f"{name:>26}" for name in clients)]
    lines.append(f"{'':<16}" + "".join(f"{'p50 / p99 µs':>26}" for _ in clients))
    for op in OPS:
        cells = [f"{c['ops'][op]['p50_us']:,.0f} / {c['ops'][op]['p99_us']:,.0f}" for c in clients.values()]
        lines.append(f"{op:<16}" + "".join(f"{cell:>26}" for cell in cells))
    lines.append(f"{'reply parser':<16}" + "".join(f"{c['parser']:>26}" for c in clients.values()))
    lines += [f"{name}: not measured, {why}" for name, why in report["skipped"].items()]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    from splitbus.bench.report import _pyplot, _save

    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    clients = report["clients"]
    width = 0.8 / max(1, len(clients))
    for ax, quantile in zip(axes, ("p50_us", "p99_us"), strict=True):
        for i, (name, c) in enumerate(clients.items()):
            xs = [j + i * width for j in range(len(OPS))]
            ax.bar(xs, [c["ops"][op][quantile] for op in OPS], width, label=name)
        ax.set_xticks([j + width * (len(clients) - 1) / 2 for j in range(len(OPS))], OPS, rotation=20, fontsize=8)
        ax.set_ylabel(f"{quantile[:3]} µs per call")
        ax.set_title(f"{quantile[:3]}, concurrency 1")
    axes[0].legend(fontsize=8)
    fig.suptitle("splitbus bench client: the bus's hot Redis operations, by client", fontsize=10)
    _save(plt, fig, path, dpi=100)
