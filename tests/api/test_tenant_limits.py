"""Tenants' limits in the API (``splitbus.api.limits``): two live API nodes over one Redis enforce
one tenant's limits together; a refusal is a 429 with ``Retry-After`` and OpenAI's error body;
every response of a limited tenant (a body, a stream, a refusal) carries the ``x-ratelimit-*``
headers; the default tenant (a key the API was started with) is untouched. Counts, not timings:
the limited tenants' rates are a request per 100 s."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis as sync_redis

from splitbus.api.limits import duration, headers
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.connection import connect
from splitbus.bus.limits import Admission, Room, Verdict
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
