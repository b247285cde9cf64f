"""A new Redis server run is seen (``ServerRuns``), what an API lost is submitted again
(``Submissions``), and a refused ``INFO`` turns the check off rather than failing."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import cast

import pytest
import redis as sync_redis
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.connection import TRANSIENT_ERRORS, connect
from splitbus.bus.core.streams import Producer
from splitbus.bus.messages import GenerateRequest, SamplingParams
from splitbus.bus.request_stream import Submissions
from splitbus.bus.runs import CellRun, Runs, ServerRuns
from splitbus.redis_server import EmbeddedRedis


def _request(i: int) -> GenerateRequest:
    return GenerateRequest(f"r{i}", "m", [1, 2], SamplingParams(max_tokens=4), "api", 0, "api.out.0")


async def _restarted(server: EmbeddedRedis, runs: ServerRuns) -> Runs:
    """Restart the server; the first poll that gets through (the pool's connections are dead:
    the first commands fail, as a part's loop would see and back off on)."""
    server.stop()
    server.start()
    for _ in range(50):
        try:
            return await runs.poll()
        except TRANSIENT_ERRORS:
            await asyncio.sleep(0.05)
    raise AssertionError("Redis did not come back")


async def test_a_restart_is_a_new_run_and_lost_requests_are_submitted_again(tmp_path: Path) -> None:
    """A server restarted without persistence lost every entry: the requests not yet started
    are submitted again, the started one is not (copies of entries not lost are only acked:
    tests/placement/test_dispatcher.py)."""
    server = EmbeddedRedis(tmp_path, appendonly=False)
    server.start()
    config = BusConfig(redis_url=server.url, block_ms=200, socket_timeout_s=1.0)
    redis = connect(config)
    try:
        runs, submissions = ServerRuns(redis, "test"), Submissions(redis, Producer(redis, config), config.keys)
        assert await runs.poll() is Runs.FIRST
        for i in range(3):
            await submissions.submit(_request(i))
        submissions.started("r1")
        assert await runs.poll() is Runs.SAME
        assert await _restarted(server, runs) is Runs.NEW
        assert await runs.poll() is Runs.SAME
        assert await submissions.resubmit() == 2
        entries = await redis.xrange(config.keys.requests)
        assert sorted(f[b"data"].count(b'"r0"') + 2 * f[b"data"].count(b'"r2"') for _, f in entries) == [1, 2]
    finally:
        await redis.aclose()
        server.stop()


async def test_a_refused_info_turns_the_check_off(
    redis_server: EmbeddedRedis, redis_admin: sync_redis.Redis, bus_config: BusConfig
) -> None:
    user, password = f"noinfo{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
    redis_admin.acl_setuser(user, enabled=True, passwords=[f"+{password}"], keys=["*"], commands=["+@all", "-info"])
    client = aioredis.Redis(port=redis_server.port, username=user, password=password)
    try:
        runs = ServerRuns(client, "test")
        assert await runs.poll() is Runs.UNKNOWN
        assert await runs.poll() is Runs.UNKNOWN
        # and the dispatch gate is off, not failing: the cell counts as settled
        assert await CellRun(client, bus_config.keys).settled()
    finally:
        await client.aclose()
        redis_admin.acl_deluser(user)


class _Replies:
    """A client whose INFO answers what a test gives (an INFO renamed, a reply without run id)."""

    def __init__(self, *replies: object) -> None:
        self.replies = list(replies)

    async def info(self, section: str) -> object:
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply


async def test_runs_are_compared_with_the_previous_poll_and_an_odd_reply_turns_the_check_off() -> None:
    a, b = "a" * 40, "b" * 40
    runs = ServerRuns(cast(aioredis.Redis, _Replies({"run_id": a}, {"run_id": b}, {"run_id": a})), "test")
    assert [await runs.poll() for _ in range(3)] == [Runs.FIRST, Runs.NEW, Runs.NEW]  # a again: a new run too
    odd = ServerRuns(cast(aioredis.Redis, _Replies({"redis_version": "6.2.14"}, ResponseError("unknown command"))), "t")
    assert await odd.poll() is Runs.UNKNOWN
    assert await odd.poll() is Runs.UNKNOWN  # and the caller's loop goes on
    down = ServerRuns(cast(aioredis.Redis, _Replies(RedisConnectionError("down"))), "t")
    with pytest.raises(RedisConnectionError):  # transient: the caller's loop backs off
        await down.poll()
