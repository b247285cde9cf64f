"""Hand-made registry snapshots and requests for the scheduler's tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import redis.asyncio as aioredis

from splitbus.bus.core import codec
from splitbus.bus.core.config import BusConfig
from splitbus.bus.messages import GenerateRequest, SamplingParams, Task
from splitbus.bus.records import Reserved, WorkerLoad
from splitbus.bus.registry import WorkerInfo, WorkerRecord
from splitbus.placement.decision import Placed, Placement, Waiting


def worker(
    wid: str,
    role: str,
    queued: int = 0,
    free: int = 1000,
    running: int = 0,
    alive: bool = True,
    model: str = "m",
    reserved: Reserved | None = None,
) -> WorkerInfo:
    load = WorkerLoad(running=running, queued_prefill_tokens=queued, free_kv_blocks=free, total_kv_blocks=1000)
    record = WorkerRecord(worker_id=wid, role=role, model=model, load=load)
    return WorkerInfo(record, 0, 3000 if alive else -2, reserved or Reserved())


def tasks(placed: Sequence[tuple[Waiting, Placed]]) -> list[tuple[Waiting, Placement]]:
    """Each task of a batch's decisions, with its request, in order (a decode task before its prefill)."""
    return [(w, p) for w, decision in placed for p in decision.placements]


def request(prompt: int = 100, max_tokens: int = 28) -> GenerateRequest:
    return GenerateRequest("r", "m", [1] * prompt, SamplingParams(max_tokens=max_tokens), "api", 0)


async def tasks_in(redis: aioredis.Redis, stream: str) -> list[Task]:
    """Every task written to a task stream, decoded."""
    entries = cast("list[tuple[bytes, dict[bytes, bytes]]]", await redis.xrange(stream))
    tasks = [codec.decode(fields) for _, fields in entries]
    assert all(isinstance(t, Task) for t in tasks), tasks
    return cast("list[Task]", tasks)


async def current_handoff(redis: aioredis.Redis, config: BusConfig, request_id: str) -> str:
    """The hand-off id of the request's current dispatch (``sb:current:{cell}:<request>``)."""
    value = await redis.get(config.keys.current(request_id))
    assert isinstance(value, bytes), value
    return value.decode()
