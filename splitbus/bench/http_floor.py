"""The HTTP floor: what the benchmark's client and one HTTP server cost a request, with nothing
behind the server.

``bench serve`` compares the stack with its engine driven in-process, so the TTFT it says the
stack adds includes the client's request and the HTTP round trip, which any engine served over
HTTP pays (vLLM's or SGLang's own API server; a router in front of one). This server measures
that part alone: a Starlette app on uvicorn, with the API's loop and HTTP parser, that answers
``POST /v1/completions`` by streaming ``max_tokens`` one-character chunks at once, in the SSE
shape the benchmark's client reads.

Run as ``python -m splitbus.bench.http_floor PORT`` (``measure_http_floor`` starts it).
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import numpy as np
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

START_TIMEOUT_S = 30.0


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


def measure_http_floor(model: str, prompt_len: int, count: int = 50) -> dict[str, float]:
    """TTFT p50 and p90 (ms) of ``count`` requests one at a time (after 5 of warm-up), as
    ``hop_breakdown`` times the stack's, through the same client."""
    from splitbus.redis_server import die_with_parent, free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "splitbus.bench.http_floor", str(port)], preexec_fn=die_with_parent)
    try:
        _wait_listening(port, proc)
        ttft = asyncio.run(_sequential(f"http://127.0.0.1:{port}", model, prompt_len, count + 5))[5:]
    finally:
        proc.terminate()
        proc.wait(10)
    return {"p50": float(np.median(ttft)), "p90": float(np.percentile(ttft, 90))}


def _wait_listening(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the HTTP floor server exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"the HTTP floor server did not listen on port {port} within {START_TIMEOUT_S:g} s")


async def _sequential(base_url: str, model: str, prompt_len: int, count: int) -> list[float]:
    from splitbus.bench.serve import FIRST_TOKEN_ID, HttpClient
    from splitbus.bench.serve_trace import TraceItem

    client = HttpClient(base_url, model, "", 1)
    ttft = []
    try:
        for i in range(count):
            result = await client.send(TraceItem(0.0, [FIRST_TOKEN_ID + i % 50] * prompt_len, 2))
            if not result.ok:
                raise RuntimeError(f"the HTTP floor server failed a request: {result.error}")
            ttft.append(result.ttft_s * 1000)
            await asyncio.sleep(0.02)
    finally:
        await client.close()
    return ttft


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app(), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", loop="auto", http="httptools")
