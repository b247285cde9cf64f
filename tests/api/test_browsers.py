"""A web page the operator visits cannot use an API that has no key: each test sends what a
browser would send for such a page (a "simple" cross-origin POST: text/plain, no preflight; or,
after DNS rebinding, the page's own domain as the Host) and checks it is refused unserved,
while the openai client, and a key holder under any Host, are served."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from splitbus.redis_server import EmbeddedRedis
from tests.api.conftest import ApiProcess, running_api
from tests.api.responder import Responder, expected_text

BODY = '{"model": "tiny", "prompt": "hello", "max_tokens": 4}'
EVIL = {"origin": "http://evil.example", "host": "evil.example:8000"}


@pytest.fixture(scope="module")
def allowing(redis_server: EmbeddedRedis, tiny_model: Path, prefix: str, responder: Responder) -> Iterator[ApiProcess]:
    """An API without keys that also answers to the name ``api.internal`` (a proxy's)."""
    yield from running_api(redis_server.url, prefix, [tiny_model], "--allowed-hosts", "api.internal, other.internal")


@pytest.fixture(scope="module")
def keyed(redis_server: EmbeddedRedis, tiny_model: Path, prefix: str, responder: Responder) -> Iterator[ApiProcess]:
    yield from running_api(redis_server.url, prefix, [tiny_model], "--api-key", "k1")


def _post(api: ApiProcess, headers: dict[str, str], key: str | None = None) -> httpx.Response:
    auth = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(api.v1 + "/completions", content=BODY, headers={**headers, **auth}, timeout=10)


def _refused(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code


def _served(response: httpx.Response) -> None:
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == expected_text(4)[0]


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_a_cross_origin_simple_post_is_refused_unserved(
    api: ApiProcess, responder: Responder, content_type: str
) -> None:
    before = len(responder.served)
    # as a page on another origin posts to http://127.0.0.1:PORT (the Host names this server)
    _refused(_post(api, {"content-type": content_type, "origin": "http://evil.example"}), 415, "unsupported_media_type")
    # and as it does after rebinding its own name to this address
    _refused(_post(api, {"content-type": content_type, **EVIL}), 421, "misdirected_request")
    assert len(responder.served) == before


def test_a_rebound_host_name_gets_421_even_with_json(api: ApiProcess, responder: Responder) -> None:
    before = len(responder.served)
    _refused(_post(api, {"content-type": "application/json", **EVIL}), 421, "misdirected_request")
    assert len(responder.served) == before
    for path in ("/health", "/ready", "/metrics", "/openapi.json"):  # what a rebound page could read
        assert httpx.get(api.url + path, headers=EVIL, timeout=5).status_code == 421, path
    assert httpx.get(api.url + "/health", timeout=5).status_code == 200  # a probe dials an address


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "[::1]", "LOCALHOST.", "10.1.2.3"])
def test_addresses_and_localhost_are_served(api: ApiProcess, host: str) -> None:
    port = api.url.rsplit(":", 1)[1]
    _served(_post(api, {"content-type": "application/json; charset=utf-8", "host": f"{host}:{port}"}))


def test_the_openai_client_is_served(api: ApiProcess) -> None:
    client = openai.OpenAI(base_url=api.v1, api_key="none", max_retries=0, timeout=10)
    assert client.completions.create(model="tiny", prompt="hello", max_tokens=4).choices[0].text == expected_text(4)[0]


def test_allowed_hosts_adds_names(allowing: ApiProcess) -> None:
    _served(_post(allowing, {"content-type": "application/json", "host": "api.internal:8080"}))
    _served(_post(allowing, {"content-type": "application/json", "host": "other.internal"}))
    _refused(_post(allowing, {"content-type": "application/json", **EVIL}), 421, "misdirected_request")


def test_with_an_api_key_the_key_is_the_guard_not_the_host(keyed: ApiProcess) -> None:
    _served(_post(keyed, {"content-type": "application/json", **EVIL}, key="k1"))
    _refused(_post(keyed, {"content-type": "application/json", **EVIL}), 401, "invalid_api_key")
    _refused(_post(keyed, {"content-type": "text/plain", **EVIL}, key="k1"), 415, "unsupported_media_type")
