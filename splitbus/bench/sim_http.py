"""The sim engine behind its own OpenAI HTTP server, as vLLM serves an engine: the baseline of
``splitbus bench serve --vs-direct-http``.

One process: a Starlette app on uvicorn (the API's loop and HTTP parser) whose
``POST /v1/completions`` streams SSE chunks in OpenAI's shape (vLLM's fields), fed by the same
engine loop that ``serve_direct`` drives in-process (``DirectLoop``: a worker's capacities, the
sim engine's costs and its prefix cache, as ``splitbus up --engine sim`` builds them). What
splitbus adds over this server is what it adds over an engine that a client, or a router in
front of it, reaches over HTTP: the number the Rust routers are known by.

Run as ``python -m splitbus.bench.sim_http PORT MODEL_DIR MODEL_NAME`` (``serving`` starts it).
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from splitbus.bench.http_floor import stop, wait_listening
from splitbus.bench.serve_direct import DirectLoop, Pending, new_sequence
from splitbus.worker.sequence import Sequence

MAX_BODY_BYTES = 4 << 20
MAX_PROMPT_TOKENS = 32_768
MAX_OUTPUT_TOKENS = 4096
"""Bounds on a request: its body, its prompt and what it may ask for (a body is untrusted input)."""
TOKEN_TIMEOUT_S = 60.0
"""The longest a stream waits for its next token before it ends with an error: a stalled engine
fails its streams instead of holding the client (and the benchmark) forever."""


class BadRequest(ValueError):
    """A request body this server does not take; the message says why (HTTP 400, or 413)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class _Streamed(Pending):
    """A request whose tokens go to its HTTP response: (text, finish reason or None) each."""

    def __init__(self, seq: Sequence) -> None:
        super().__init__(seq)
        self.tokens: asyncio.Queue[tuple[str, str | None] | str] = asyncio.Queue()
        """Each token's (text, finish reason or None), or why the request failed."""

    def token(self, text: str) -> None:
        self.tokens.put_nowait((text, self.seq.finish_reason))

    def fail(self, message: str) -> None:
        self.tokens.put_nowait(message)
        super().fail(message)


def parse_request(body: bytes, vocab_size: int, model: str) -> tuple[list[int], int, bool]:
    """A completions body's prompt (token ids), ``max_tokens`` and whether it asks for the usage
    chunk; BadRequest naming what is wrong. It must stream (all this server does), and name
    ``model`` if it names one (404 otherwise, as vLLM answers)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise BadRequest("the body is not JSON") from None
    if not isinstance(data, dict):
        raise BadRequest("the body must be a JSON object")
    max_tokens = data.get("max_tokens", 16)
    if type(max_tokens) is not int or not 1 <= max_tokens <= MAX_OUTPUT_TOKENS:
        raise BadRequest(f"max_tokens must be an integer in [1, {MAX_OUTPUT_TOKENS}]")
    prompt = _prompt(data, vocab_size)
    if data.get("stream") is not True:
        raise BadRequest("this server only streams: stream must be true")
    if data.get("model", model) != model:
        raise BadRequest(f"the model {str(data.get('model'))[:100]!r} does not exist", 404)
    options = data.get("stream_options")
    return prompt, max_tokens, isinstance(options, dict) and options.get("include_usage") is True


def _prompt(data: dict[str, Any], vocab_size: int) -> list[int]:
    """The body's prompt: token ids only (the benchmark's client sends no text)."""
    prompt = data.get("prompt")
    if not isinstance(prompt, list) or not 1 <= len(prompt) <= MAX_PROMPT_TOKENS:
        raise BadRequest(f"prompt must be a list of 1 to {MAX_PROMPT_TOKENS} token ids")
    if not all(type(t) is int and 0 <= t < vocab_size for t in prompt):
        raise BadRequest(f"prompt token ids must be integers in [0, {vocab_size})")
    return prompt


async def _read_body(request: Request) -> bytes:
    """The body, at most ``MAX_BODY_BYTES`` (BadRequest 413 past it, before reading the rest)."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise BadRequest(f"the body is over {MAX_BODY_BYTES} bytes", 413)
    return bytes(body)


def admit(loop: DirectLoop, prompt: list[int], max_tokens: int) -> Sequence:
    """The request's sequence, if the engine can ever serve it: BadRequest 400 past the model's
    context length, 503 where it would never fit the KV pool or the engine loop has stopped."""
    context = loop.tokenizer.context_length
    if len(prompt) + max_tokens > context:
        message = f"{len(prompt)} prompt tokens + max_tokens {max_tokens} exceed the model's context length {context}"
        raise BadRequest(message)
    seq = new_sequence(loop.tokenizer, prompt, max_tokens)
    if refused := loop.refusal(seq):
        raise BadRequest(refused, 503)
    return seq


