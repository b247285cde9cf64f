"""Tenants' limits in the API (``splitbus.api.limits``): two live API nodes over one Redis enforce
one tenant's limits together; a refusal is a 429 with ``Retry-After`` and OpenAI's error body;
every response of a limited tenant (a body, a stream, a refusal) carries the ``x-ratelimit-*``
headers; the default tenant (a key the API was started with) is untouched. Counts, not timings:
the limited tenants' rates are a request per 100 s."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import redis as sync_redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from splitbus.api.limits import WARN_EVERY_S, Lease, TenantLimiter, duration, headers
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.connection import connect
from splitbus.bus.limits import Admission, Ended, Room, Verdict
from splitbus.bus.tenants import Tenant, TenantLimits, TenantStore, key_digest
from splitbus.redis_server import EmbeddedRedis
from tests.api.conftest import ApiProcess, _wait_for_model, start_api, stop_api
from tests.api.responder import Responder
from tests.api.test_errors import _until

STARTED_KEY = "sk-started-with-0123"
TENANTS = {
    "acme": (TenantLimits(rps=0.01, tpm=100_000), "sk-acme-limits-key-0123"),
    "beta": (TenantLimits(concurrency=2, tpm=100_000), "sk-beta-limits-key-0123"),
    "gamma": (TenantLimits(rps=0.01), "sk-gamma-limits-key-0123"),
    "delta": (TenantLimits(tpm=1), "sk-delta-limits-key-0123"),
    "epsilon": (TenantLimits(rps=0.01), "sk-epsilon-limits-key-0123"),
}
RATE_HEADERS = {f"x-ratelimit-{n}-{k}" for n in ("limit", "remaining", "reset") for k in ("requests", "tokens")}


@pytest.fixture(scope="module")
def nodes(
    redis_server: EmbeddedRedis, tiny_model: Path, prefix: str, responder: Responder
) -> Iterator[list[ApiProcess]]:
    """Two API nodes of one cell, the tenants in its store."""

    async def add() -> None:
        client = connect(BusConfig(redis_url=redis_server.url, prefix=prefix))
        store = TenantStore(client, BusConfig(prefix=prefix).keys)
        for name, (limits, key) in TENANTS.items():
            await store.add(Tenant(name, limits=limits), (key_digest(key),))
        await client.aclose()

    asyncio.run(add())
    started = [start_api(redis_server.url, prefix, [tiny_model], "--api-key", STARTED_KEY) for _ in range(2)]
    try:
        for api in started:
            _wait_for_model(api)
        yield started
    finally:
        for api in started:
            stop_api(api)


def _complete(api: ApiProcess, key: str, **body: object) -> httpx.Response:
    payload = {"model": "tiny", "prompt": list(range(20)), "max_tokens": 3, **body}
    return httpx.post(api.v1 + "/completions", json=payload, headers={"authorization": f"Bearer {key}"}, timeout=30)


def test_a_tenants_rate_is_one_across_two_nodes_and_a_refusal_says_when(nodes: list[ApiProcess]) -> None:
    key = TENANTS["acme"][1]
    first = _complete(nodes[0], key)
    assert first.status_code == 200 and RATE_HEADERS <= set(first.headers)
    assert (first.headers["x-ratelimit-limit-requests"], first.headers["x-ratelimit-remaining-requests"]) == ("1", "0")
    assert first.headers["x-ratelimit-limit-tokens"] == "100000"
    assert int(first.headers["x-ratelimit-remaining-tokens"]) == 100_000 - 20  # the prompt, at admission
    refused = _complete(nodes[1], key)  # the other node: the same bucket
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
    assert RATE_HEADERS <= set(refused.headers) and refused.headers["x-ratelimit-remaining-requests"] == "0"
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"
    assert "requests per second" in error["message"] and "beta" not in error["message"]


def _samples(api: ApiProcess, name: str) -> dict[str, float]:
    """The values of metric ``name`` on ``api``'s /metrics, by their labels as written."""
    found = {}
    for line in httpx.get(api.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) :].rsplit(" ", 1)
            found[labels] = float(value)
    return found


def test_each_tenant_is_counted_under_its_own_labels(nodes: list[ApiProcess]) -> None:
    """epsilon (rps 0.01) on one node: an admitted request, then a refusal at its rate; the default
    tenant's requests under ``default``; tokens and TTFT per tenant."""
    api, key = nodes[0], TENANTS["epsilon"][1]
    assert _complete(api, key).status_code == 200 and _complete(api, key).status_code == 429
    assert _complete(api, STARTED_KEY).status_code == 200
    requests = _samples(api, "splitbus_api_tenant_requests_total")
    assert requests['{outcome="admitted",tenant="epsilon"}'] == 1
    assert requests['{outcome="requests",tenant="epsilon"}'] == 1
    assert requests['{outcome="admitted",tenant="default"}'] >= 1
    assert not any('outcome="tokens"' in labels and "epsilon" in labels for labels in requests)
    assert _samples(api, "splitbus_api_tenant_prompt_tokens_total")['{tenant="epsilon"}'] == 20
    assert _samples(api, "splitbus_api_tenant_generation_tokens_total")['{tenant="epsilon"}'] == 3
    assert _samples(api, "splitbus_api_tenant_time_to_first_token_seconds_count")['{tenant="epsilon"}'] == 1


