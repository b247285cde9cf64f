"""The dispatch script against real Redis: exactly once, reservations, tasks."""

from __future__ import annotations

import dataclasses
import time

import pytest
import redis.asyncio as aioredis

from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.keys import SCHEDULER_GROUP, WORKER_GROUP
from splitbus.bus.core.streams import Delivery, GroupConsumer, Producer
from splitbus.bus.dispatch import MAX_CURRENT_TTL_S, DispatchOutcome, SettleOutcome
from splitbus.bus.records import Reserved
from splitbus.bus.registry import Registry, WorkerRecord
from splitbus.bus.runs import CellRun
from splitbus.placement.decision import Placement
from splitbus.placement.dispatcher import Dispatcher
from splitbus.scheduler.config import SchedulerConfig
from tests.placement.snapshot import current_handoff, request, tasks_in, worker


async def _setup(redis: aioredis.Redis, config: BusConfig) -> GroupConsumer:
    registry = Registry(redis, config)
    for wid, role in (("p", "prefill"), ("d", "decode")):
        await registry.register(WorkerRecord(worker_id=wid, role=role, model="m"), 5000)
    consumer = GroupConsumer(redis, config, config.keys.requests, SCHEDULER_GROUP, "s1")
    await consumer.ensure_group()
    return consumer


def _plan() -> list[Placement]:
    return [
        Placement(worker("d", "decode"), "decode", "p", Reserved(0, 1, 8)),
        Placement(worker("p", "prefill"), "prefill", "d", Reserved(100, 0, 0)),
    ]


