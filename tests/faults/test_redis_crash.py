"""kill -9 the single embedded Redis of `splitbus up --engine sim` while 50 completions stream;
`up` starts it again from its data folder, and every admitted request completes with its exact
stream: none is lost, none waits for its deadline.

Two crashes:

- **a process crash**: the server dies, its AOF as it was (every write it acknowledged is in the
  file: Redis writes the AOF before it replies; `appendfsync everysec` only delays the fsync);
- **a crash that lost the last second**: what an OS crash or power cut leaves under
  `appendfsync everysec`. The test stops the server (SIGSTOP), puts back its AOF as it was about a
  second earlier (a prefix of the log: Redis replays writes in order), then kills it: the server
  comes back without the requests, dispatches, task acks and results of that second, and the
  parts re-publish them (docs/reliability.md, "Writes Redis loses").
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import redis

from splitbus.bus.core.keys import Keys
from splitbus.redis_server import embedded_url
from splitbus.worker.engines.sim import sim_text
from tests.e2e.conftest import System, start_system, stop_system
from tests.faults.test_cluster_failover import (
    DEADLINE_S,
    FIRST_SEED,
    LATE,
    STREAMS,
    TOKENS,
    Run,
    Stream,
    _late,
    _longest_pause_after,
    _one,
    _until_mid_stream,
    _wrong,
)
from tests.test_redis_server import live_aof

Record = Callable[[str, object], None]
RECOVERY_LOG = re.compile(r"new Redis run|re-published|sent again|settled|starting it again|is back")
"""The parts' lines about the crash, printed with ``-s``."""
LOST_S = 1.0
"""How much of the AOF's end the second crash loses: ``appendfsync everysec``'s window."""
BURST = 20
"""Requests sent in the second the crash loses: some are queued (``--max-requests``), some run."""
MAX_REQUESTS = 40
"""Each worker's bound: some of the streams and the burst wait in the scheduler at the crash."""


def _up(tmp_path: Path, dispatch: str = "scheduler") -> System:
    return start_system(
        tmp_path,
        "--dispatch",
        dispatch,
        "--request-timeout",
        str(DEADLINE_S),
        "--worker-arg=--sim-decode-step-ms",
        "--worker-arg=20",
        "--worker-arg=--max-requests",
        f"--worker-arg={MAX_REQUESTS}",
    )


def _records(system: System) -> dict[str, dict[str, str]]:
    """Every live worker's record, a heartbeat after the last request ended."""
    time.sleep(1.0)
    client = redis.Redis.from_url(system.redis_url, decode_responses=True)
    try:
        keys = Keys()
        return {w: client.hgetall(keys.worker(w)) for w in client.zrange(keys.workers, 0, -1)}
    finally:
        client.close()


def _redis_pid(system: System) -> int:
    return system.pid_of(r"redis-server")


def _back_at(url: str, deadline: float) -> float | None:
    """When the restarted server first answered (its AOF loaded), polled from the kill on."""
    client = redis.Redis.from_url(url, socket_timeout=0.5)
    try:
        while time.monotonic() < deadline:
            try:
                if client.ping():
                    return time.monotonic()
            except redis.RedisError:
                time.sleep(0.02)
        return None
    finally:
        client.close()


async def _admitted(client: openai.AsyncOpenAI, i: int, seen: Stream) -> None:
    """Request ``i``, sent again while the API refuses it (503 "Redis is unreachable": its XADD failed) (a
    burst request sent as the server stops is not admitted: a client retries it)."""
    deadline = time.monotonic() + 30
    while True:
        attempt = Stream()
        await _one(client, i, attempt, asyncio.Semaphore(0))
        refused = attempt.error is not None and not attempt.chunks and "Redis is unreachable" in attempt.error
        if not refused or time.monotonic() > deadline:
            seen.text, seen.chunks, seen.error = attempt.text, attempt.chunks, attempt.error
            return
        await asyncio.sleep(0.05)


@dataclass
class Crash:
    """How the server dies: ``before`` runs once the streams are mid-stream (then the burst is
    sent, and ``LOST_S`` later) ``kill``."""

    kill: Callable[[], None]
    before: Callable[[], None] = lambda: None
    burst: int = 0
    """Requests sent between ``before`` and ``kill``: admitted, some queued, at the crash."""


