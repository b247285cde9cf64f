"""A response of ``n`` > 1 choices. Each choice is a request of its own on the bus (a
``Generation`` with its index and a seed derived from the request's: ``protocol.choice_seed``),
placed, prefilled, decoded, moved and cancelled as any request is; here they are admitted and
published together and relayed as one response: their chunks interleaved as they come, each with
its ``index``, or one body with every choice and their usage added up (the prompt counted once).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from splitbus.api import metrics, protocol, spans
from splitbus.api.generate import SSE_HEADERS, Generation, answer, cancel_reason, event, prepare
from splitbus.api.protocol import GenerationParams
from splitbus.bus.messages import Failed, Result

SIBLING_FAILED = "choice_failed"
"""Why a request's other choices are cancelled when one of them fails before any is answered."""


async def respond(request: Request, params: GenerationParams) -> Response:
    """Answer an OpenAI request: of one choice as ``generate.answer`` does, of several here."""
    many = await prepare(request, params)
    return await (answer(request, many[0]) if len(many) == 1 else generate_many(request, many))


async def generate_many(request: Request, many: list[Generation]) -> Response:
    """Admit, publish and answer every choice; if any cannot start, none is answered."""
    admitted: list[Generation] = []
    spans.enter(many[0].trace, "api.admission")
    try:
        for generation in many:
            queueing = generation.queueing
            generation.state.admit(generation.params.model, queueing.tenant, generation.timeout_s, queueing.priority)
            admitted.append(generation)
        await many[0].limit(request, many)
        firsts = await _firsts(request, many)
    except BaseException as exc:
        _close(admitted, cancel_reason(exc))
        raise
    if many[0].params.stream:
        for generation in many:
            generation.usage_chunk = False  # one for every choice, at the end
        return StreamingResponse(_interleaved(many, firsts), media_type="text/event-stream", headers=SSE_HEADERS)
    return JSONResponse(await _collected(request, many, firsts))


async def _firsts(request: Request, many: list[Generation]) -> list[Result]:
    """Every choice published, then each one's first result; a choice that failed at once fails
    the request (the others are cancelled), as one request would with its own status."""
    spans.enter(many[0].trace, "api.request_entry")
    await _publish(many)
    spans.enter(many[0].trace, "")
    firsts = [await g.until_disconnect(request, g.next_result()) for g in many]
    spans.enter(many[0].trace, "api.stream_back")
    failed = next(((g, f) for g, f in zip(many, firsts, strict=True) if isinstance(f, Failed)), None)
    if failed is not None:
        _close(many, SIBLING_FAILED)
        generation, first = failed
        assert isinstance(first, Failed)
        raise generation.failure(first)
    return firsts


async def _publish(many: list[Generation]) -> None:
    """Subscribe to every choice, then write them all in one transaction: one scheduler replica
    reads them together, places them together and P prefills them once (docs/api.md, "n").
    Every subscription is made before an error is raised, so the caller closes each one."""
    subscribed = await asyncio.gather(*(g.subscribe() for g in many), return_exceptions=True)
    error = next((e for e in subscribed if isinstance(e, BaseException)), None)
    if error is not None:
        raise error
    state = many[0].state
    await many[0].submitted(state.submit_together([g.message() for g in many]))
    for generation in many[1:]:
        metrics.PROMPT_TOKENS.inc(len(generation.prompt_ids))
        metrics.TENANT_PROMPT_TOKENS.labels(metrics.TENANT_LABEL(generation.queueing.tenant)).inc(
            len(generation.prompt_ids)
        )


async def _collected(request: Request, many: list[Generation], firsts: list[Result]) -> dict[str, Any]:
    tasks = [asyncio.ensure_future(g.collect(request, f)) for g, f in zip(many, firsts, strict=True)]
    try:
        bodies = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        _close(many, SIBLING_FAILED)  # the others still run on the workers: they are cancelled there
        raise
    body = bodies[0]
    body["choices"] = [b["choices"][0] for b in bodies]
    body["usage"] = _usage([b["usage"] for b in bodies])
    return body


async def _interleaved(many: list[Generation], firsts: list[Result]) -> AsyncIterator[bytes]:
    """Each choice's events as they come, then the usage of all (with ``include_usage``)."""
    events: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def relay(generation: Generation, first: Result) -> None:
        try:
            async for chunk in generation.events(first):
                await events.put(chunk)
        finally:
            await events.put(None)

    tasks = [asyncio.ensure_future(relay(g, f)) for g, f in zip(many, firsts, strict=True)]
    try:
        ended = 0
        while ended < len(tasks):
            chunk = await events.get()
            ended += chunk is None
            if chunk is not None:
                yield chunk
        usages = [g.usage for g in many if g.usage is not None]
        if many[0].params.include_usage and len(usages) == len(many):
            first = many[0]
            yield event(protocol.usage_chunk(first.params, first.response_id, first.created, _usage(usages)))
    finally:
        for task in tasks:
            task.cancel()
        _close(many, "client_disconnected")  # no-op for the choices that ended
    yield b"data: [DONE]\n\n"


def _usage(usages: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The choices' usage as one: the prompt once, every choice's completion tokens."""
    first = usages[0]
    completion = sum(u["completion_tokens"] for u in usages)
    cached = first.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return protocol.usage(first["prompt_tokens"], completion, cached)


def _close(many: Sequence[Generation], reason: str | None) -> None:
    for generation in many:
        generation.close(reason)
