"""The tenants' limiter (``splitbus.bus.limits``) on a real Redis: two clients stand for two API
nodes enforcing one tenant's limits together. Counts, not timings: a bucket's refill is bounded
with Redis's own clock, read before and after."""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import AsyncIterator

import pytest
import redis as sync_redis
import redis.asyncio as aioredis

from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.connection import connect
from splitbus.bus.limits import BUCKETS, Admission, BadLimiterReply, Ended, Limiter, Room, Verdict, in_flight, limited
from splitbus.bus.tenants import TenantLimits
from splitbus.redis_cluster import EmbeddedCluster

LEASE_MS = 600_000


@pytest.fixture
async def nodes(bus_config: BusConfig) -> AsyncIterator[tuple[Limiter, Limiter]]:
    """Two limiters, each on a client of its own: two API nodes."""
    clients = [connect(bus_config), connect(bus_config)]
    yield Limiter(clients[0], bus_config.keys), Limiter(clients[1], bus_config.keys)
    for client in clients:
        await client.aclose()


async def _server_ms(redis: aioredis.Redis) -> float:
    seconds, micros = await redis.time()
    return seconds * 1000 + micros / 1000


async def _interleaved(
    nodes: tuple[Limiter, Limiter], limits: TenantLimits, count: int, prompt: int = 1
) -> list[Verdict]:
    """``count`` admissions of one tenant, alternating between the two nodes, two at a time."""
    verdicts = []
    for i in range(0, count, 2):
        pair = [nodes[j % 2].admit("acme", f"r{i + j}", limits, prompt, LEASE_MS) for j in range(2)]
        verdicts += [a.verdict for a in await asyncio.gather(*pair)]
    return verdicts


async def test_two_nodes_share_one_requests_bucket(nodes: tuple[Limiter, Limiter], redis: aioredis.Redis) -> None:
    limits = TenantLimits(rps=5)
    before = await _server_ms(redis)
    verdicts = await _interleaved(nodes, limits, 20)
    refill = math.floor((await _server_ms(redis) - before) * 5 / 1000)  # what the bucket regained meanwhile
    admitted = verdicts.count(Verdict.ADMITTED)
    assert 5 <= admitted <= 5 + refill  # the burst, plus what Redis's clock let through: never more
    assert verdicts.count(Verdict.REQUESTS) == 20 - admitted


async def test_a_slow_rate_admits_exactly_its_burst(nodes: tuple[Limiter, Limiter]) -> None:
    verdicts = await _interleaved(nodes, TenantLimits(rps=0.01), 20)  # one request per 100 s
    assert verdicts.count(Verdict.ADMITTED) == 1


