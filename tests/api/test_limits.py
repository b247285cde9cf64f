"""Bounded inputs, checked before work: each test performs one attack from issue 16 against a
live API process (real redis, the scripted responder) and checks it does no harm: /health and
a normal request (official openai client) answer meanwhile, the attacker gets a clear error,
memory and read slots come back. Loopback only; every load is bounded in count and time."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import re
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from splitbus.api.protocol import MAX_STOP_CHARS, MAX_STOP_SEQUENCES
from splitbus.redis_server import EmbeddedRedis
from splitbus.tokenization.byte_level import write_byte_level_tokenizer
from splitbus.worker.engines.sim import sim_text
from tests.api.conftest import CONTEXT, ApiProcess, _wait_for_model, running_api, start_api, stop_api
from tests.api.responder import Responder, expected_text
from tests.e2e.conftest import start_system, stop_system

BIG = 3_900_000  # the attack's prompt / upload size, in bytes
PROMPT_CHAR_LIMIT = CONTEXT * 16  # context x MAX_CHARS_PER_TOKEN, the default bound


@pytest.fixture(scope="module")
def limited(
    redis_server: EmbeddedRedis,
    tiny_model: Path,
    prefix: str,
    responder: Responder,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[ApiProcess, Path]]:
    """An API with short header and body deadlines (so the tests wait little), its stderr kept."""
    log = tmp_path_factory.mktemp("api") / "stderr.log"
    api = start_api(redis_server.url, prefix, [tiny_model], "--header-timeout", "2", "--body-timeout", "2", stderr=log)
    _wait_for_model(api)
    yield api, log
    stop_api(api)


@pytest.fixture(scope="module")
def patient(redis_server: EmbeddedRedis, tiny_model: Path, prefix: str, responder: Responder) -> Iterator[ApiProcess]:
    """An API with an 8 s body deadline: long enough to measure stalled uploads while they stall."""
    api = start_api(redis_server.url, prefix, [tiny_model], "--body-timeout", "8")
    _wait_for_model(api)
    yield api
    stop_api(api)


@pytest.fixture(scope="module")
def roomy(redis_server: EmbeddedRedis, tiny_model: Path, prefix: str, responder: Responder) -> Iterator[ApiProcess]:
    """An API whose operator raised --max-prompt-chars, so 3.9 MB prompts do get tokenized."""
    api = start_api(redis_server.url, prefix, [tiny_model], "--max-prompt-chars", str(2 * BIG))
    _wait_for_model(api)
    yield api
    stop_api(api)


def _client(api: ApiProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=api.v1, api_key="none", max_retries=0, timeout=10)


def _normal_request_works(api: ApiProcess) -> None:
    out = _client(api).completions.create(model="tiny", prompt="hello", max_tokens=8)
    assert out.choices[0].text == expected_text(8)[0]
    assert httpx.get(api.url + "/health", timeout=5).status_code == 200


def _metric(api: ApiProcess, name: str) -> float:
    """The sum of a metric's samples whose line starts with ``name`` (labels included)."""
    text = httpx.get(api.url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def _rss_bytes(api: ApiProcess, field: str = "VmRSS") -> int:
    """The API's resident memory now (VmRSS) or at its peak so far (VmHWM)."""
    status = Path(f"/proc/{api.proc.pid}/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]


def _raw(api: ApiProcess) -> socket.socket:
    port = int(api.url.rsplit(":", 1)[1])
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _head(length: int) -> bytes:
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def _response(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        return _response(sock) is not None
    except (ConnectionResetError, TimeoutError):
        return False


# ---------------------------------------------------------------- CPU burn through stop strings


def test_stop_strings_over_the_bounds_get_400_in_openai_shape(limited: tuple[ApiProcess, Path]) -> None:
    api, _ = limited
    client = _client(api)
    for stop, says in [
        (["s" * 200_000] * 16, f"at most {MAX_STOP_CHARS} characters"),
        (["s"] * (MAX_STOP_SEQUENCES + 1), f"at most {MAX_STOP_SEQUENCES} sequences"),
    ]:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="tiny", prompt="hi", max_tokens=4, stop=stop)
        error = info.value.body
        assert error["param"] == "stop" and says in error["message"]  # type: ignore[index]
    longest = ["z" * (MAX_STOP_CHARS - 1) + chr(97 + i) for i in range(MAX_STOP_SEQUENCES)]
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=4, stop=longest).choices[0].text
    _normal_request_works(api)


@pytest.mark.timeout(300)
def test_sixteen_longest_stops_do_not_stall_a_real_worker(tmp_path: Path) -> None:
    """The attack through `splitbus up --engine sim`: 16 stop strings of the longest allowed
    length that the generated text keeps matching up to their last character (the most text
    held back, the most work for a naive check), over 2048 tokens. The request completes with
    the whole text; the worker keeps its lease (a normal request still works after)."""
    model = tmp_path / "tiny"
    write_byte_level_tokenizer(model)
    config = {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096}
    (model / "config.json").write_text(json.dumps(config))
    fast = ["--worker-arg=--sim-decode-step-ms", "--worker-arg=0.2"]
    system = start_system(tmp_path / "up", "--model", str(model), *fast)
    try:
        client = openai.OpenAI(base_url=system.v1, api_key="x", max_retries=0, timeout=120)
        head = sim_text(7, MAX_STOP_CHARS - 1)
        stops = [head + chr(0x4E00 + i) for i in range(MAX_STOP_SEQUENCES)]  # never generated: no stop fires
        out = client.completions.create(model="tiny", prompt="x", max_tokens=2048, seed=7, stop=stops)
        assert out.choices[0].text == sim_text(7, 2048) and out.choices[0].finish_reason == "length"
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="tiny", prompt="x", max_tokens=4, stop=["s" * 200_000] * 16)
        normal = client.completions.create(model="tiny", prompt="x", max_tokens=4, seed=3)
        assert normal.choices[0].text == sim_text(3, 4)
    finally:
        assert stop_system(system) == []