async def test_dispatch_writes_tasks_reserves_and_acks_once(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    consumer = await _setup(redis, bus_config)
    await Producer(redis, bus_config).send(bus_config.keys.requests, request())
    delivery = (await consumer.read(1))[0]
    dispatcher = Dispatcher(redis, bus_config, 60)
    assert await dispatcher.dispatch(delivery.entry_id, delivery.message, _plan()) is DispatchOutcome.DISPATCHED
    # A retried call (reply lost) changes nothing.
    assert await dispatcher.dispatch(delivery.entry_id, delivery.message, _plan()) is DispatchOutcome.ALREADY_ACKED
    tasks = {w: await tasks_in(redis, bus_config.keys.tasks(w)) for w in ("p", "d")}
    assert [(t.phase, t.peer, t.request.request_id) for t in tasks["p"]] == [("prefill", "d", "r")]
    assert [(t.phase, t.peer, t.reserved) for t in tasks["d"]] == [("decode", "p", [0, 1, 8])]
    assert tasks["p"][0].reserved == [100, 0, 0]
    snap = {w.record.worker_id: w.reserved for w in await Registry(redis, bus_config).snapshot()}
    assert snap == {"p": Reserved(100, 0, 0), "d": Reserved(0, 1, 8)}
    assert (await redis.xpending(bus_config.keys.requests, SCHEDULER_GROUP))["pending"] == 0


async def test_duplicate_request_entry_is_acked_not_dispatched(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    consumer = await _setup(redis, bus_config)
    producer = Producer(redis, bus_config)
    await producer.send(bus_config.keys.requests, request())
    await producer.send(bus_config.keys.requests, request())  # an API's retried XADD
    first, second = await consumer.read(2)
    dispatcher = Dispatcher(redis, bus_config, 60)
    assert await dispatcher.dispatch(first.entry_id, first.message, _plan()) is DispatchOutcome.DISPATCHED
    assert await dispatcher.dispatch(second.entry_id, second.message, _plan()) is DispatchOutcome.DUPLICATE
    assert await redis.xlen(bus_config.keys.tasks("p")) == 1
    assert (await redis.xpending(bus_config.keys.requests, SCHEDULER_GROUP))["pending"] == 0


async def test_the_mark_is_kept_for_the_duplicate_window_and_the_handoff_id_to_the_deadline(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    """What a dispatched request leaves is short-lived: the mark for the window in which a
    duplicate entry can still arrive (a duplicate within it is still only acked), the hand-off id
    until the request's deadline (and one window more), not an hour each."""
    consumer = await _setup(redis, bus_config)
    window = SchedulerConfig(bus=bus_config).dispatched_ttl_s
    deadline_ms = int((time.time() + 300) * 1000)
    message = dataclasses.replace(request(), deadline_ms=deadline_ms)
    producer = Producer(redis, bus_config)
    await producer.send(bus_config.keys.requests, message)
    await producer.send(bus_config.keys.requests, message)  # an API's retried XADD
    first, second = await consumer.read(2)
    dispatcher = Dispatcher(redis, bus_config, window)
    assert await dispatcher.dispatch(first.entry_id, first.message, _plan()) is DispatchOutcome.DISPATCHED
    assert await dispatcher.dispatch(second.entry_id, second.message, _plan()) is DispatchOutcome.DUPLICATE
    assert 0 < await redis.ttl(bus_config.keys.dispatched("r")) <= window <= 60
    assert 300 < await redis.ttl(bus_config.keys.current("r")) <= 300 + window


async def test_the_handoff_id_of_a_request_without_a_deadline_is_kept_an_hour(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    consumer = await _setup(redis, bus_config)
    await Producer(redis, bus_config).send(bus_config.keys.requests, request())  # deadline_ms 0
    delivery = (await consumer.read(1))[0]
    assert (
        await Dispatcher(redis, bus_config, 60).dispatch(delivery.entry_id, delivery.message, _plan())
        is DispatchOutcome.DISPATCHED
    )
    assert 60 < await redis.ttl(bus_config.keys.current("r")) <= MAX_CURRENT_TTL_S


async def test_a_duplicate_read_after_the_mark_expired_is_still_a_duplicate(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    """One replica read both copies of a request (a retried XADD), dispatched the first, then
    stalled past the mark's window (SIGSTOP, Redis away) holding the second: the request's
    hand-off id, kept for as long as it runs, still makes the second a duplicate."""
    consumer = await _setup(redis, bus_config)
    message = dataclasses.replace(request(), deadline_ms=int((time.time() + 600) * 1000))
    producer = Producer(redis, bus_config)
    await producer.send(bus_config.keys.requests, message)
    await producer.send(bus_config.keys.requests, message)
    first, second = await consumer.read(2)
    dispatcher = Dispatcher(redis, bus_config, 60)
    assert await dispatcher.dispatch(first.entry_id, first.message, _plan(), "s1") is DispatchOutcome.DISPATCHED
    handoff = await current_handoff(redis, bus_config, "r")
    await redis.delete(bus_config.keys.dispatched("r"))  # the window passed
    assert await dispatcher.dispatch(second.entry_id, second.message, _plan(), "s1") is DispatchOutcome.DUPLICATE
    assert [await redis.xlen(bus_config.keys.tasks(w)) for w in ("p", "d")] == [1, 1]
    assert await current_handoff(redis, bus_config, "r") == handoff
    assert (await redis.xpending(bus_config.keys.requests, SCHEDULER_GROUP))["pending"] == 0


async def test_a_copy_of_a_dispatched_request_is_not_failed(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    """Before a replica fails a request entry (no worker, deadline, dead letter), the script
    tells it whether the request is dispatched: a copy of a running request is acked only."""
    consumer = await _setup(redis, bus_config)
    producer = Producer(redis, bus_config)
    await producer.send(bus_config.keys.requests, request())
    await producer.send(bus_config.keys.requests, request())
    first, second = await consumer.read(2)
    dispatcher = Dispatcher(redis, bus_config, 60)
    assert await dispatcher.dispatch(first.entry_id, first.message, _plan(), "s1") is DispatchOutcome.DISPATCHED
    await redis.delete(bus_config.keys.dispatched("r"))  # however late: the hand-off id tells
    assert await dispatcher.settle_failed(second.entry_id, "r", "s2") is SettleOutcome.NOT_OURS
    assert await dispatcher.settle_failed(second.entry_id, "r", "s1") is SettleOutcome.DUPLICATE
    assert (await redis.xpending(bus_config.keys.requests, SCHEDULER_GROUP))["pending"] == 0
    assert await dispatcher.settle_failed("", "r") is SettleOutcome.DUPLICATE  # a dead letter of it


async def test_a_failed_request_is_not_dispatched_by_its_copy(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    """Failing marks the request: a copy read later is a duplicate (its client has the error).
    The failing entry itself may still be dispatched (its replica died before writing the error)."""
    consumer = await _setup(redis, bus_config)
    producer = Producer(redis, bus_config)
    await producer.send(bus_config.keys.requests, request())
    await producer.send(bus_config.keys.requests, request())
    first, second = await consumer.read(2)
    dispatcher = Dispatcher(redis, bus_config, 60)
    assert await dispatcher.settle_failed(first.entry_id, "r", "s1") is SettleOutcome.FAIL_IT
    assert await dispatcher.settle_failed(first.entry_id, "r", "s1") is SettleOutcome.FAIL_IT  # retried: still its own
    assert await dispatcher.dispatch(second.entry_id, second.message, _plan(), "s1") is DispatchOutcome.DUPLICATE
    assert await dispatcher.dispatch(first.entry_id, first.message, _plan(), "s1") is DispatchOutcome.DISPATCHED
    assert await redis.xlen(bus_config.keys.tasks("p")) == 1


@pytest.mark.parametrize(("skew_s", "deadline_in_s", "low", "high"), [(250, 300, 300, 360), (0, 7200, 3500, 3600)])
async def test_the_handoff_ids_life_comes_from_the_deadline_not_the_schedulers_clock(
    redis: aioredis.Redis,
    bus_config: BusConfig,
    monkeypatch: pytest.MonkeyPatch,
    skew_s: float,
    deadline_in_s: float,
    low: int,
    high: int,
) -> None:
    """A scheduler whose clock runs ahead of the API's still keeps the id to the deadline (+ the
    window), by Redis's clock; a deadline further off than an hour is kept an hour at most."""
    consumer = await _setup(redis, bus_config)
    message = dataclasses.replace(request(), deadline_ms=int((time.time() + deadline_in_s) * 1000))
    await Producer(redis, bus_config).send(bus_config.keys.requests, message)
    delivery = (await consumer.read(1))[0]
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + skew_s)
    assert (
        await Dispatcher(redis, bus_config, 60).dispatch(delivery.entry_id, delivery.message, _plan())
        is DispatchOutcome.DISPATCHED
    )
    monkeypatch.setattr(time, "time", real)
    assert low < await redis.ttl(bus_config.keys.current("r")) <= high


def test_the_mark_must_outlast_a_stuck_replica_and_the_wait_for_a_worker(bus_config: BusConfig) -> None:
    """The documented bound, all of it: 3 x 5 s XADD retries + 30 s claim idle + 0.25 s claim pass
    + 10 s wait for a worker + 0.1 s refresh."""
    config = dataclasses.replace(bus_config, socket_timeout_s=5.0, claim_idle_ms=30_000)
    assert SchedulerConfig(bus=config).duplicate_window_s() == pytest.approx(55.35)
    with pytest.raises(ValueError, match="dispatched_ttl_s must cover"):
        SchedulerConfig(bus=config, dispatched_ttl_s=55, no_worker_wait_s=10.0)
    SchedulerConfig(bus=config, dispatched_ttl_s=56, no_worker_wait_s=10.0)


async def test_a_woken_replica_writes_nothing_for_an_entry_another_claimed(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    """A hung replica (s1) read the entry; s2 claimed it when s1's lease expired. Whether s2 has
    dispatched it yet or not, s1's dispatch finds the entry is not its own and writes nothing
    (XACK alone would ack s2's entry and dispatch it from s1)."""
    hung = await _setup(redis, bus_config)
    await Producer(redis, bus_config).send(bus_config.keys.requests, request())
    delivery = (await hung.read(1))[0]
    claimer = GroupConsumer(redis, bus_config, bus_config.keys.requests, SCHEDULER_GROUP, "s2")
    assert [d.entry_id for d in await claimer.claim_from("s1")] == [delivery.entry_id]
    dispatcher = Dispatcher(redis, bus_config, 60)
    assert await dispatcher.dispatch(delivery.entry_id, delivery.message, _plan(), "s1") is DispatchOutcome.NOT_OURS
    assert await redis.xlen(bus_config.keys.tasks("p")) == 0
    assert not await redis.exists(bus_config.keys.dispatched("r"))
    assert await claimer.owns(delivery.entry_id) and not await hung.owns(delivery.entry_id)
    assert await dispatcher.dispatch(delivery.entry_id, delivery.message, _plan(), "s2") is DispatchOutcome.DISPATCHED
    assert await dispatcher.dispatch(delivery.entry_id, delivery.message, _plan(), "s1") is DispatchOutcome.NOT_OURS
    assert [await redis.xlen(bus_config.keys.tasks(w)) for w in ("p", "d")] == [1, 1]
    snap = {w.record.worker_id: w.reserved for w in await Registry(redis, bus_config).snapshot()}
    assert snap == {"p": Reserved(100, 0, 0), "d": Reserved(0, 1, 8)}  # reserved once
    assert (await redis.xpending(bus_config.keys.requests, SCHEDULER_GROUP))["pending"] == 0


async def _pending_tasks(redis: aioredis.Redis, config: BusConfig, worker_id: str) -> list[Delivery]:
    """The worker's tasks, read (so pending with it) as the worker would."""
    tasks = GroupConsumer(redis, config, config.keys.tasks(worker_id), WORKER_GROUP, worker_id)
    await tasks.ensure_group()
    return await tasks.read(100)


async def test_a_request_whose_two_workers_die_is_moved_once(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    # Its prefill worker dies (the reaper moves the prefill task to a new pair), then its decode
    # worker: that worker's task of the first dispatch is void, and moving it too would give the
    # request two live dispatches, each waiting for a reservation the other's D made.
    consumer = await _setup(redis, bus_config)
    await Producer(redis, bus_config).send(bus_config.keys.requests, request())
    delivery = (await consumer.read(1))[0]
    dispatcher = Dispatcher(redis, bus_config, 60)
    assert await dispatcher.dispatch(delivery.entry_id, delivery.message, _plan()) is DispatchOutcome.DISPATCHED
    [p_task], [d_task] = await _pending_tasks(redis, bus_config, "p"), await _pending_tasks(redis, bus_config, "d")
    first = p_task.message.handoff
    assert first and d_task.message.handoff == first == await current_handoff(redis, bus_config, "r")

    assert (
        await dispatcher.redispatch("p", p_task.entry_id, p_task.message, _plan(), 0, []) is DispatchOutcome.DISPATCHED
    )
    second = await current_handoff(redis, bus_config, "r")
    assert second != first
    assert await dispatcher.redispatch("d", d_task.entry_id, d_task.message, _plan(), 0, []) is DispatchOutcome.STALE
    assert await current_handoff(redis, bus_config, "r") == second
    tasks = await tasks_in(redis, bus_config.keys.tasks("d"))
    assert [t.handoff for t in tasks] == [first, second]  # nothing written for the void task
    assert (await redis.xpending(bus_config.keys.tasks("d"), WORKER_GROUP))["pending"] == 0  # only acked


async def test_a_task_of_a_request_that_ended_is_not_moved(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    """The API deleted the request's hand-off id with its final entry: a redispatch of its task
    (the worker died before its ack) is only acked, not a run from the start for nobody. A task
    written before hand-off ids has nothing to compare and moves as before."""
    consumer = await _setup(redis, bus_config)
    await Producer(redis, bus_config).send(bus_config.keys.requests, request())
    delivery = (await consumer.read(1))[0]
    dispatcher = Dispatcher(redis, bus_config, 60)
    assert await dispatcher.dispatch(delivery.entry_id, delivery.message, _plan()) is DispatchOutcome.DISPATCHED
    [p_task], [d_task] = await _pending_tasks(redis, bus_config, "p"), await _pending_tasks(redis, bus_config, "d")
    await redis.delete(bus_config.keys.current("r"))  # the reader had the final entry
    assert await dispatcher.redispatch("d", d_task.entry_id, d_task.message, _plan(), 0, []) is DispatchOutcome.STALE
    assert [await redis.xlen(bus_config.keys.tasks(w)) for w in ("p", "d")] == [1, 1]
    assert (await redis.xpending(bus_config.keys.tasks("d"), WORKER_GROUP))["pending"] == 0
    old = dataclasses.replace(p_task.message, handoff="")
    assert await dispatcher.redispatch("p", p_task.entry_id, old, _plan(), 0, []) is DispatchOutcome.DISPATCHED


async def test_nothing_is_dispatched_until_the_cell_is_settled_on_the_servers_run(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    """After a new Redis run (here: the cell's settled run removed, as a restart without it would
    leave it) the script writes nothing and leaves the entry pending; once settled it dispatches."""
    consumer = await _setup(redis, bus_config)
    await Producer(redis, bus_config).send(bus_config.keys.requests, request())
    delivery = (await consumer.read(1))[0]
    dispatcher = Dispatcher(redis, bus_config, 60)
    cell = CellRun(redis, bus_config.keys)
    await redis.set(bus_config.keys.run, "0" * 40)  # settled on another server's run
    assert not await cell.settled()
    assert await dispatcher.dispatch(delivery.entry_id, delivery.message, _plan(), "s1") is DispatchOutcome.RECOVERING
    assert await redis.xlen(bus_config.keys.tasks("p")) == 0
    assert await redis.get(bus_config.keys.current("r")) is None
    assert (await redis.xpending(bus_config.keys.requests, SCHEDULER_GROUP))["pending"] == 1
    await cell.settle()
    assert await cell.settled()
    assert await dispatcher.dispatch(delivery.entry_id, delivery.message, _plan(), "s1") is DispatchOutcome.DISPATCHED
    assert await redis.xlen(bus_config.keys.tasks("p")) == 1


async def test_no_task_is_written_for_a_worker_whose_lease_is_gone(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    """A placement made from a registry view read before the decode worker's lease expired: the
    script writes nothing (not P's task either) and the entry stays pending, to be placed again."""
    consumer = await _setup(redis, bus_config)
    await Producer(redis, bus_config).send(bus_config.keys.requests, request())
    delivery = (await consumer.read(1))[0]
    dispatcher = Dispatcher(redis, bus_config, 60)
    await redis.delete(bus_config.keys.lease("d"))
    assert await dispatcher.dispatch(delivery.entry_id, delivery.message, _plan(), "s1") is DispatchOutcome.WORKER_GONE
    assert [await redis.xlen(bus_config.keys.tasks(w)) for w in ("p", "d")] == [0, 0]
    assert await redis.get(bus_config.keys.current("r")) is None
    assert (await redis.xpending(bus_config.keys.requests, SCHEDULER_GROUP))["pending"] == 1
    await Registry(redis, bus_config).register(WorkerRecord(worker_id="d", role="decode", model="m"), 5000)
    assert await dispatcher.dispatch(delivery.entry_id, delivery.message, _plan(), "s1") is DispatchOutcome.DISPATCHED