async def test_two_nodes_share_one_concurrency_bound_released_on_end(
    nodes: tuple[Limiter, Limiter], redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    limits = TenantLimits(concurrency=5)
    verdicts = await _interleaved(nodes, limits, 20)
    assert verdicts.count(Verdict.ADMITTED) == 5 and verdicts.count(Verdict.CONCURRENCY) == 15
    with sync_redis.Redis.from_url(bus_config.redis_url) as status:  # as `splitbus status` reads it
        assert in_flight(status, bus_config.keys, "acme", int(await _server_ms(redis))) == 5
        assert in_flight(status, bus_config.keys, "other", int(await _server_ms(redis))) == 0
    held = [f"r{i}" for i, v in enumerate(verdicts) if v is Verdict.ADMITTED]
    assert await nodes[1].end("acme", held[0], limits, 0) is Ended.RELEASED  # ended on the other node
    assert await nodes[1].end("acme", held[0], limits, 0) is Ended.NO_LEASE  # once
    assert (await nodes[0].admit("acme", "again", limits, 1, LEASE_MS)).verdict is Verdict.ADMITTED
    assert (await nodes[0].admit("acme", "over", limits, 1, LEASE_MS)).verdict is Verdict.CONCURRENCY


async def test_a_lease_that_expires_frees_its_place(nodes: tuple[Limiter, Limiter], redis: aioredis.Redis) -> None:
    """A crashed node never ends its requests: their leases run out (here after 1 ms) instead."""
    limits = TenantLimits(concurrency=1)
    assert (await nodes[0].admit("acme", "crashed", limits, 1, 1)).verdict is Verdict.ADMITTED
    start = await _server_ms(redis)
    while await _server_ms(redis) < start + 2:  # Redis's clock past the lease
        await asyncio.sleep(0.001)
    assert (await nodes[1].admit("acme", "next", limits, 1, LEASE_MS)).verdict is Verdict.ADMITTED
    assert await nodes[1].end("acme", "crashed", limits, 0) is Ended.NO_LEASE


async def test_prompt_tokens_are_charged_at_admission(nodes: tuple[Limiter, Limiter]) -> None:
    limits = TenantLimits(tpm=100)  # 100 a minute: 10 tokens a request, 10 requests, then none for 6 s
    verdicts = await _interleaved(nodes, limits, 20, prompt=10)
    assert verdicts.count(Verdict.ADMITTED) == 10 and verdicts.count(Verdict.TOKENS) == 10
    refused = await nodes[0].admit("acme", "x", limits, 10, LEASE_MS)
    assert refused.verdict is Verdict.TOKENS and 0 < refused.retry_after_ms <= 6000
    assert refused.rooms["tok"].left == 0 and refused.rooms["tok"].full_in_ms > 59_000


async def test_output_tokens_are_charged_at_the_end(nodes: tuple[Limiter, Limiter]) -> None:
    limits = TenantLimits(tpm=1000, output_tpm=100)
    admitted = await nodes[0].admit("acme", "a", limits, 10, LEASE_MS)
    assert admitted.verdict is Verdict.ADMITTED and admitted.rooms["tok"].left == 990
    assert admitted.rooms["output"] == Room(100, 0)
    await nodes[1].end("acme", "a", limits, 150)  # more than the output bucket holds: it owes
    after = await nodes[0].admit("acme", "b", limits, 10, LEASE_MS)
    assert after.verdict is Verdict.TOKENS  # no room for output until the debt is paid
    assert after.rooms["tok"].left == 1000 - 160 and after.rooms["output"].left == 0


async def test_a_request_larger_than_the_bucket_goes_when_it_is_full(nodes: tuple[Limiter, Limiter]) -> None:
    limits = TenantLimits(prompt_tpm=50)
    assert (await nodes[0].admit("acme", "big", limits, 80, LEASE_MS)).verdict is Verdict.ADMITTED
    refused = await nodes[1].admit("acme", "next", limits, 1, LEASE_MS)
    assert refused.verdict is Verdict.TOKENS and refused.retry_after_ms > 0


async def test_a_refusal_writes_nothing(nodes: tuple[Limiter, Limiter]) -> None:
    """A request refused by one limit charges none of the others. The buckets refill between the
    two calls (a charge of 1 request takes 0.1 s to come back, one of 10 tokens 0.6 s): a refusal
    leaves at least as much room as the admission before it did, never less."""
    limits = TenantLimits(rps=10, concurrency=1, tpm=1000)
    first = await nodes[0].admit("acme", "a", limits, 10, LEASE_MS)
    refused = await nodes[0].admit("acme", "b", limits, 10, LEASE_MS)
    assert refused.verdict is Verdict.CONCURRENCY and refused.retry_after_ms == 1000
    assert refused.rooms["tok"].left >= first.rooms["tok"].left
    assert refused.rooms["req"].left >= first.rooms["req"].left


async def test_tenants_have_buckets_of_their_own(nodes: tuple[Limiter, Limiter]) -> None:
    limits = TenantLimits(rps=0.01)
    assert (await nodes[0].admit("acme", "a", limits, 1, LEASE_MS)).verdict is Verdict.ADMITTED
    assert (await nodes[0].admit("beta", "a", limits, 1, LEASE_MS)).verdict is Verdict.ADMITTED
    assert (await nodes[1].admit("acme", "b", limits, 1, LEASE_MS)).verdict is Verdict.REQUESTS


async def test_the_keys_expire_once_the_buckets_are_full(
    nodes: tuple[Limiter, Limiter], redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    await nodes[0].admit("acme", "a", TenantLimits(rps=2, concurrency=2), 1, LEASE_MS)
    assert 0 < await redis.pttl(bus_config.keys.limits("acme")) <= 1500  # full again in 0.5 s, plus 1 s
    assert 0 < await redis.pttl(bus_config.keys.inflight("acme")) <= LEASE_MS


def test_a_bad_reply_is_refused_not_trusted() -> None:
    for reply in (None, [1, 0], [7] + [0] * 9, ["x"] * 10):
        with pytest.raises(BadLimiterReply):
            Admission.read(reply)
    read = Admission.read([1, 0, 4, 200, -1, -1, -1, -1, -1, -1])
    assert read == Admission(Verdict.ADMITTED, 0, {"req": Room(4, 200)})
    assert len(BUCKETS) == 4


def test_only_a_tenant_with_a_limit_is_limited() -> None:
    assert not limited(TenantLimits(priority=3, weight=2))
    assert all(limited(TenantLimits(**{f: 1})) for f in ("rps", "tpm", "prompt_tpm", "output_tpm", "concurrency"))


async def test_on_a_cluster_two_nodes_share_one_tenants_limits(redis_cluster: EmbeddedCluster) -> None:
    """Both keys under the cell's tag: each script runs on the one primary of that slot."""
    config = BusConfig(redis_url=redis_cluster.url, prefix=f"t{uuid.uuid4().hex[:10]}")
    clients = [connect(config), connect(config)]
    try:
        nodes = (Limiter(clients[0], config.keys), Limiter(clients[1], config.keys))
        verdicts = await _interleaved(nodes, TenantLimits(concurrency=5, tpm=1000), 20)
        assert verdicts.count(Verdict.ADMITTED) == 5 and verdicts.count(Verdict.CONCURRENCY) == 15
        assert await nodes[1].end("acme", "r0", TenantLimits(concurrency=5, tpm=1000), 3) is Ended.RELEASED
    finally:
        for client in clients:
            await client.aclose()