# ---------------------------------------------------------------- big prompts


def test_a_prompt_longer_than_the_context_can_hold_is_refused_untokenized(limited: tuple[ApiProcess, Path]) -> None:
    api, _ = limited
    client = _client(api)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x" * BIG, max_tokens=4)
    assert info.value.code == "context_length_exceeded"
    assert f"at most {PROMPT_CHAR_LIMIT}" in info.value.message  # the character check, not the tokenizer's count
    with pytest.raises(openai.BadRequestError) as info:
        too_long = [{"role": "user", "content": "x" * (PROMPT_CHAR_LIMIT + 1)}]
        client.chat.completions.create(model="tiny", messages=too_long)  # type: ignore[arg-type]
    assert info.value.code == "context_length_exceeded" and "characters" in info.value.message
    assert _metric(api, "splitbus_api_tokenizing ") == 0
    _normal_request_works(api)


def test_health_and_requests_answer_while_big_prompts_tokenize(roomy: ApiProcess) -> None:
    """The prompts pass the character bound (the operator raised it) and are tokenized, in the
    pool: the loop meanwhile answers /health and a normal request, and each big one then gets
    the context error."""
    stop = threading.Event()
    answers: list[int] = []

    def big_prompts() -> None:
        while not stop.is_set():
            body = {"model": "tiny", "prompt": "y" * BIG, "max_tokens": 4}
            answers.append(httpx.post(roomy.v1 + "/completions", json=body, timeout=120).status_code)

    senders = [threading.Thread(target=big_prompts) for _ in range(2)]
    for sender in senders:
        sender.start()
    try:
        _wait_until(lambda: _metric(roomy, "splitbus_api_tokenizing ") >= 1, timeout_s=60)
        for _ in range(3):
            _normal_request_works(roomy)
        assert _metric(roomy, "splitbus_api_tokenizing ") >= 1  # they answered while a prompt tokenized
    finally:
        stop.set()
        for sender in senders:
            sender.join(120)
    assert answers and set(answers) == {400}


# ---------------------------------------------------------------- hostile chat templates