def app(model_dir: Path, model: str) -> Starlette:
    """The server over the model in ``model_dir``, served as ``model``; the engine loop runs
    for the app's lifespan."""
    loops: list[DirectLoop] = []

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        loops.append(DirectLoop.load(model_dir, model))
        engine = loops[0].start()
        try:
            yield
        finally:
            engine.cancel()

    async def completions(request: Request) -> Response:
        loop = loops[0]
        try:
            prompt, max_tokens, usage = parse_request(await _read_body(request), loop.tokenizer.vocab_size, model)
            pending = _Streamed(admit(loop, prompt, max_tokens))
        except BadRequest as exc:
            kind = "invalid_request_error" if exc.status < 500 else "server_error"
            return JSONResponse({"error": {"message": str(exc), "type": kind}}, status_code=exc.status)
        loop.submit(pending)
        return StreamingResponse(events(loop, pending, model, usage), media_type="text/event-stream")

    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": model, "object": "model", "owned_by": "splitbus"}]})

    routes = [Route("/v1/completions", completions, methods=["POST"]), Route("/v1/models", models)]
    return Starlette(routes=routes, lifespan=lifespan)


async def events(loop: DirectLoop, pending: _Streamed, model: str, usage: bool) -> AsyncIterator[bytes]:
    """One chunk per token, as vLLM streams a completion; then the usage chunk if asked, and
    ``[DONE]``. A failed request (or one whose next token takes over ``TOKEN_TIMEOUT_S``) ends
    with an error chunk instead. However it ends (its client gone included: the response is
    cancelled), it leaves the engine loop."""
    head: dict[str, Any] = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion"}
    head.update(created=int(time.time()), model=model)
    try:
        async for chunk in _chunks(pending, head):
            yield chunk
        if usage and pending.seq.finish_reason:  # not after an error chunk
            yield _sse({**head, "choices": [], "usage": _usage(pending.seq)})
        yield b"data: [DONE]\n\n"
    finally:
        loop.cancel(pending)  # nothing for a finished request


async def _chunks(pending: _Streamed, head: dict[str, Any]) -> AsyncIterator[bytes]:
    """The token chunks, until the last; an error chunk ends them early."""
    finish: str | None = None
    while finish is None:
        item = await _next(pending.tokens)
        if isinstance(item, str):
            yield _sse({"error": {"message": item, "type": "server_error", "code": 500}})
            return
        text, finish = item
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        yield _sse({**head, "choices": [choice]})


async def _next(tokens: asyncio.Queue[tuple[str, str | None] | str]) -> tuple[str, str | None] | str:
    """The next item of ``tokens``, or why none came within ``TOKEN_TIMEOUT_S``. Awaited in the
    calling task: ``asyncio.wait_for`` runs the wait as a task of its own on Python 3.11, a loop
    turn more per token on the baseline's ITL (``splitbus.aio.wait``)."""
    if not tokens.empty():
        return tokens.get_nowait()
    try:
        if sys.version_info >= (3, 11):
            async with asyncio.timeout(TOKEN_TIMEOUT_S):
                return await tokens.get()
        return await asyncio.wait_for(tokens.get(), TOKEN_TIMEOUT_S)
    except (TimeoutError, asyncio.TimeoutError):
        return f"no token within {TOKEN_TIMEOUT_S:g} s"


def _usage(seq: Sequence) -> dict[str, Any]:
    """OpenAI's usage, with the prompt tokens found in the prefix cache (as the API reports them)."""
    prompt, completion = seq.prompt_len, len(seq.output_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": seq.prompt_cached},
    }


def _sse(chunk: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


@contextlib.contextmanager
def serving(model_dir: Path, model: str) -> Iterator[str]:
    """The server, started as its own process for the block: its base URL."""
    from splitbus.redis_server import die_with_parent, free_port

    port = free_port()
    argv = [sys.executable, "-m", "splitbus.bench.sim_http", str(port), str(model_dir), model]
    proc = subprocess.Popen(argv, preexec_fn=die_with_parent)
    try:
        wait_listening(port, proc, "the sim engine's HTTP server")
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(
        app(Path(sys.argv[2]), sys.argv[3]),
        host="127.0.0.1",
        port=int(sys.argv[1]),
        log_level="warning",
        loop="auto",  # uvloop, as the worker's loop and the API's: its timers set the sim engine's sleeps
        http="httptools",
        timeout_graceful_shutdown=2,  # a stream still open at SIGTERM does not hold the shutdown
    )
