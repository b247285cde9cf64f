"""kill -9 a Redis Cluster primary while 50 completions stream through `splitbus up --engine sim`
(one prefill, one decode) on a 3+3 loopback cluster of the test's own (`cluster-node-timeout`
1000 ms): once its replica takes over, every admitted request completes with its exact stream.

Two victims: the primary of the control plane's slot (the cell tag ``main``: requests, task
streams, registry, leases) and a primary that holds only result streams (the API reader shard's
tag). Each run prints and records the outage: from the ``kill -9`` to the first write that slot
accepts again, and the longest pause in the token path (docs/reliability.md, "What a primary
failover costs")."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest
import redis

from splitbus.bus.core.keys import Keys
from splitbus.bus.results import shard_name
from splitbus.redis_cluster import EmbeddedCluster
from splitbus.worker.engines.sim import sim_text
from tests.e2e.conftest import System, start_system, stop_system

STREAMS = 50
TOKENS = 150
"""At 20 ms per decode step a stream takes ~3 s: longer than the ~2.5 s failover."""
FIRST_SEED = 900
LATE = STREAMS
"""The index (seed) of the request sent at the kill."""
LOSS_NOTE = (
    "A stream cut short, or a 504 after DEADLINE_S, after a failover is an entry the killed primary had "
    "acknowledged but not yet sent to its replica (replication is asynchronous) that the parts did not "
    're-publish (docs/reliability.md, "Writes Redis loses"). An error naming a part (a KV hand-off, a dead '
    "worker) is the bus's own handling of the failover. The parts' log:\n"
)
Record = Callable[[str, object], None]
"""pytest's ``record_property``."""
DEADLINE_S = 40
"""``--request-timeout``: a stream that lost an entry ends with a 504 after this, instead of the
default 600 s, so the test can name it."""


@dataclass
class Stream:
    """What one client saw: its text and when each chunk came (``time.monotonic``)."""

    text: str = ""
    chunks: list[float] = field(default_factory=list)
    error: str | None = None


@dataclass(frozen=True)
class Run:
    """One run through a kill."""

    seen: list[Stream]
    """The admitted streams, in request order (request i has seed ``FIRST_SEED + i``)."""
    late: Stream
    """The request sent at the kill (seed ``FIRST_SEED + LATE``)."""
    killed_at: float
    running: int
    """Streams not yet finished at the kill."""


