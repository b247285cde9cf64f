"""The HTTP floor: what the benchmark's client and one HTTP server cost a request, with nothing
behind the server.

``bench serve`` compares the stack with its engine driven in-process, so the TTFT it says the
stack adds includes the client's request and the HTTP round trip, which any engine served over
HTTP pays (vLLM's or SGLang's own API server; a router in front of one). This server measures
that part alone: a Starlette app on uvicorn, with the API's loop and HTTP parser, that answers
``POST /v1/completions`` by streaming ``max_tokens`` one-character chunks at once, in the SSE
shape the benchmark's client reads.

Run as ``python -m splitbus.bench.http_floor PORT`` (``serving`` starts it; ``bench serve``
times it with its own client, ``splitbus.bench.serve.measure_http_floor``).
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


def app() -> Starlette:
    async def completions(request: Request) -> StreamingResponse:
        body = orjson.loads(await request.body())
        tokens = int(body.get("max_tokens") or 1)
        return StreamingResponse(_events(tokens), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


async def _events(tokens: int) -> AsyncIterator[bytes]:
    for _ in range(tokens):
        yield b"data: " + orjson.dumps({"choices": [{"index": 0, "text": "a"}]}) + b"\n\n"
    yield b"data: " + orjson.dumps({"choices": [], "usage": {"completion_tokens": tokens}}) + b"\n\n"
    yield b"data: [DONE]\n\n"


@contextlib.contextmanager
def serving() -> Iterator[str]:
    """The floor server, started as its own process for the block: its base URL."""
    from splitbus.redis_server import die_with_parent, free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "splitbus.bench.http_floor", str(port)], preexec_fn=die_with_parent)
    try:
        wait_listening(port, proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


def stop(proc: subprocess.Popen[bytes], grace_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM, and SIGKILL if ``proc`` has not exited within ``grace_s``: a server that hangs
    in its shutdown does not hang the benchmark (nor leave a process behind)."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_listening(port: int, proc: subprocess.Popen[bytes], name: str = "the HTTP floor server") -> None:
    """Return once ``proc`` (``name`` in the errors) listens on ``port``; RuntimeError if it exits
    or does not listen within ``START_TIMEOUT_S``."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{name} did not listen on port {port} within {START_TIMEOUT_S:g} s")


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(
        app(),
        host="127.0.0.1",
        port=int(sys.argv[1]),
        log_level="warning",
        loop="auto",
        http="httptools",
        timeout_graceful_shutdown=2,  # a stream still open at SIGTERM does not hold the shutdown
    )