HOSTILE_TEMPLATES = {
    "loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",  # 10^10 steps
    "bloat": "{{ 'x' * 10**8 }}",  # 100 MB in one operation
    "sum": "{% set l = [[1]] * 150000 %}{{ l | sum(start=[]) }}",  # one C call, O(n^2), a small result
    "modulo": "{{ (7**2000000) % (3**1062500) }}",  # one long integer division
    "separators": "{{ ([1]*15000) | tojson(separators=(' '*30000, ':')) }}",  # 450 MB inside json.dumps
    "wordwrap": "{{ ('a '*8000) | wordwrap(1, wrapstring='-'*30000) }}",  # 240 M characters in one call
    "indent": "{% set ns = namespace(v=1) %}{% for i in range(400) %}{% set ns.v = [ns.v] %}{% endfor %}"
    "{{ ns.v | tojson(indent=16) }}",  # a 400-deep nesting, indented
}
FAILING_TEMPLATES = {
    "truncate": "{{ 'x' | truncate(5, end='-'*30000) }}",  # an AssertionError inside Jinja
    "parens": "{{ " + "(" * 2000 + "1" + ")" * 2000 + " }}",  # a RecursionError while compiling
    "leaky": "{{ raise_exception('secret-template-text') }}",  # its text must not reach the client
}
HOSTILE_PROMPT_CHARS = 2**21  # a 128K context's default bound: the attacks' values pass the in-process checks