def test_a_stream_carries_the_headers_and_its_place_is_released(
    nodes: list[ApiProcess], redis_server: EmbeddedRedis, prefix: str
) -> None:
    key = TENANTS["beta"][1]
    payload = {"model": "tiny", "prompt": list(range(20)), "max_tokens": 3, "stream": True}
    with httpx.stream(
        "POST", nodes[0].v1 + "/completions", json=payload, headers={"authorization": f"Bearer {key}"}
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert {h for h in RATE_HEADERS if h.endswith("tokens")} <= set(r.headers)
        assert "x-ratelimit-limit-requests" not in r.headers  # beta has no rps
        assert b"[DONE]" in b"".join(r.iter_bytes())
    admin = sync_redis.Redis.from_url(redis_server.url)
    inflight = BusConfig(prefix=prefix).keys.inflight("beta")
    _until(lambda: admin.zcard(inflight) == 0)  # ended: its place is free
    for _ in range(3):  # concurrency 2, taken and released one at a time: never refused
        assert _complete(nodes[1], key).status_code == 200
    _until(lambda: admin.zcard(inflight) == 0)


def test_output_tokens_are_charged_when_the_response_ends(
    nodes: list[ApiProcess], redis_server: EmbeddedRedis, prefix: str
) -> None:
    """tpm 1: a token is a minute of the bucket, so the prompt (20 tokens, admitted into a full
    bucket's debt) makes it full again in 20 minutes, and the 3 output tokens 3 more."""
    assert _complete(nodes[0], TENANTS["delta"][1]).status_code == 200
    admin = sync_redis.Redis.from_url(redis_server.url)
    bucket = BusConfig(prefix=prefix).keys.limits("delta")

    def full_in_minutes() -> float:
        seconds, micros = admin.time()
        return (float(admin.hget(bucket, "tok") or 0) - (seconds * 1000 + micros / 1000)) / 60_000

    _until(lambda: full_in_minutes() > 21.5)  # past what the prompt alone left: the output is charged
    assert full_in_minutes() <= 23
    refused = _complete(nodes[1], TENANTS["delta"][1])
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) > 21 * 60


def test_n_choices_are_one_request(nodes: list[ApiProcess]) -> None:
    key = TENANTS["gamma"][1]
    many = _complete(nodes[0], key, n=2)
    assert many.status_code == 200 and len(many.json()["choices"]) == 2
    assert many.headers["x-ratelimit-remaining-requests"] == "0"
    assert _complete(nodes[1], key).status_code == 429


def test_the_default_tenant_is_untouched(nodes: list[ApiProcess]) -> None:
    for _ in range(3):
        for api in nodes:
            reply = _complete(api, STARTED_KEY)
            assert reply.status_code == 200 and not RATE_HEADERS & set(reply.headers)


def test_the_headers_as_openai_writes_them() -> None:
    assert [duration(ms) for ms in (0, 20, 1000, 1500, 59_999, 360_000)] == [
        "0ms",
        "20ms",
        "1s",
        "1.5s",
        "59.999s",
        "6m0s",
    ]
    admission = Admission(Verdict.ADMITTED, 0, {"req": Room(4, 200), "prompt": Room(880, 7200)})
    assert headers(TenantLimits(rps=5, prompt_tpm=1000), admission) == [
        (b"x-ratelimit-limit-requests", b"5"),
        (b"x-ratelimit-remaining-requests", b"4"),
        (b"x-ratelimit-reset-requests", b"200ms"),
        (b"x-ratelimit-limit-tokens", b"1000"),
        (b"x-ratelimit-remaining-tokens", b"880"),
        (b"x-ratelimit-reset-tokens", b"7.2s"),
    ]
    assert headers(TenantLimits(concurrency=3), Admission(Verdict.ADMITTED, 0, {})) == []


# While Redis cannot answer: admitted unchecked, said once a minute (a stub limiter: pure logic).


class _Away:
    """A limiter whose Redis is gone (a failover in progress)."""

    def __init__(self) -> None:
        self.asked = 0

    async def admit(self, *args: object) -> Admission:
        self.asked += 1
        raise RedisConnectionError("Connection refused")


def _request(limits: TenantLimits) -> Any:
    return SimpleNamespace(state=SimpleNamespace(tenant_name="acme", tenant_limits=limits))


