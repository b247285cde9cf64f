"""A request goes in over HTTP, P prefills, D decodes, tokens stream back (sim engine)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import openai
import pytest

from splitbus.bus.core.keys import Keys
from splitbus.worker.engines.sim import sim_text
from tests.e2e.conftest import System, start_system, stop_system


def _client(system: System) -> openai.OpenAI:
    return openai.OpenAI(base_url=system.v1, api_key="x", max_retries=0, timeout=60)


def test_streamed_chat_and_completion(system: System) -> None:
    chunks = list(
        _client(system).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=20, seed=11, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == sim_text(11, 20)
    assert chunks[-1].choices[0].finish_reason == "length"
    completion = list(
        _client(system).completions.create(model="tiny", prompt="Hello", max_tokens=7, seed=5, stream=True)
    )
    assert "".join(c.choices[0].text for c in completion) == sim_text(5, 7)


def test_fifty_concurrent_requests_are_exact_and_both_roles_work(
    tmp_path: Path, bus_environ: dict[str, str], request: pytest.FixtureRequest
) -> None:
    """On a single Redis and on a cluster. On the single Redis it runs on the module's ``system``
    (the same options: a CI-time cut of one start), whose other tests leave nothing in flight; its
    counts are at least 50 and every reservation is back at 0 either way."""
    if not bus_environ:
        _fifty_concurrent_requests(request.getfixturevalue("system"))
        return
    system = start_system(tmp_path, environ=bus_environ)
    try:
        _fifty_concurrent_requests(system)
    finally:
        assert stop_system(system) == []


def _fifty_concurrent_requests(system: System) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> str:
        stream = await client.completions.create(
            model="tiny", prompt=f"request {i}", max_tokens=10 + i, seed=1000 + i, stream=True
        )
        return "".join([c.choices[0].text async for c in stream])

    async def all_of_them() -> list[str]:
        client = openai.AsyncOpenAI(base_url=system.v1, api_key="x", max_retries=0, timeout=60)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(50)))
        finally:
            await client.close()

    assert asyncio.run(all_of_them()) == [sim_text(1000 + i, 10 + i) for i in range(50)]

    def work_done() -> tuple[int, int]:  # as the workers' heartbeats (every 0.5 s) report it
        r = system.redis()
        by_role = {w["role"]: w for w in (r.hgetall(Keys().worker(wid)) for wid in r.zrange(Keys().workers, 0, -1))}
        return int(by_role["prefill"]["prefills_done"]), int(by_role["decode"]["decodes_done"])

    deadline = time.monotonic() + 5
    while min(work_done()) < 50 and time.monotonic() < deadline:
        time.sleep(0.1)
    prefills, decodes = work_done()
    assert prefills >= 50 and decodes >= 50
    r = system.redis()
    for wid in r.zrange(Keys().workers, 0, -1):  # every reservation was given back
        reserved = r.hmget(Keys().worker(wid), "reserved_prefill_tokens", "reserved_requests", "reserved_kv_blocks")
        assert [int(x or 0) for x in reserved] == [0, 0, 0], (wid, reserved)


def test_prefill_and_decode_are_linked_through_rdma_keys(system: System) -> None:
    _client(system).completions.create(model="tiny", prompt="link", max_tokens=3)
    r = system.redis()
    keys = r.keys("sb:rdma:*")
    assert len(keys) == 1
    link = r.hgetall(keys[0])
    assert link["state"] == "connected"
    assert link["prefill"].startswith("prefill-") and link["decode"].startswith("decode-")
    assert 0 < r.ttl(keys[0]) <= 60


def test_mixed_worker_serves_the_same_requests(tmp_path: Path, bus_environ: dict[str, str]) -> None:
    # On a single Redis and on a cluster: one worker prefills and decodes each request.
    system = start_system(tmp_path, "--mixed", "1", "--prefill", "0", "--decode", "0", environ=bus_environ)
    try:
        client = _client(system)
        for seed in (1, 2, 3):
            reply = client.completions.create(model="tiny", prompt="x", max_tokens=15, seed=seed)
            assert reply.choices[0].text == sim_text(seed, 15)
        roles = {system.redis().hget(Keys().worker(w), "role") for w in system.redis().zrange(Keys().workers, 0, -1)}
        assert roles == {"mixed"}
    finally:
        assert stop_system(system) == []


def test_dead_decode_worker_gives_a_clear_error_not_a_hang(tmp_path: Path) -> None:
    system = start_system(tmp_path, "--worker-arg=--kv-wait", "--worker-arg=2")
    try:
        client = _client(system)
        assert client.completions.create(model="tiny", prompt="x", max_tokens=3, seed=1).choices[0].text == sim_text(
            1, 3
        )
        import os
        import signal

        os.kill(system.pid_of(r"--role decode"), signal.SIGKILL)
        started = time.monotonic()
        try:
            client.completions.create(model="tiny", prompt="x", max_tokens=3)
            raise AssertionError("a request succeeded without a decode worker")
        except openai.APIStatusError as exc:
            assert exc.status_code == 503
            request_id = exc.response.headers["x-request-id"]
            assert request_id in str(exc.body)
            # the reason names the missing decode worker: in the API's log, not in the client's body
            assert "decode" in system.wait_output(rf"request {request_id} failed .*$").group(0)
        assert time.monotonic() - started < 30  # bounded by --kv-wait / the no-worker wait, not a hang
    finally:
        stop_system(system)


def test_consumed_entries_are_trimmed(system: System) -> None:
    client = _client(system)
    for i in range(5):
        client.completions.create(model="tiny", prompt="trim", max_tokens=2, seed=i)
    r = system.redis()
    streams = [Keys().requests] + [Keys().tasks(w) for w in r.zrange(Keys().workers, 0, -1)]
    deadline = time.monotonic() + 12  # the scheduler and the workers trim every 5 s
    while any(r.xlen(s) for s in streams) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert [r.xlen(s) for s in streams] == [0] * len(streams)


def test_status_json_against_the_live_system(system: System) -> None:
    import json
    import subprocess
    import sys

    _client(system).completions.create(model="tiny", prompt="status", max_tokens=3)
    out = subprocess.run(
        [sys.executable, "-m", "splitbus.cli.main", "status", "--json", "--redis-url", system.redis_url],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    assert {(w["role"], w["alive"]) for w in status["workers"]} == {("prefill", True), ("decode", True)}
    assert all(w["free_kv_blocks"] <= w["total_kv_blocks"] == 8192 for w in status["workers"])
    requests = next(s for s in status["streams"] if s["stream"] == Keys().requests)
    assert [(g["group"], g["pending"]) for g in requests["groups"]] == [("schedulers", 0)]
    assert {s["stream"].split(":")[1] for s in status["streams"]} == {"requests", "tasks"}
    assert [link["state"] for link in status["links"]] == ["connected"]
    text = subprocess.run(
        [sys.executable, "-m", "splitbus.cli.main", "status", "--redis-url", system.redis_url],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    assert "P-D links:" in text and "connected" in text and Keys().requests in text