@pytest.fixture(scope="module")
def hostile(
    redis_server: EmbeddedRedis,
    tiny_model: Path,
    prefix: str,
    responder: Responder,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[ApiProcess, Path]]:
    """An API serving "tiny" and models whose chat templates are the issue's attacks; its
    template pool has two children (the default); its stderr kept."""
    log = tmp_path_factory.mktemp("api") / "stderr.log"
    folders = [tiny_model]
    for name, template in {**HOSTILE_TEMPLATES, **FAILING_TEMPLATES}.items():
        folder = tmp_path_factory.mktemp("hostile") / name
        shutil.copytree(tiny_model, folder)
        (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
        folders.append(folder)
    for api in running_api(
        redis_server.url, prefix, folders, "--max-prompt-chars", str(HOSTILE_PROMPT_CHARS), stderr=log
    ):
        yield api, log


def _chat_pair(hostile: ApiProcess, models: list[str]) -> list[httpx.Response]:
    """Two chat requests at once (both template children), one per model."""
    messages = [{"role": "user", "content": "hello"}]

    def attack(model: str) -> httpx.Response:
        body = {"model": model, "messages": messages, "max_tokens": 4}
        return httpx.post(hostile.v1 + "/chat/completions", json=body, timeout=60)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return list(pool.map(attack, models))


def _assert_served(hostile: ApiProcess) -> None:
    messages = [{"role": "user", "content": "hello"}]
    out = _client(hostile).chat.completions.create(model="tiny", messages=messages, max_tokens=8)  # type: ignore[arg-type]
    assert out.choices[0].message.content == expected_text(8)[0]


@pytest.mark.parametrize("pair", [["loops", "bloat"], ["sum", "modulo"], ["separators", "wordwrap"], ["indent", "sum"]])
def test_hostile_chat_templates_fail_their_requests_and_free_the_pool(
    hostile: tuple[ApiProcess, Path], pair: list[str]
) -> None:
    """Two attacks at once hold both template children; each is stopped at its bound (in the
    child, or by killing it: 400 ``chat_template_limit``, a stable message naming the request),
    and a chat request after them renders and is served."""
    api, _ = hostile
    for response in _chat_pair(api, pair):
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "chat_template_limit" and error["param"] == "messages"
        assert error["message"].startswith("The model's chat template went past its time or memory bound")
        assert response.headers["x-request-id"] in error["message"]
    assert _metric(api, "splitbus_api_tokenizing ") == 0
    _assert_served(api)


def test_failing_chat_templates_get_a_stable_400_without_their_text(hostile: tuple[ApiProcess, Path]) -> None:
    """A template that raises (in Jinja's code, in its parser, or by raise_exception) gets 400
    ``chat_template_error`` with a stable message: no exception text, no template source; the
    log has why, under the request id."""
    api, log = hostile
    responses = _chat_pair(api, list(FAILING_TEMPLATES)[:2]) + _chat_pair(api, ["leaky", "tiny"])[:1]
    for response in responses:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "chat_template_error" and error["param"] == "messages"
        assert error["message"].startswith("The model's chat template failed on these messages (request id ")
        assert "secret" not in response.text and "Recursion" not in response.text and "30000" not in response.text
    _assert_served(api)
    leaked = f"request {responses[2].headers['x-request-id']}: the chat template of leaky failed"
    assert any(leaked in line and "secret-template-text" in line for line in log.read_text().splitlines())


# ---------------------------------------------------------------- uploads


def test_stalled_big_uploads_hold_bounded_memory_and_leave_room_for_others(patient: ApiProcess) -> None:
    """40 uploads declare 3.9 MB, send all but the last bytes and stall. Only 8 are read (429
    with Retry-After, connection closed, for the rest); memory grows by far less than 40 bodies
    (it grew by 158 MiB before); a normal request and /health answer meanwhile; the stalled ones
    get 408 at the body deadline and their slots come back."""
    api = patient
    before = _rss_bytes(api)
    socks = [_raw(api) for _ in range(40)]
    senders = [threading.Thread(target=_send_quietly, args=(s, _head(BIG) + b"x" * (BIG - 100))) for s in socks]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join(10)  # refused ones end at once, read ones when the server took all but 100 bytes
    statuses = [_peek_status(s) for s in socks]
    _normal_request_works(api)
    replies = [_response(s) for s, status in zip(socks, statuses, strict=True) if status is None]
    grown = _rss_bytes(api, "VmHWM") - before  # the peak, once the server read all it would read
    assert grown < 60 * 2**20, f"RSS peaked {grown / 2**20:.0f} MiB above where it was"
    assert statuses.count(429) == 40 - 8 and statuses.count(None) == 8, statuses
    assert all(r.startswith(b"HTTP/1.1 408") and b"request_timeout" in r for r in replies)
    for s in socks:
        s.close()
    assert _metric(api, 'splitbus_api_body_reads_rejected_total{size="large"}') >= 32
    assert _metric(api, 'splitbus_api_tenant_requests_total{outcome="body_reads",tenant="default"}') >= 32
    spaces = b"{" + b" " * 200_000 + b"}"
    ok = httpx.post(api.v1 + "/completions", content=spaces, headers={"content-type": "application/json"}, timeout=10)
    # a slot is free again
    assert ok.status_code == 400 and ok.json()["error"]["param"] == "model"


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:  # the server refused it and closed: expected for most
        pass


def _peek_status(sock: socket.socket) -> int | None:
    """The status of a response already there, left unread (None: the server is still reading)."""
    sock.settimeout(0.5)
    try:
        head = sock.recv(12, socket.MSG_PEEK)
    except (TimeoutError, ConnectionResetError):
        return None
    finally:
        sock.settimeout(10)
    return int(head[9:12]) if head.startswith(b"HTTP/1.1 ") else None


def test_a_body_shorter_than_its_content_length_gets_408(limited: tuple[ApiProcess, Path]) -> None:
    api, log = limited
    with _raw(api) as sock:
        sock.sendall(_head(1000) + b'{"model": "tiny"')
        reply = _response(sock)  # the server answers and closes; it waited forever before
    assert reply.startswith(b"HTTP/1.1 408") and b'"code":"request_timeout"' in reply
    _normal_request_works(api)
    assert b"Traceback" not in log.read_bytes()


def test_a_client_that_leaves_mid_upload_is_a_quiet_499(limited: tuple[ApiProcess, Path]) -> None:
    api, log = limited
    before = _metric(api, 'splitbus_api_requests_total{route="/v1/completions",status="499"}')
    for _ in range(3):
        with _raw(api) as sock:
            sock.sendall(_head(100_000) + b'{"model": "tiny", "prompt": "')
            time.sleep(0.2)  # the handler is reading the body
    _wait_until(lambda: _metric(api, 'splitbus_api_requests_total{route="/v1/completions",status="499"}') == before + 3)
    _normal_request_works(api)
    assert b"Traceback" not in log.read_bytes()


def test_a_body_declared_too_large_is_refused_unread(limited: tuple[ApiProcess, Path]) -> None:
    api, _ = limited
    with _raw(api) as sock:
        sock.sendall(_head(64 * 2**20))  # no byte of the body is sent
        reply = _response(sock)
    assert reply.startswith(b"HTTP/1.1 413") and b"connection: close" in reply.lower()


# ---------------------------------------------------------------- slow loris


def test_a_thousand_slow_loris_connections_are_closed_and_do_not_block_others(limited: tuple[ApiProcess, Path]) -> None:
    """1000 connections: some send nothing, some half a request line, some drip one header byte
    at a time (which reset uvicorn's only timer before). Meanwhile a normal request completes;
    the server closes every one of them past the 2 s header deadline, counts each close, and says
    so in a few batched warnings (not one line per connection)."""
    api, log = limited
    before = _metric(api, 'splitbus_api_connections_closed_total{reason="header_timeout"}')
    warned = _warnings(log, "that sent no complete headers")
    socks = [_raw(api) for _ in range(1000)]
    for i, sock in enumerate(socks):
        if i % 3:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    dripping = socks[1:30:3]
    for _ in range(6):  # 3 s of one byte every 0.5 s on each dripping one
        for sock in dripping:
            _send_quietly(sock, b"X")
        time.sleep(0.5)
    _normal_request_works(api)
    closed = sum(_closed_by_server(sock) for sock in socks)
    for sock in socks:
        sock.close()
    assert closed == 1000
    _normal_request_works(api)
    assert b"Traceback" not in log.read_bytes()
    assert _metric(api, 'splitbus_api_connections_closed_total{reason="header_timeout"}') - before == 1000
    batches = _warnings(log, "that sent no complete headers")[len(warned) :]
    assert 1 <= len(batches) <= 5, batches
    assert sum(int(re.search(r"closed (\d+) connection", line)[1]) for line in batches) <= 1000  # type: ignore[index]


def _warnings(log: Path, what: str) -> list[str]:
    return [line for line in log.read_text().splitlines() if "WARNING" in line and what in line]


def test_headers_over_the_size_bound_get_431(limited: tuple[ApiProcess, Path]) -> None:
    api, _ = limited
    before = _metric(api, 'splitbus_api_connections_closed_total{reason="header_too_large"}')
    with _raw(api) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        _send_quietly(sock, b"X-Pad: " + b"p" * (128 * 1024))
        reply = _response(sock)
    assert reply.startswith(b"HTTP/1.1 431")
    _normal_request_works(api)
    assert _metric(api, 'splitbus_api_connections_closed_total{reason="header_too_large"}') - before == 1


def _wait_until(condition: object, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached in time")


@pytest.mark.parametrize(
    "head",
    [
        b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n",  # answered without reading the body
        _head(1_000_000),  # read by the app: its 408 goes out, then the connection is cut off all the same
    ],
)
def test_a_dripped_body_is_cut_off_even_where_no_route_reads_it(limited: tuple[ApiProcess, Path], head: bytes) -> None:
    """A route that answers without reading the body (``/health``, a 401, a 404) used to leave
    the connection to a client dripping the body it declared, for good: the protocol's body
    deadline (the app's 2 s + 2 s of grace here) closes it."""
    api, log = limited
    sock = _raw(api)
    sock.sendall(head)
    started = time.monotonic()
    with contextlib.suppress(OSError):  # the server closing ends the drip
        while time.monotonic() - started < 8:  # one byte every 0.5 s, for at most 8 s
            sock.sendall(b"x")
            time.sleep(0.5)
    assert _closed_by_server(sock)
    sock.close()
    _normal_request_works(api)
    assert b"Traceback" not in log.read_bytes()


def test_a_connection_over_the_bound_gets_429_with_retry_after_not_a_reset(
    redis_server: EmbeddedRedis, tiny_model: Path, prefix: str, responder: Responder
) -> None:
    """Connections over --max-connections are answered at once, before their request is read:
    a 429 the client can read (a lingering close), never a reset."""
    api = start_api(redis_server.url, prefix, [tiny_model], "--max-connections", "3")
    try:
        _wait_for_model(api)
        with contextlib.ExitStack() as held:
            for _ in range(3):  # idle connections: they hold the three places
                held.enter_context(_raw(api))
            time.sleep(0.2)
            with _raw(api) as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                reply = _response(sock)
        assert reply.startswith(b"HTTP/1.1 429") and b"retry-after: 1" in reply.lower()
        assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "rate_limit_exceeded"
        _wait_until(lambda: httpx.get(api.url + "/health", timeout=5).status_code == 200)  # room again
        assert _metric(api, 'splitbus_api_connections_closed_total{reason="too_many_connections"}') >= 1
    finally:
        stop_api(api)