async def test_while_redis_is_away_requests_are_admitted_unchecked_and_said_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock, away = [0.0], _Away()
    limiter = TenantLimiter(away, 60, spawn=lambda coro: coro.close(), clock=lambda: clock[0])  # type: ignore[arg-type]
    request = _request(TenantLimits(rps=1, concurrency=1))
    with caplog.at_level(logging.WARNING, logger="splitbus.api.limits"):
        assert [await limiter.admit(request, 10, f"r{i}", 1) for i in range(3)] == [None] * 3
        clock[0] = WARN_EVERY_S
        assert await limiter.admit(request, 10, "r3", 1) is None
    assert away.asked == 4 and not hasattr(request.state, "ratelimit_headers")
    assert [r.getMessage().startswith("tenants' limits are not checked") for r in caplog.records] == [True, True]


async def test_the_default_tenant_never_asks_the_limiter() -> None:
    away = _Away()
    limiter = TenantLimiter(away, 60, spawn=lambda coro: coro.close())  # type: ignore[arg-type]
    assert await limiter.admit(_request(TenantLimits()), 10, "r", 1) is None
    assert await limiter.admit(SimpleNamespace(state=SimpleNamespace()), 10, "r", 1) is None  # type: ignore[arg-type]
    assert away.asked == 0


def test_a_response_of_n_choices_ends_once_when_its_last_choice_ends() -> None:
    ended: list[tuple[object, ...]] = []
    owner = SimpleNamespace(end=lambda *args: ended.append(args), lease_runs_out=lambda: 630.0)
    lease = Lease(owner, "acme", "cmpl-1", TenantLimits(concurrency=1), 3)  # type: ignore[arg-type]
    lease.done(4)
    lease.done(0)
    assert ended == []
    lease.done(5)  # retried, if need be, until the lease taken at admission runs out, not one taken at the end
    assert ended == [("acme", "cmpl-1", TenantLimits(concurrency=1), 9, 630.0)]


class _Slow:
    """A limiter that answers only when told: the client leaves while it is asked."""

    def __init__(self) -> None:
        self.ended: list[tuple[object, ...]] = []

    async def admit(self, *args: object) -> Admission:
        await asyncio.sleep(3600)
        raise AssertionError("not reached")

    async def end(self, *args: object) -> None:
        self.ended.append(args)


async def test_a_client_that_leaves_while_its_admission_is_asked_gives_its_place_back() -> None:
    slow, spawned = _Slow(), []
    limiter = TenantLimiter(slow, 60, spawn=spawned.append)  # type: ignore[arg-type]
    asking = asyncio.ensure_future(limiter.admit(_request(TenantLimits(concurrency=1)), 10, "r1", 1))
    await asyncio.sleep(0)
    asking.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asking
    (end,) = spawned
    await end
    assert slow.ended == [("acme", "r1", TenantLimits(concurrency=1), 0)]


class _Back:
    """A limiter whose Redis cannot take the first ``away`` ends (a failover), then can."""

    def __init__(self, away: int, error: Exception) -> None:
        self.away, self.error, self.tries = away, error, 0

    async def end(self, *args: object) -> Ended:
        self.tries += 1
        if self.tries <= self.away:
            raise self.error
        return Ended.RELEASED


@pytest.fixture
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("splitbus.api.limits.END_RETRY_S", (0.001, 0.002))


@pytest.mark.usefixtures("quick_retries")
@pytest.mark.parametrize(
    ("error", "tries"),
    [
        (RedisConnectionError("Connection refused"), 4),  # away, then back: the place is given back
        (ResponseError("READONLY You can't write against a read only replica."), 4),  # a failover under way
        (ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"), 1),  # no retry fixes it
        (ValueError("invalid literal for int()"), 1),  # not the script's reply
    ],
)
async def test_an_end_redis_cannot_take_is_tried_again_until_it_can(error: Exception, tries: int) -> None:
    back, spawned = _Back(away=3, error=error), []
    limiter = TenantLimiter(back, 60, spawn=spawned.append)  # type: ignore[arg-type]
    limiter.end("acme", "r1", TenantLimits(concurrency=1), 5)
    (end,) = spawned
    await end
    assert back.tries == tries


@pytest.mark.usefixtures("quick_retries")
async def test_an_end_is_given_up_when_its_lease_would_have_run_out() -> None:
    ticks = itertools.count(0, 10)  # each reading of the clock 10 s after the last
    never, spawned = _Back(away=10**6, error=RedisConnectionError("Connection refused")), []
    limiter = TenantLimiter(never, 60, spawn=spawned.append, clock=lambda: next(ticks))  # type: ignore[arg-type]
    limiter.end("acme", "r1", TenantLimits(concurrency=1), 0)
    await spawned[0]
    assert never.tries == 6  # at 0, 10, ..., 50 s: by 60 s its lease (60 s) has run out
