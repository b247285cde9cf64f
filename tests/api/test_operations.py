"""Auth, admission, disconnects, concurrency, Redis outages, probes, metrics and OpenAPI."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import redis as sync_redis

from splitbus.bus.core import codec
from splitbus.bus.core.config import BusConfig
from splitbus.redis_server import EmbeddedRedis
from splitbus.tokenization import ModelTokenizer
from tests.api.conftest import ApiProcess, _wait_for_model, start_api, stop_api
from tests.api.responder import Responder, expected_text
from tests.api.test_errors import _error, _post, _until


def test_api_keys_guard_v1_only(
    redis_server: EmbeddedRedis, tiny_model: Path, prefix: str, responder: Responder
) -> None:
    api = start_api(redis_server.url, prefix, [tiny_model], "--api-key", "k1", "--api-key", "k2")
    try:
        body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
        assert _error(_post(api, "/completions", body), 401)["code"] == "invalid_api_key"
        _error(_post(api, "/completions", body, headers={"authorization": "Bearer wrong"}), 401)
        _error(httpx.get(api.v1 + "/models"), 401)
        assert _post(api, "/completions", body, headers={"authorization": "Bearer k2"}).status_code == 200
        client = openai.OpenAI(base_url=api.v1, api_key="k1", max_retries=0)
        assert client.completions.create(**body).choices[0].text == expected_text(2)[0]
        assert httpx.get(api.url + "/health").status_code == 200
    finally:
        stop_api(api)


def test_each_api_key_salts_its_requests_chains_apart(
    redis_server: EmbeddedRedis, tiny_model: Path, prefix: str, responder: Responder
) -> None:
    """Every key is a tenant: its requests' chains carry a salt of its own (docs/security.md,
    "Prefix cache"), never the key itself."""
    api = start_api(redis_server.url, prefix, [tiny_model], "--api-key", "sk-one-secret", "--api-key", "sk-two-secret")
    try:
        sent = []
        for key, extra in (
            ("sk-one-secret", None),
            ("sk-two-secret", None),
            ("sk-one-secret", None),
            ("sk-one-secret", "s"),
        ):
            client = openai.OpenAI(base_url=api.v1, api_key=key, max_retries=0)
            body = {"cache_salt": extra} if extra else None
            reply = client.completions.create(model="tiny", prompt=list(range(50)), max_tokens=2, extra_body=body)
            (request,) = [r for r in responder.requests if r.request_id == reply.id]
            assert "secret" not in codec.encode(request)[b"data"].decode()
            sent.append(request.cache_salt)
        one, two, one_again, one_salted = sent
        assert one == one_again and len({one, two, one_salted, ""}) == 4
    finally:
        stop_api(api)


def test_over_the_inflight_bound_is_429_and_others_unaffected(
    redis_server: EmbeddedRedis, tiny_model: Path, prefix: str, responder: Responder
) -> None:
    api = start_api(redis_server.url, prefix, [tiny_model], "--max-inflight", "1")
    try:
        slow: dict[str, Any] = {}
        thread = threading.Thread(
            target=lambda: slow.update(
                r=_post(api, "/completions", {"model": "tiny", "prompt": "[slow]", "max_tokens": 20})
            )
        )
        thread.start()
        _until(lambda: _inflight(api) == 1)
        response = _post(api, "/completions", {"model": "tiny", "prompt": "x"})
        _error(response, 429)
        assert response.headers["retry-after"] == "1"
        thread.join(30)
        assert slow["r"].status_code == 200
        assert slow["r"].json()["choices"][0]["text"] == expected_text(20)[0]
    finally:
        stop_api(api)


def _inflight(api: ApiProcess) -> float:
    for line in httpx.get(api.url + "/metrics").text.splitlines():
        if line.startswith("splitbus_api_inflight_requests "):
            return float(line.split()[1])
    return -1


def test_disconnect_mid_stream_publishes_a_cancellation(api: ApiProcess, responder: Responder) -> None:
    body = {"model": "tiny", "prompt": "[slow]", "max_tokens": 40, "stream": True}
    with httpx.stream("POST", api.v1 + "/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        rid = codec.orjson.loads(first[len("data: ") :])["id"]
    # The client closed the connection after one chunk.
    _until(lambda: rid in responder.cancelled)
    entries = sync_redis.Redis.from_url(api.config.redis_url).xrange(api.config.keys.cancel)
    cancels = [codec.decode(fields) for _, fields in entries]
    assert [(c.request_id, c.reason) for c in cancels if c.request_id == rid] == [(rid, "client_disconnected")]
    _until(lambda: _inflight(api) == 0)


def test_200_concurrent_streams_with_bounded_connections(api: ApiProcess, redis_admin: sync_redis.Redis) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> str:
        stream = await client.completions.create(model="tiny", prompt=f"req {i}", max_tokens=24, stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def all_of_them() -> tuple[list[str], int]:
        client = openai.AsyncOpenAI(base_url=api.v1, api_key="x", max_retries=0, timeout=60, http_client=_pool(250))
        tasks = [asyncio.create_task(one(client, i)) for i in range(200)]
        peak = 0
        while not all(t.done() for t in tasks):
            peak = max(peak, _connections(api, redis_admin))
            await asyncio.sleep(0.05)
        await client.close()
        return [t.result() for t in tasks], peak

    texts, peak = asyncio.run(all_of_them())
    assert texts == [expected_text(24)[0]] * 200
    assert 1 <= peak <= 7 + 1  # the pool (7) plus one result-reader shard, whatever the load


def _pool(size: int) -> Any:
    limits = httpx.Limits(max_connections=size, max_keepalive_connections=size)
    return openai.DefaultAsyncHttpxClient(limits=limits, timeout=60)


def _connections(api: ApiProcess, admin: sync_redis.Redis) -> int:
    clients = admin.client_list()  # CLIENT LIST: the admin's, not the splitbus user's
    return sum(1 for c in clients if c["name"].startswith(api.node_id))


def test_probes_metrics_and_openapi(api: ApiProcess) -> None:
    assert httpx.get(api.url + "/health").json() == {"status": "ok"}
    assert httpx.get(api.url + "/ready").json() == {"status": "ready", "models": ["tiny"]}
    _post(api, "/completions", {"model": "tiny", "prompt": "x", "max_tokens": 3})
    text = httpx.get(api.url + "/metrics").text
    for name in (
        "splitbus_api_requests_total",
        "splitbus_api_time_to_first_token_seconds_bucket",
        "splitbus_api_inter_token_latency_seconds_bucket",
        "splitbus_api_e2e_request_latency_seconds_bucket",
        "splitbus_api_inflight_requests",
        "splitbus_bus_entries_produced_total",
    ):
        assert name in text
    assert 'splitbus_api_requests_total{route="/v1/completions",status="200"}' in text
    spec = httpx.get(api.url + "/openapi.json").json()
    routes = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/ready", "/metrics"}
    assert routes | {"/tokenize", "/detokenize", "/tokenizer_info"} <= set(spec["paths"])
    assert spec["components"]["schemas"]["CompletionRequest"]["required"] == ["model", "prompt"]


def test_redis_outage_is_503_and_the_api_recovers(tmp_path: Path, tiny_model: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis")
    server.start()
    config = BusConfig(redis_url=server.url, prefix="outage")
    responder = Responder(config, ModelTokenizer.load(tiny_model, "tiny")).start()
    api = start_api(server.url, "outage", [tiny_model])
    try:
        _wait_for_model(api)
        body = {"model": "tiny", "prompt": "x", "max_tokens": 4}
        assert _post(api, "/completions", body).status_code == 200
        server.stop()
        _until(lambda: httpx.get(api.url + "/ready").status_code == 503)
        error = _error(_post(api, "/completions", body), 503)
        assert "Redis" in error["message"]
        server.start()  # same port and data folder
        _until(lambda: httpx.get(api.url + "/ready").status_code == 200, timeout_s=20)
        last = _post(api, "/completions", body)
        assert last.status_code == 200, last.text
        assert last.json()["choices"][0]["text"] == expected_text(4)[0]
    finally:
        stop_api(api)
        responder.stop()
        server.stop()


def test_request_backlog_over_the_bound_is_429(redis_server: EmbeddedRedis, tiny_model: Path) -> None:
    prefix = "backlog"
    responder = Responder(
        BusConfig(redis_url=redis_server.url, prefix=prefix), ModelTokenizer.load(tiny_model, "tiny")
    ).start()
    api = start_api(redis_server.url, prefix, [tiny_model], "--max-backlog", "3")
    try:
        _wait_for_model(api)
        body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
        for _ in range(3):  # the responder acks but never trims: each stays in the stream
            assert _post(api, "/completions", body).status_code == 200
        time.sleep(0.7)  # the API reads the stream's length every 0.5 s
        response = _post(api, "/completions", body)
        assert "request queue holds 3 entries" in _error(response, 429)["message"]
        assert response.headers["retry-after"] == "1"
    finally:
        stop_api(api)
        responder.stop()