@dataclass
class Probe:
    """Writes to one slot from the kill on, until one is accepted: the outage of that slot."""

    client: redis.RedisCluster
    key: str
    accepted_at: float | None = None

    def run(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            try:
                self.client.set(self.key, "probe")
                self.accepted_at = time.monotonic()
                return
            except redis.RedisError:
                time.sleep(0.02)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[EmbeddedCluster]:
    running = EmbeddedCluster(tmp_path / "cluster", primaries=3, replicas=1, node_timeout_ms=1000)
    running.start()
    try:
        yield running
    finally:
        running.stop()


def _up(tmp_path: Path, cluster: EmbeddedCluster) -> System:
    return start_system(
        tmp_path / "up",
        "--request-timeout",
        str(DEADLINE_S),
        "--worker-arg=--sim-decode-step-ms",
        "--worker-arg=20",
        "--api-workers",  # one API node: _reader_tag reads its id from the banner
        "1",
        environ={"SPLITBUS_REDIS_URL": cluster.url},
    )


async def _one(client: openai.AsyncOpenAI, i: int, seen: Stream, started: asyncio.Semaphore) -> None:
    try:
        stream = await client.completions.create(
            model="tiny", prompt=[97] * 8, max_tokens=TOKENS, seed=FIRST_SEED + i, stream=True
        )
        first = True
        async for chunk in stream:
            seen.chunks.append(time.monotonic())
            seen.text += chunk.choices[0].text
            if first:
                started.release()
                first = False
    except openai.APIError as exc:
        seen.error = f"{type(exc).__name__}: {exc}"
        started.release()


async def _until_mid_stream(started: asyncio.Semaphore) -> None:
    """Until every stream has its first chunk, or (one slow to start) a second after half of them."""

    async def acquire(count: int) -> None:
        for _ in range(count):
            await started.acquire()

    await asyncio.wait_for(acquire(STREAMS // 2), 60)
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(acquire(STREAMS - STREAMS // 2), 1.0)


async def _late(client: openai.AsyncOpenAI, deadline: float) -> Stream:
    """A request sent at the kill, sent again on an error (not admitted) until one streams."""
    while True:
        seen = Stream()
        await _one(client, LATE, seen, asyncio.Semaphore(0))
        if seen.error is None or time.monotonic() > deadline:
            return seen
        await asyncio.sleep(0.05)


async def _streams_through_a_kill(system: System, victim: Probe, kill: Callable[[], None]) -> Run:
    """Stream every completion; once they are mid-stream, kill the victim, probe its slot and send
    one more request. What the clients saw."""
    client = openai.AsyncOpenAI(base_url=system.v1, api_key="x", max_retries=0, timeout=DEADLINE_S + 20)
    seen = [Stream() for _ in range(STREAMS)]
    started = asyncio.Semaphore(0)
    try:
        tasks = [asyncio.ensure_future(_one(client, i, seen[i], started)) for i in range(STREAMS)]
        await _until_mid_stream(started)
        killed_at = time.monotonic()
        kill()
        probe = threading.Thread(target=victim.run, args=(killed_at + 30,), daemon=True)
        probe.start()
        late = asyncio.ensure_future(_late(client, killed_at + 30))
        running = sum(not t.done() for t in tasks)
        await asyncio.gather(*tasks)
        await asyncio.to_thread(probe.join, 30)
        return Run(seen, await late, killed_at, running)
    finally:
        await client.close()


def _longest_pause_after(seen: list[Stream], killed_at: float) -> float:
    """The longest time, from the kill on, in which no stream got a chunk while some stream was
    still running: the token path's outage as the clients saw it."""
    times = sorted(t for s in seen for t in s.chunks if t >= killed_at)
    marks = [killed_at, *times]
    return max((b - a for a, b in zip(marks, marks[1:], strict=False)), default=0.0)


def _report(name: str, run: Run, probe: Probe, shared: bool, record: Record) -> None:
    """Print and record the outage: the slot's first accepted write, the longest pause in the
    admitted streams' tokens, the first token of the request sent at the kill."""
    figures = {
        "failover_write_outage_s": _since(run.killed_at, probe.accepted_at),
        "failover_token_pause_s": _longest_pause_after(run.seen, run.killed_at),
        "failover_new_request_first_token_s": _since(run.killed_at, run.late.chunks[0] if run.late.chunks else None),
    }
    # The API's shards are placed one per primary: the killed primary holds one shard's streams either way.
    where = "the probe tag on the cell's primary" if shared else "the probe tag on another primary"
    print(
        f"\n{name} ({where}; {run.running} of {STREAMS} streams running at the kill -9): "
        + ", ".join(f"{key.removeprefix('failover_')} {value:.2f}" for key, value in figures.items())
    )
    for key, value in figures.items():
        record(key, round(value, 3))


def _since(start: float, end: float | None) -> float:
    return float("inf") if end is None else end - start


def _wrong(run: Run) -> list[str]:
    """Each request whose stream is not exactly its sim text, and how it differs."""
    wrong = []
    for i, s in [*enumerate(run.seen), (LATE, run.late)]:
        want = sim_text(FIRST_SEED + i, TOKENS)
        if s.error is not None or s.text != want:
            kind = "error" if s.error else ("short" if want.startswith(s.text) else "different")
            wrong.append(f"request {i}: {kind} ({len(s.text)} of {len(want)} chars) {s.error or ''}")
    return wrong


def _reader_tag(system: System) -> str:
    """``<node>.out.0``, from the node id ``up`` prints: a tag whose slot moves with the node id.
    On a cluster the API places its reader shards one per primary (docs/cluster.md), so whichever
    primary serves this tag also serves one shard's result streams (under a placed name)."""
    node = system.wait_output(r"API on \S+ \(node (\S+),").group(1)
    return shard_name(f"{node}.out", 0)


def _run(cluster: EmbeddedCluster, system: System, victim_key: str, name: str, record: Record) -> None:
    """Kill the primary of ``victim_key``'s slot mid-stream; every stream must come out exact."""
    victim = cluster.primary_of(victim_key)
    shared = cluster.primary_of(Keys().out(_reader_tag(system), "x")) is cluster.primary_of(Keys().requests)
    probe = Probe(cluster.client(admin=True, socket_timeout=0.5), victim_key.replace("sb:", "sb:probe:", 1))
    run = asyncio.run(_streams_through_a_kill(system, probe, victim.kill))
    _report(name, run, probe, shared, record)
    assert probe.accepted_at is not None, "the slot never took a write again"
    assert cluster.primary_of(victim_key) is not victim  # its replica took over
    assert run.running > 0  # the kill came mid-stream
    assert _wrong(run) == [], LOSS_NOTE + "".join(system.output[-200:])


@pytest.mark.timeout(240)
def test_the_control_planes_primary_killed_mid_stream(
    tmp_path: Path, cluster: EmbeddedCluster, record_property: Record
) -> None:
    system = _up(tmp_path, cluster)
    try:
        _run(cluster, system, Keys().requests, "control-plane primary", record_property)
    finally:
        stop_system(system)


@pytest.mark.timeout(240)
def test_a_result_streams_primary_killed_mid_stream(
    tmp_path: Path, cluster: EmbeddedCluster, record_property: Record
) -> None:
    for attempt in range(6):  # the API's node id is random: until its reader's tag is off the cell's primary
        system = _up(tmp_path / str(attempt), cluster)
        reader = Keys().out(_reader_tag(system), "probe")
        if cluster.primary_of(reader) is not cluster.primary_of(Keys().requests):
            break
        stop_system(system)
    else:
        pytest.fail("six API node ids in a row hashed next to the control plane")
    try:
        _run(cluster, system, reader, "result-stream primary", record_property)
    finally:
        stop_system(system)