async def _streams_through(system: System, crash: Crash) -> tuple[Run, list[Stream], float | None]:
    """Stream every completion; mid-stream, crash the server (sending the burst just before) and
    send one more request at the kill. What the clients saw, and when Redis answered again."""
    client = openai.AsyncOpenAI(base_url=system.v1, api_key="x", max_retries=0, timeout=DEADLINE_S + 20)
    seen = [Stream() for _ in range(STREAMS)]
    burst = [Stream() for _ in range(crash.burst)]
    started = asyncio.Semaphore(0)
    try:
        tasks = [asyncio.ensure_future(_one(client, i, seen[i], started)) for i in range(STREAMS)]
        await _until_mid_stream(started)
        crash.before()
        tasks += [asyncio.ensure_future(_admitted(client, LATE + 1 + i, s)) for i, s in enumerate(burst)]
        if crash.burst:
            await asyncio.sleep(LOST_S)
        await asyncio.to_thread(crash.kill)
        killed_at = time.monotonic()
        back: list[float | None] = [None]
        probe = threading.Thread(
            target=lambda: back.__setitem__(0, _back_at(system.redis_url, killed_at + 30)), daemon=True
        )
        probe.start()
        late = asyncio.ensure_future(_late(client, killed_at + 30))
        running = sum(not t.done() for t in tasks)
        await asyncio.gather(*tasks)
        await asyncio.to_thread(probe.join, 30)
        return Run(seen, await late, killed_at, running), burst, back[0]
    finally:
        await client.close()


def _aof(system: System, data_dir: Path) -> Path:
    """The file the embedded Redis appends to (a part of appendonlydir/ from Redis 7: rolling it back is
    rolling back the log, as long as no rewrite starts a new part meanwhile; the run stays far below
    the 4 MB at which one would)."""
    return live_aof(data_dir / "redis")


def _check(system: System, run: Run, back: float | None, name: str, record: Record, burst: list[Stream]) -> None:
    outage = float("inf") if back is None else back - run.killed_at
    pause = _longest_pause_after(run.seen, run.killed_at)
    for line in system.output:
        if RECOVERY_LOG.search(line):
            print(line, end="")
    print(
        f"\n{name} ({run.running} requests running at the kill):"
        f" Redis back after {outage:.2f} s, token pause {pause:.2f} s"
    )
    record("redis_back_s", round(outage, 3))
    record("token_pause_s", round(pause, 3))
    assert back is not None, "the embedded Redis never came back"
    assert run.running > 0  # the crash came mid-stream
    wrong = _wrong(run) + [
        f"burst request {i}: {s.error or f'{len(s.text)} chars'}"
        for i, s in enumerate(burst)
        if s.error is not None or s.text != sim_text(FIRST_SEED + LATE + 1 + i, TOKENS)
    ]
    assert wrong == [], "\n".join(wrong[:5]) + "\n" + "".join(system.output[-int(os.environ.get("SB_TAIL", "300")) :])


@pytest.mark.timeout(240)
def test_a_killed_redis_comes_back_and_every_stream_is_exact(tmp_path: Path, record_property: Record) -> None:
    system = _up(tmp_path)
    try:
        assert embedded_url(tmp_path / "redis", admin=True)
        run, burst, back = asyncio.run(
            _streams_through(system, Crash(lambda: os.kill(_redis_pid(system), signal.SIGKILL)))
        )
        _check(system, run, back, "process crash", record_property, burst)
        system.wait_output(r"the embedded Redis \(port \d+\) exited: starting it again", 5)
    finally:
        stop_system(system)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("dispatch", ["scheduler", "api"])
def test_a_redis_that_lost_its_last_second_is_made_whole_by_the_parts(
    tmp_path: Path, record_property: Record, dispatch: str
) -> None:
    """With either dispatcher: with ``--dispatch api`` the API wrote the lost dispatches itself, and
    holds the requests not started, which it submits again to the schedulers."""
    system = _up(tmp_path, dispatch)
    aof = _aof(system, tmp_path)

    before = aof.with_name("before.aof")

    def copy() -> None:
        shutil.copyfile(aof, before)  # the log as it is now: a prefix of what comes next
        before.chmod(0o600)

    def kill() -> None:
        pid = _redis_pid(system)
        os.kill(pid, signal.SIGSTOP)  # alive to `up`, writing nothing, while its AOF is rolled back
        os.replace(before, aof)
        os.kill(pid, signal.SIGKILL)

    try:
        run, burst, back = asyncio.run(_streams_through(system, Crash(kill, copy, BURST)))
        _check(system, run, back, f"crash losing the last {LOST_S:.0f} s", record_property, burst)
        records = _records(system)
        prefills = sum(int(r.get("prefills_done", 0)) for r in records.values())
        assert prefills == STREAMS + BURST + 1, "a request was dispatched twice (or not at all)"
        reserved = {
            w: [r.get(f"reserved_{n}") for n in ("prefill_tokens", "requests", "kv_blocks")] for w, r in records.items()
        }
        assert all(v == ["0", "0", "0"] for v in reserved.values()), f"reservations left counted: {reserved}"
    finally:
        stop_system(system)
