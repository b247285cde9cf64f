"""Poison never stops a process: a request that breaks the engine, a task or request entry that
cannot be decoded or handled, an entry a consumer died on before, each ends in ``sb:dead`` with
its reason and an error for its client, and the worker or scheduler keeps serving."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import orjson
import pytest

from splitbus.bus.core.keys import Keys
from splitbus.bus.messages import Failed, Finished, Task
from splitbus.worker.engines.sim import sim_text
from tests.e2e.conftest import start_system, stop_system
from tests.faults.conftest import Bus, request, task, wait_until

POISON = 7  # a token id the sim engine is told to choke on
CRASH = 8  # a token id the sim engine is told to die on (SIGKILL)


@pytest.mark.timeout(120)
def test_poison_request_is_isolated(tmp_path: Path) -> None:
    system = start_system(
        tmp_path,
        "--mixed",
        "1",
        f"--worker-arg=--sim-poison-token={POISON}",
        "--worker-arg=--sim-decode-step-ms",
        "--worker-arg=10",
    )
    try:

        async def run() -> list[object]:
            client = openai.AsyncOpenAI(base_url=system.v1, api_key="x", max_retries=0, timeout=60)

            async def good(i: int) -> str:
                return (
                    (await client.completions.create(model="tiny", prompt=[60, 61, 62], max_tokens=30, seed=i))
                    .choices[0]
                    .text
                )

            async def bad() -> object:
                try:
                    await client.completions.create(model="tiny", prompt=[60, POISON, 62], max_tokens=30)
                    return "served"
                except openai.APIStatusError as exc:
                    return exc

            try:
                return list(await asyncio.gather(*(good(i) for i in range(6)), bad()))
            finally:
                await client.close()

        *texts, failure = asyncio.run(run())
        assert texts == [sim_text(i, 30) for i in range(6)]  # batched with the poison, unharmed
        assert isinstance(failure, openai.APIStatusError) and failure.status_code == 500
        assert failure.code == "engine_error" and "engine failed on this request" in failure.message
        # what the engine raised and which worker it was: in the API's log, under the request id
        request_id = failure.response.headers["x-request-id"]
        assert request_id in str(failure.body) and "poison token" not in str(failure.body)
        logged = system.wait_output(rf"request {request_id} failed .*$").group(0)
        assert "sim engine: poison token" in logged
        letters = [orjson.loads(f["data"]) for _, f in system.redis().xrange(Keys().dead)]
        assert [d["reason"].split(":")[0] for d in letters] == ["engine_error"]
        after = openai.OpenAI(base_url=system.v1, api_key="x", max_retries=0).completions.create(
            model="tiny", prompt="x", max_tokens=3, seed=1
        )
        assert after.choices[0].text == sim_text(1, 3)  # the worker is still serving
    finally:
        assert stop_system(system) == []


# ---------------------------------------------------------------- poison tasks on a real worker


def _poison_task_data(request_id: str, **fields: object) -> bytes:
    """A task as a forged or corrupted entry carries it: valid but for ``fields``."""
    data = orjson.loads(orjson.dumps(task(request_id)))
    data.update(fields)
    return orjson.dumps(data)


@pytest.mark.timeout(120)
def test_task_with_huge_token_id_is_dead_lettered_and_the_worker_goes_on(bus: Bus) -> None:
    # The attack: output_token_ids [4294967296] made the tokenizer raise OverflowError, and the
    # worker exited (code 0).
    worker = bus.worker("w-huge")
    stream = bus.keys.tasks("w-huge")
    bus.send_raw(stream, "task", _poison_task_data("r-poison", output_token_ids=[4294967296]))
    failed = bus.outcome("r-poison")
    assert isinstance(failed, Failed) and failed.code == "undecodable" and failed.status == 500
    assert "4294967296" in failed.message  # the client hears why, not a wait until its deadline
    [letter] = bus.wait_for_dead(1)
    assert letter.stream == stream
    assert "output_token_ids must hold integers in [0, 2147483647], got 4294967296" in letter.reason
    # Below the bus's bound but outside this model's vocabulary: the worker's own check.
    bus.send(stream, Task("mixed", request("r-vocab", prompt=[60]), output_token_ids=[100_000]))
    failed = bus.outcome("r-vocab")
    assert isinstance(failed, Failed) and failed.code == "invalid_task"
    assert "token id 100000, outside this model's vocabulary [0, 259)" in failed.message
    assert [d.reason.split(":")[0] for d in bus.wait_for_dead(2)] == ["undecodable", "invalid_task"]
    bus.send(stream, task("r-next", seed=4))
    assert isinstance(bus.outcome("r-next"), Finished) and bus.text("r-next") == sim_text(4, 5)  # still serving
    assert bus.r.xpending(stream, "workers")["pending"] == 0  # every task acked, none left to re-read
    assert worker.stop() == 0


@pytest.mark.timeout(120)
def test_restarted_worker_buries_the_entries_it_crashed_on(bus: Bus) -> None:
    # The attack: restarted with the same id, the worker re-read the pending entry it had died
    # on and died again (3 of 3). Here the pending list is as crashed runs leave it: the poison
    # task read once, and a task that killed the worker each time read max_deliveries (5) times.
    stream = bus.keys.tasks("w-again")
    bus.r.xgroup_create(stream, "workers", id="0", mkstream=True)
    poison = bus.send_raw(stream, "task", _poison_task_data("r-poison", output_token_ids=[4294967296]))
    killer = bus.send(stream, task("r-killer"))
    bus.r.xreadgroup("workers", "w-again", {stream: ">"}, count=2)
    bus.r.xclaim(stream, "workers", "w-again", 0, [killer], retrycount=5, justid=True)
    worker = bus.worker("w-again")
    letters = {d.entry_id: d for d in bus.wait_for_dead(2)}
    assert letters[poison].reason.startswith("undecodable: task: output_token_ids must hold integers")
    assert letters[killer].reason == "max_deliveries: delivered 6 times (bound 5) without an ack"
    assert isinstance(bus.outcome("r-poison"), Failed)
    killed = bus.outcome("r-killer")
    assert isinstance(killed, Failed) and killed.code == "max_deliveries"
    bus.send(stream, task("r-next", seed=5))
    assert isinstance(bus.outcome("r-next"), Finished) and bus.text("r-next") == sim_text(5, 5)
    assert worker.proc.poll() is None
    assert worker.stop() == 0


def _reserved(bus: Bus, worker_id: str) -> list[int]:
    names = ("reserved_prefill_tokens", "reserved_requests", "reserved_kv_blocks")
    return [int(v or 0) for v in bus.r.hmget(bus.keys.worker(worker_id), names)]


@pytest.mark.timeout(120)
def test_overdrawn_reservations_are_dead_lettered_and_counters_stay(bus: Bus) -> None:
    # The attack: reserved [1e12, ...] was given back as it was, and the worker's counters
    # stayed at -1e12 for good (schedulers then saw room that was not there).
    worker = bus.worker("w-res")
    stream = bus.keys.tasks("w-res")
    assert _reserved(bus, "w-res") == [0, 0, 0]
    bus.send_raw(stream, "task", _poison_task_data("r-huge", reserved=[10**12, 1, 1]))
    bus.send(stream, task("r-over", reserved=[1000, 1, 1]))  # within the bus's bounds, not this task's
    for name in ("reserved_prefill_tokens", "reserved_requests", "reserved_kv_blocks"):  # as a scheduler does
        bus.r.hincrby(bus.keys.worker("w-res"), name, 2 if name == "reserved_prefill_tokens" else 1)
    bus.send(stream, task("r-fair", seed=6, reserved=[2, 1, 1]))  # 2 prompt tokens + 5 -> 1 block
    assert isinstance(bus.outcome("r-fair"), Finished)
    assert all(isinstance(bus.outcome(r), Failed) for r in ("r-huge", "r-over"))
    letters = bus.wait_for_dead(2)
    assert letters[0].reason == "undecodable: task: reserved prefill tokens must be <= 4194304, got 1000000000000"
    assert letters[1].reason == (
        "invalid_task: reserved [1000, 1, 1] exceeds what a mixed task of this request can reserve, [2, 1, 1]"
    )
    assert wait_until(lambda: _reserved(bus, "w-res") == [0, 0, 0], 10)  # back to baseline, not below
    assert worker.stop() == 0


# ---------------------------------------------------------------- poison requests on a real scheduler


@pytest.mark.timeout(120)
def test_scheduler_dead_letters_poison_requests_and_goes_on(bus: Bus) -> None:
    bus.worker("w-sched")
    scheduler = bus.scheduler()
    requests = bus.keys.requests
    bad_id = orjson.loads(orjson.dumps(request("r-bad-ids")))
    bad_id["prompt_token_ids"] = [4294967296]
    bus.send_raw(requests, "request", orjson.dumps(bad_id))
    bus.send_raw(requests, "request", b"{not json")
    bus.send(requests, Task("mixed", request("r-task")))  # a task where a request belongs
    bus.send(requests, request("r-good", seed=8))
    assert isinstance(bus.outcome("r-good"), Finished) and bus.text("r-good") == sim_text(8, 5)
    reasons = [d.reason for d in bus.wait_for_dead(3)]
    assert reasons[0] == "undecodable: request: prompt_token_ids must hold integers in [0, 2147483647], got 4294967296"
    assert reasons[1].startswith("undecodable: request: data is not JSON")
    assert reasons[2] == "handler_failed: a Task entry is not a request"
    failed = bus.outcome("r-bad-ids")
    assert isinstance(failed, Failed) and "4294967296" in failed.message  # its client is told
    assert scheduler.proc.poll() is None
    assert scheduler.stop() == 0


@pytest.mark.timeout(180)
def test_a_task_that_kills_its_worker_ends_in_dead_letters_after_max_deliveries(bus: Bus) -> None:
    # The attack as it happened: the worker died on a task, and each restart under the same id
    # re-read that pending task and died again. Each re-read counts as a delivery: after the
    # 5th death (the bound), the 6th start buries the task and serves.
    stream = bus.keys.tasks("w-loop")
    crash = ["--sim-crash-token", str(CRASH)]
    bus.worker("w-loop", *crash)
    killer = bus.send(stream, task("r-killer", prompt=[60, CRASH]))
    exits = []
    for _ in range(5):
        exits.append(bus.parts[-1].wait())
        bus.worker("w-loop", *crash)
    assert exits == [-9] * 5  # killed by the task, five times
    [letter] = bus.wait_for_dead(1)
    assert (letter.entry_id, letter.reason) == (killer, "max_deliveries: delivered 6 times (bound 5) without an ack")
    failed = bus.outcome("r-killer")
    assert isinstance(failed, Failed) and failed.code == "max_deliveries"
    bus.send(stream, task("r-next", seed=9))
    assert isinstance(bus.outcome("r-next"), Finished) and bus.text("r-next") == sim_text(9, 5)
    assert bus.parts[-1].stop() == 0
