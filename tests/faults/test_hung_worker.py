"""Issue 17: a hung worker (SIGSTOP past its lease, then SIGCONT) is reaped like a dead one.
While it is stopped its requests move and every stream completes exactly; once it wakes it
writes nothing for them (any entry of a seq already written carries the same tokens, and the
reader drops it), drops them and frees their KV blocks, and rejoins the live set and serves."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import redis

from splitbus.bus.core import codec
from splitbus.bus.core.keys import Keys
from splitbus.worker.engines.sim import sim_text
from tests.e2e.conftest import System, start_system, stop_system
from tests.faults.conftest import wait_until

STOP_S = 5.0
"""Longer than the 3 s lease: the reaper moves the worker's requests while it is stopped."""


async def streams(
    system: System, seeds: range, max_tokens: int, prompt: int, hang_after_s: float, victim: str
) -> list[str]:
    client = openai.AsyncOpenAI(base_url=system.v1, api_key="x", max_retries=0, timeout=60)

    async def one(seed: int) -> str:
        try:
            stream = await client.completions.create(
                model="tiny", prompt=[97] * prompt, max_tokens=max_tokens, seed=seed, stream=True
            )
            return "".join([c.choices[0].text async for c in stream])
        except openai.APIError as exc:
            return f"error: {exc}"

    async def hang() -> None:
        await asyncio.sleep(hang_after_s)
        pid = system.pid_of(victim)
        os.kill(pid, signal.SIGSTOP)
        await asyncio.sleep(STOP_S)
        os.kill(pid, signal.SIGCONT)

    try:
        return list((await asyncio.gather(*(one(s) for s in seeds), hang()))[: len(seeds)])
    finally:
        await client.close()


def worker_id(system: System, victim: str) -> str:
    return f"{victim.split()[-1]}-{socket.gethostname()}-{system.pid_of(victim)}"


def same_seq_same_tokens(system: System) -> int:
    """Entries in the result streams that repeat a seq (late writes); each must repeat its
    entry's tokens, so the reader, which drops a seq it has, loses nothing. Returns how many."""
    r, repeats = redis.Redis.from_url(system.redis_url), 0
    try:
        for key in r.scan_iter(b"sb:out:*"):
            by_seq: dict[int, list[object]] = {}
            for _, fields in r.xrange(key):
                entry = codec.decode(fields)
                by_seq.setdefault(entry.seq, []).append(getattr(entry, "token_ids", None))
            assert all(len(set(map(repr, v))) == 1 for v in by_seq.values()), (key, by_seq)
            repeats += sum(len(v) - 1 for v in by_seq.values())
    finally:
        r.close()
    return repeats


def rejoined_and_serves(system: System, wid: str) -> None:
    """The woken worker is live again, its blocks all free, and takes new requests."""
    r = system.redis()
    assert wait_until(lambda: re.search(rf"worker {wid}: \d+ request\(s\) moved away", "".join(system.output)), 15), (
        "".join(system.output)[-3000:]
    )
    assert wait_until(lambda: f"worker {wid} rejoined the live set" in "".join(system.output), 15)
    lines = "".join(system.output).splitlines()
    print(*[line.strip() for line in lines if re.search(r"rejoin|moved away|dead: moved", line)], sep="\n")
    record = Keys().worker(wid)
    assert wait_until(lambda: r.zscore(Keys().workers, wid) is not None and r.hget(record, "state") is None, 10)
    assert wait_until(lambda: r.hget(record, "free_kv_blocks") == r.hget(record, "total_kv_blocks"), 10)
    role = r.hget(record, "role")
    done_field = "prefills_done" if role == "prefill" else "decodes_done"
    before = int(r.hget(record, done_field))
    client = openai.OpenAI(base_url=system.v1, api_key="x", max_retries=0, timeout=30)

    def ask(seed: int) -> str:
        return client.completions.create(model="tiny", prompt="again", max_tokens=4, seed=seed).choices[0].text

    with ThreadPoolExecutor(16) as pool:  # at once, placed by load over both workers of its role
        assert list(pool.map(ask, range(900, 916))) == [sim_text(seed, 4) for seed in range(900, 916)]
    assert wait_until(lambda: int(r.hget(record, done_field)) > before, 5), "the woken worker served nothing"


@pytest.fixture(scope="module")
def two_of_each(tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    """One `up` with two prefill and two decode workers for both tests (a CI-time cut: one start,
    not two). 2 ms per prompt token: a prefill worker's batch of 100-token prompts takes ~1 s;
    25 ms per decode step: 120 tokens take ~3 s. ``--result-grace``: same_seq_same_tokens reads
    the finished streams after the run. Each test ends once its woken worker has rejoined, its
    blocks free, and served again, so the other finds every worker live, in either order."""
    args = ("--prefill", "2", "--decode", "2", "--result-grace", "120")
    slow = ("--worker-arg=--sim-prefill-us-per-token=2000", "--worker-arg=--sim-decode-step-ms=25")
    system = start_system(tmp_path_factory.mktemp("up"), *args, *slow)
    yield system
    stop_system(system)


@pytest.mark.timeout(180)
def test_a_decode_worker_stopped_past_its_lease(two_of_each: System) -> None:
    # 120 tokens take ~3 s; the stop lands 1 s in and lasts 5 s.
    system, victim = two_of_each, r"--role decode"
    wid = worker_id(system, victim)
    texts = asyncio.run(streams(system, range(600, 620), 120, 8, hang_after_s=1.0, victim=victim))
    assert texts == [sim_text(s, 120) for s in range(600, 620)]
    rejoined_and_serves(system, wid)
    print(f"entries repeating a seq: {same_seq_same_tokens(system)}")


@pytest.mark.timeout(180)
def test_a_prefill_worker_stopped_mid_prefill(two_of_each: System) -> None:
    # The stop lands 0.4 s into the prefills of 100-token prompts (~1 s a batch).
    system, victim = two_of_each, r"--role prefill"
    wid = worker_id(system, victim)
    texts = asyncio.run(streams(system, range(800, 810), 20, 100, hang_after_s=0.4, victim=victim))
    assert texts == [sim_text(s, 20) for s in range(800, 810)]
    rejoined_and_serves(system, wid)
    print(f"entries repeating a seq: {same_seq_same_tokens(system)}")
