"""The benchmarks' HTTP client: completions streamed over HTTP and timed chunk by chunk
(``HttpClient``), and the idle probe that sends them one at a time (``one_at_a_time``), which
``bench serve``, its HTTP floor and ``hop_trace`` share. Its own module so that ``serve`` and
``hop_trace``, which use each other's results, do not import each other."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from typing import Any

import orjson

from splitbus.bench.serve_trace import FIRST_TOKEN_ID, RequestResult, TraceItem


class HttpClient:
    """Streams completions over HTTP, parsing SSE with orjson; one connection per stream."""

    def __init__(self, base_url: str, model: str, api_key: str, max_concurrency: int) -> None:
        import httpx

        limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(base_url=base_url.rstrip("/"), limits=limits, timeout=600, headers=headers)
        self.model = model

    async def close(self) -> None:
        await self._client.aclose()

    async def send(self, item: TraceItem) -> RequestResult:
        body = {
            "model": self.model,
            "prompt": item.prompt_token_ids,
            "max_tokens": item.max_tokens,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream_options": {"include_usage": True},
        }
        result = RequestResult(ok=False, prompt_tokens=len(item.prompt_token_ids))
        started = last = time.perf_counter()
        try:
            async with self._client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                    return result
                async for line in response.aiter_lines():
                    last = self._on_line(line, result, started, last)
        except Exception as exc:  # a failed request is a result, not the end of the run
            result.error = f"{type(exc).__name__}: {exc}"
            return result
        result.e2el_s = time.perf_counter() - started
        result.ok = result.output_tokens > 0 and not result.error
        return result

    @staticmethod
    def _on_line(line: str, result: RequestResult, started: float, last: float) -> float:
        if not line.startswith("data: ") or line == "data: [DONE]":
            return last
        chunk = orjson.loads(line[6:])
        if chunk.get("usage"):
            result.output_tokens = chunk["usage"]["completion_tokens"]
            result.cached_tokens = cached_tokens(chunk["usage"])
        if "error" in chunk:
            result.error = str(chunk["error"].get("message"))
        if not chunk.get("choices") or not chunk["choices"][0].get("text"):
            return last
        now = time.perf_counter()
        if result.ttft_s == 0.0:
            result.ttft_s = now - started
        else:
            result.itl_s.append(now - last)
        return now


def cached_tokens(usage: Any) -> int:
    """``usage.prompt_tokens_details.cached_tokens``, OpenAI's field; 0 where the server does
    not report it (or reports something that is not a count)."""
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if type(cached) is int and cached >= 0 else 0


PROBE_WARMUP = 5
"""Requests sent one at a time before those that are timed (``hop_trace.breakdown``, the HTTP floor)."""
HOPS = (
    "client send -> request XADD",
    "request XADD -> task XADD",
    "task XADD -> first token XADD",
    "first token XADD -> client",
    "TTFT",
)


async def one_at_a_time(
    base_url: str, model: str, prompt_len: int, count: int
) -> AsyncGenerator[tuple[float, RequestResult], None]:
    """``PROBE_WARMUP`` requests, then ``count`` more, one at a time: when each was sent (epoch
    s) and its result, for those after the warm-up. The idle probe of ``hop_trace`` (each hop,
    each step) and of the HTTP floor."""
    client = HttpClient(base_url, model, "", 1)
    try:
        for i in range(PROBE_WARMUP + count):
            sent = time.time()
            result = await client.send(TraceItem(0.0, [FIRST_TOKEN_ID + i % 50] * prompt_len, 2))
            if not result.ok:
                raise RuntimeError(f"{base_url} failed a request: {result.error}")
            if i >= PROBE_WARMUP:
                yield sent, result
            await asyncio.sleep(0.02)
    finally:
        await client.close()
