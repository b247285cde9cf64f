"""The request stream (splitbus/bus/request_stream.py) against a real redis-server."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.streams import Producer
from splitbus.bus.messages import GenerateRequest, SamplingParams
from splitbus.bus.request_stream import Submissions, request_consumer


def _choice(i: int) -> GenerateRequest:
    return GenerateRequest(f"cmpl-1-{i}", "m", [1, 2], SamplingParams(), "api", 0, choices=4, choice_group="cmpl-1")


async def test_requests_submitted_together_are_read_together_by_a_blocked_scheduler(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    """A response's choices: one scheduler replica, blocked on the stream, reads them all at once
    (written one XADD at a time, its read would be answered at the first)."""
    consumer = request_consumer(redis, bus_config, "s1")
    await consumer.ensure_group()
    reading = asyncio.ensure_future(consumer.read(100, block_ms=5000))
    await asyncio.sleep(0.2)  # blocked now
    submissions = Submissions(redis, Producer(redis, bus_config), bus_config.keys)
    ids = await submissions.submit_together([_choice(i) for i in range(4)])
    got = await asyncio.wait_for(reading, 5)
    assert [d.message for d in got] == [_choice(i) for i in range(4)]
    assert [d.entry_id for d in got] == ids and len(submissions) == 4  # held until they start
