"""One generation request, from admission to its last byte: publish it on the bus, then relay
its result stream as SSE or as one JSON body."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from splitbus.api import metrics, protocol, spans, tools
from splitbus.api.errors import (
    ApiError,
    BadRequest,
    ChatTemplateLimitExceeded,
    ContextLengthExceeded,
    GatewayTimeout,
    ServiceUnavailable,
    from_failure,
)
from splitbus.api.limits import Lease
from splitbus.api.logprobs import Choice, merged
from splitbus.api.protocol import GenerationParams
from splitbus.api.state import ApiState
from splitbus.api.tenants import cache_salt
from splitbus.bus.blocks import chain_hex
from splitbus.bus.core import hopmarks
from splitbus.bus.core.connection import TRANSIENT_ERRORS
from splitbus.bus.messages import Failed, Finished, GenerateRequest, Result, SamplingParams, TokenDelta
from splitbus.bus.messages._check import PRIORITY_RANGE
from splitbus.bus.results import ClientLeft, Subscription
from splitbus.grammar.outcomes import GrammarError
from splitbus.grammar.request import GrammarSpec, compile_grammar
from splitbus.grammar.tokenizer import grammar_tokenizer
from splitbus.tokenization import ModelTokenizer
from splitbus.tokenization.tokenizer import ChatTemplateError, ChatTemplateLimit

log = logging.getLogger(__name__)
T = TypeVar("T")
INLINE_TOKENIZE_CHARS = 4096
"""Prompts up to this many characters are tokenized on the event loop (tens of microseconds)."""
ON_LOOP_PREFIX_TOKENS = 2048
"""Prompts up to this many tokens are hashed for routing on the event loop (~0.15 ms)."""
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
TEMPLATE_LIMIT_MESSAGE = "The model's chat template went past its time or memory bound on these messages"
TEMPLATE_ERROR_MESSAGE = "The model's chat template failed on these messages"
DEADLINE_GRACE_S = 2.0
"""How long past the deadline the API waits for the worker's own timeout error."""


class ClientDisconnected(Exception):
    """The client went away while we waited; the request is cancelled on the bus."""


async def generate(request: Request, params: GenerationParams) -> Response:
    """Answer a request of one choice (``choices.respond`` sends those of ``n`` > 1 elsewhere)."""
    (generation,) = await prepare(request, params)
    return await answer(request, generation)


async def prepare(request: Request, params: GenerationParams) -> list[Generation]:
    """Check and tokenize the request; its choices, one ``Generation`` each (``n``), not published."""
    state: ApiState = request.state.api
    tokenizer = state.tokenizer(params.model)
    check_prompt_chars(state.config.prompt_char_limit(tokenizer.context_length), params)
    request_id = f"{'chatcmpl' if params.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    request.state.request_id = request_id  # what an error's body and log name
    if hopmarks.on:
        for name, ns in getattr(request.state, "hop_marks", ()):
            hopmarks.mark(request_id, name, ns)
    prompt_ids = await tokenize(state, tokenizer, params, request_id)
    if hopmarks.on:
        hopmarks.mark(request_id, "api.tokenized")
    max_tokens = resolve_max_tokens(tokenizer, params, len(prompt_ids))
    protocol.check_prompt_scores(params, len(prompt_ids))
    protocol.check_logits_options(params.logits, tokenizer.vocab_size, max_tokens)
    salt = cache_salt(request.state.tenant, params.cache_salt)
    queueing = Queueing(request_priority(request, params), request_tenant(request))
    prefix = await prefix_hashes(state, prompt_ids, salt)
    grammar = await request_grammar(state, tokenizer, params.grammar, request_id)
    trace = spans.of(request)
    if hopmarks.on:
        hopmarks.mark(request_id, "api.prepared")
    if params.n == 1:
        return [
            Generation(
                state, params, prompt_ids, max_tokens, prefix, salt, request_id, grammar, queueing=queueing, trace=trace
            )
        ]
    return [
        Generation(
            state,
            params,
            prompt_ids,
            max_tokens,
            prefix,
            salt,
            f"{request_id}-{i}",
            grammar,
            i,
            request_id,
            queueing,
            trace,
        )
        for i in range(params.n)
    ]


@dataclasses.dataclass(frozen=True)
class Queueing:
    """Where a request stands in a scheduler's waiting queue (docs/tenants.md, "Priorities and fair share")."""

    priority: int = 0
    """``GenerateRequest.priority``: lower is handled earlier."""
    tenant: str = ""
    """``GenerateRequest.tenant``: the API key's tenant's name ("" the default tenant)."""


def request_tenant(request: Request) -> str:
    """The name of the request's tenant (``request.state.tenant_name``, set by the API's key
    check), "" for the default tenant."""
    name = getattr(request.state, "tenant_name", "")
    return name if isinstance(name, str) else ""


def request_priority(request: Request, params: GenerationParams) -> int:
    """The request's priority: its tenant's (``request.state.tenant_limits``, set by the API's key
    check; 0 without one), held to the bus's range; the body's ``priority`` may ask for a later
    one (a larger number), never an earlier one: a client cannot put itself before the tenants
    an operator ranked above it."""
    default = getattr(getattr(request.state, "tenant_limits", None), "priority", None)
    low, high = PRIORITY_RANGE
    tenants = min(max(default, low), high) if type(default) is int else 0
    return tenants if params.priority is None else max(params.priority, tenants)


async def answer(request: Request, generation: Generation) -> Response:
    """Admit, publish and answer one request: SSE, or the whole body."""
    state, params = generation.state, generation.params
    spans.enter(generation.trace, "api.admission")
    state.admit(params.model, generation.queueing.tenant, generation.timeout_s, generation.queueing.priority)
    try:
        await generation.limit(request)
        spans.enter(generation.trace, "api.request_entry")
        await generation.publish()
        spans.enter(generation.trace, "")
        first = await generation.first_result(request)
        if hopmarks.on:
            hopmarks.mark(generation.request_id, "api.resumed")
        spans.enter(generation.trace, "api.stream_back")
    except BaseException as exc:
        generation.close(cancel_reason(exc))
        raise
    if isinstance(first, Failed):  # nothing sent yet: answer with the error's own status
        generation.close(None)
        raise generation.failure(first)
    if params.stream:
        return EventStream(generation.sse(first), media_type="text/event-stream", headers=SSE_HEADERS)
    return JSONResponse(await generation.collect(request, first))


def check_prompt_chars(limit: int, params: GenerationParams) -> None:
    """Refuse a prompt that cannot fit before any tokenizing: it is longer, in characters, than
    the context could hold (config.MAX_CHARS_PER_TOKEN), or than --max-prompt-chars."""
    if params.messages is not None:
        chars = sum(len(m["content"]) for m in params.messages) + tools.extra_chars(params.messages, params.tools)
        param = "messages"
    else:
        chars, param = (len(params.prompt) if isinstance(params.prompt, str) else 0), "prompt"
    if chars > limit:
        raise ContextLengthExceeded(
            f"The {param} has {chars} characters; this server accepts at most {limit} for this model "
            f"(more cannot fit its context). Please reduce the length of the {param}.",
            param,
        )


async def tokenize(
    state: ApiState, tokenizer: ModelTokenizer, params: GenerationParams, request_id: str = "-"
) -> list[int]:
    """The prompt's token ids. Text is tokenized in the bounded thread pool unless it is short
    (a thread hop costs more than encoding a few KB, and such a prompt stalls the loop for
    microseconds only); the chat template (Python code of the model's) always runs there."""
    if params.messages is not None:
        messages, limit = params.messages, state.config.prompt_char_limit(tokenizer.context_length)
        listed = params.tools.template_tools() if params.tools else None
        return await state.off_loop(
            lambda: _encode(tokenizer, _render(state, tokenizer, messages, limit, request_id, listed))
        )
    if isinstance(params.prompt, str):
        prompt = params.prompt
        if len(prompt) <= INLINE_TOKENIZE_CHARS:
            return tokenizer.encode(prompt)
        return await state.off_loop(lambda: _encode(tokenizer, prompt))
    ids = list(params.prompt or [])
    if ids and (min(ids) < 0 or max(ids) >= tokenizer.vocab_size):
        raise BadRequest(f"token ids must be in [0, {tokenizer.vocab_size})", "prompt")
    return ids


def _render(
    state: ApiState,
    tokenizer: ModelTokenizer,
    messages: list[dict[str, Any]],
    max_chars: int,
    request_id: str,
    listed: list[dict[str, Any]] | None = None,
) -> str:
    """The chat prompt, rendered in a killable child held to the prompt-character bound (a longer
    one would be refused as a prompt), a time bound and a memory bound: the model's template
    fails its request, not the pool. The client reads a stable message; why, which may quote
    the template, goes to the log under the request id."""
    try:
        return state.templates.render(
            tokenizer.chat_template, tokenizer.special_tokens, messages, max_chars, tools=listed
        )
    except ChatTemplateLimit as exc:
        log.warning("request %s: the chat template of %s was stopped: %s", request_id, tokenizer.name, exc)
        raise ChatTemplateLimitExceeded(TEMPLATE_LIMIT_MESSAGE, "messages").for_request(request_id) from None
    except ChatTemplateError as exc:
        log.warning("request %s: the chat template of %s failed: %s", request_id, tokenizer.name, exc)
        raise BadRequest(TEMPLATE_ERROR_MESSAGE, "messages", "chat_template_error").for_request(request_id) from None


def _encode(tokenizer: ModelTokenizer, text: str) -> list[int]:
    # encode_batch releases the GIL while Rust tokenizes (encode does not): the event loop
    # thread runs meanwhile, instead of only between the pool thread's GIL switches.
    return tokenizer.encode_batch([text])[0]


async def prefix_hashes(state: ApiState, prompt_ids: list[int], salt: str = "") -> str:
    """The prompt's hash chain, salted with ``salt``, for cache-aware routing
    (``GenerateRequest.prefix_hashes``): ~70 ns a token, off the event loop for a long prompt."""
    size = state.config.prefix_block_size
    if size <= 0:
        return ""
    if len(prompt_ids) <= ON_LOOP_PREFIX_TOKENS:
        return chain_hex(prompt_ids[:-1], size, salt=salt)
    return await state.off_loop(lambda: chain_hex(prompt_ids[:-1], size, salt=salt))


async def request_grammar(
    state: ApiState, tokenizer: ModelTokenizer, spec: GrammarSpec | None, request_id: str = "-"
) -> str | None:
    """The request's structured-output grammar compiled for the model's vocabulary, as the bus
    carries it (None: unconstrained); a 400 naming the field when llguidance cannot serve it.
    Off the event loop: compiling takes up to milliseconds, and the model's first grammar builds
    llguidance's view of its vocabulary (~0.25 s for 49k tokens)."""
    if spec is None:
        return None
    try:
        return await state.off_loop(lambda: compile_grammar(spec, grammar_tokenizer(tokenizer)))
    except GrammarError as exc:  # the field's, or the model's tokenizer that llguidance cannot read
        raise BadRequest(str(exc), spec.field, "invalid_grammar").for_request(request_id) from None


def resolve_max_tokens(tokenizer: ModelTokenizer, params: GenerationParams, prompt_len: int) -> int:
    """The request's max_tokens, checked against the context (vLLM's rule and message)."""
    room = tokenizer.context_length - prompt_len
    if prompt_len == 0:
        raise BadRequest("the prompt is empty after tokenization", "prompt")
    if room <= 0 or (params.max_tokens is not None and params.max_tokens > room):
        asked = (
            f"{prompt_len + params.max_tokens} tokens ({prompt_len} in the messages/prompt, {params.max_tokens} for "
            "the completion)"
            if params.max_tokens is not None
            else f"{prompt_len} tokens in the messages/prompt"
        )
        raise ContextLengthExceeded(
            f"This model's maximum context length is {tokenizer.context_length} tokens. However, you requested "
            f"{asked}. Please reduce the length of the messages/prompt or the completion.",
            "max_tokens" if room > 0 else ("messages" if params.messages else "prompt"),
        )
    if params.max_tokens is not None:
        return params.max_tokens
    return 16 if params.kind == "completion" else room


class Generation:
    def __init__(
        self,
        state: ApiState,
        params: GenerationParams,
        prompt_ids: list[int],
        max_tokens: int,
        prefix: str = "",
        salt: str = "",
        request_id: str | None = None,
        grammar: str | None = None,
        index: int = 0,
        response_id: str | None = None,
        queueing: Queueing = Queueing(),
        trace: spans.RequestTrace | None = None,
    ) -> None:
        self.state = state
        self.trace = trace
        """Its ``api.request`` span, shared by a response's choices (``splitbus.api.spans``); None: untraced."""
        self.queueing = queueing
        """Its priority and tenant, as the bus carries them."""
        self.index = index
        """Its choice's index in the response (``n``): each choice is a request of its own on the bus."""
        self.grammar = grammar
        """The compiled structured-output grammar (``SamplingParams.grammar``), or None."""
        self.params = params
        self.prompt_ids = prompt_ids
        self.max_tokens = max_tokens
        self.prefix = prefix
        """The prompt's hash chain (``prefix_hashes``), of ``config.prefix_block_size``."""
        self.salt = salt
        """Its salt (``GenerateRequest.cache_salt``): the tenant's and the body's ``cache_salt``."""
        prefix = "chatcmpl" if params.kind == "chat" else "cmpl"
        self.request_id = request_id or f"{prefix}-{uuid.uuid4().hex}"
        self.response_id = response_id or self.request_id
        """The id the client sees: the request's, or with ``n`` > 1 the response's, of all its choices."""
        self.usage: dict[str, Any] | None = None
        """The choice's usage, once it finished (``n`` > 1 adds them up)."""
        self.usage_chunk = True
        """Whether its stream ends with a usage chunk (with ``include_usage``; ``n`` > 1 sends one for all)."""
        self.created = protocol.now_s()
        self.arrival = time.monotonic()
        self.sub: Subscription | None = None
        self.lease: Lease | None = None
        """Its hold on its tenant's limits (``limit``), ended when it closes; None: none taken."""
        self.output_tokens = 0
        """Tokens generated so far (charged to its tenant's limits when it closes)."""
        self._last_token_at: float | None = None
        self._closed = False
        self.tool_calls = (
            tools.ToolCallStream(tools.parser_for(params.tools, state.config.tool_call_parser))
            if params.tools is not None
            else None
        )
        """With tools: reads the calls out of the chat's text (``splitbus.api.tools``); None keeps
        that module off the path of the other requests."""

    @property
    def timeout_s(self) -> float:
        """Seconds from its start to its deadline: the body's ``timeout``, held to the server's
        ``--request-timeout`` (a client may ask for less time, never for more)."""
        server_s = self.state.config.request_timeout_s
        return server_s if self.params.timeout is None else min(self.params.timeout, server_s)

    def message(self) -> GenerateRequest:
        """The request as the bus carries it. The bus bounds every field itself (a scheduler would
        dead-letter an entry past them); a value the API's own checks let through but the bus
        refuses is the client's error, a 400, not a 500."""
        p = self.params
        deadline_ms = int((time.time() + self.timeout_s) * 1000)
        try:
            sampling = SamplingParams(
                max_tokens=max(self.max_tokens, 1),  # echo with max_tokens 0: one token, not shown
                temperature=p.temperature,
                top_p=p.top_p,
                top_k=p.top_k,
                seed=protocol.choice_seed(p.seed, self.index),
                stop=p.stop,
                ignore_eos=p.ignore_eos,
                skip_special_tokens=p.skip_special_tokens,
                spaces_between_special_tokens=p.spaces_between_special_tokens,
                logprobs=p.logprobs,
                prompt_logprobs=p.prompt_top,
                **dataclasses.asdict(p.logits),
                grammar=self.grammar,
            )
            node, reader = self.state.config.node_id, self.state.reader.reader_of(self.request_id)
            return GenerateRequest(
                self.request_id,
                p.model,
                self.prompt_ids,
                sampling,
                node,
                deadline_ms,
                reader,
                self.prefix,
                self.state.config.prefix_block_size if self.prefix else 0,
                self.salt,
                p.n,
                self.response_id if p.n > 1 else "",
                self.queueing.priority,
                self.queueing.tenant,
                "" if self.trace is None else self.trace.traceparent,
            )
        except ValueError as exc:  # the bus's own text (its field names, bounds): logged, not sent
            log.warning("request %s refused by the bus's bounds: %s", self.request_id, exc)
            raise BadRequest("A parameter is outside the bounds this server accepts").for_request(
                self.request_id
            ) from None

    @functools.cached_property
    def choice(self) -> Choice:
        """The response's choice as results come (its text, with the prompt when echoed, and logprobs)."""
        p, tokenizer = self.params, self.state.tokenizer(self.params.model)
        echoed = "" if not p.echo else p.prompt if isinstance(p.prompt, str) else None
        prompt_text = echoed if echoed is not None else tokenizer.decode(self.prompt_ids, skip_special_tokens=False)
        return Choice(p, self.prompt_ids, self.state.token_labels(p.model), prompt_text)

    async def limit(self, request: Request, choices: Sequence[Generation] = ()) -> None:
        """Take the request's tenant's limits (429 when one has no room) for the response: its
        ``choices`` (default: this one) count as one request, their prompt once."""
        group = list(choices) or [self]
        lease = await self.state.limits.admit(request, len(self.prompt_ids), self.response_id, len(group))
        for generation in group:
            generation.lease = lease

    async def publish(self) -> None:
        """Subscribe, then XADD: the reader starts at the stream's beginning, so no entry is
        missed however fast the workers answer."""
        if hopmarks.on:
            hopmarks.mark(self.request_id, "api.admitted")
        await self.subscribe()
        await self.submitted(self.state.submit(self.message()))
        if hopmarks.on:
            hopmarks.mark(self.request_id, "api.written")

    async def subscribe(self) -> None:
        """Follow the request's result stream (before its entry is written: ``publish``)."""
        self.sub = await self.state.reader.subscribe(self.request_id)
        self.sub.expire_at(asyncio.get_running_loop().time() + self.timeout_s + DEADLINE_GRACE_S)

    async def submitted(self, submit: Awaitable[None]) -> None:
        """Await the write of the request's entry (its own, or its response's choices' at once)."""
        try:
            await submit
        except TRANSIENT_ERRORS as exc:
            log.warning("request %s not published: Redis is unreachable: %s", self.request_id, exc)
            metrics.REFUSALS.add(self.queueing.tenant, "unavailable", "with 503: Redis could not take them")
            raise ServiceUnavailable("Redis is unreachable; retry later").for_request(self.request_id) from None
        metrics.PROMPT_TOKENS.inc(len(self.prompt_ids))
        metrics.admitted(self.queueing.tenant, len(self.prompt_ids))

    async def next_result(self) -> Result:
        assert self.sub is not None
        ready = self._ready()  # under load the next one is often here: no wait_for task then
        if ready is not None:
            return ready
        try:
            result = await self.sub.get()
        except TimeoutError:
            raise GatewayTimeout(f"the request did not finish within {self.timeout_s:g}s").for_request(
                self.request_id
            ) from None
        except ClientLeft:  # first_result's watcher saw the client leave: events() and collect() end quietly
            raise ClientDisconnected(self.request_id) from None
        self._observe(result)
        if hopmarks.on:  # the token path's "handler resumed" (a result that was here already waited for nothing)
            hopmarks.mark_entry(self.request_id, result.seq, "tok.resumed")
        return result

    async def first_result(self, request: Request) -> Result:
        """The first result, unless the client disconnects first (then the request is
        cancelled). Awaited in the request's own task, which the reader's delivery wakes
        directly: ``until_disconnect`` waits in a task of its own and wakes this one after it,
        two more turns of the loop on every request's first token (docs/benchmarks.md, "Each
        hop, to the microsecond"). The watcher only tells the subscription that the client left."""
        ready = self._ready()
        if ready is not None:
            return ready
        assert self.sub is not None
        watch = _Watch(self.sub)
        watcher = asyncio.ensure_future(_disconnected(request))
        watcher.add_done_callback(watch.ended)
        try:
            return await self.next_result()
        finally:
            # A disconnect in the loop turn the result came in runs ``ended`` after this returned:
            # disarmed, it leaves the subscription alone (the stream's own listener sees the disconnect).
            watch.armed = False
            watcher.cancel()

    async def until_disconnect(self, request: Request, work: Awaitable[T]) -> T:
        """Await ``work`` unless the client disconnects first (then cancel the request)."""
        task = asyncio.ensure_future(work)
        watcher = asyncio.ensure_future(_disconnected(request))
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            watcher.cancel()
            return task.result()
        task.cancel()
        raise ClientDisconnected(self.request_id)

    async def collect(self, request: Request, first: Result) -> dict[str, Any]:
        """The whole response, for ``stream: false``."""
        try:
            body = await self.until_disconnect(request, self._collect(first))
        except BaseException as exc:
            self.close(cancel_reason(exc))
            raise
        self.close(None)
        return body

    async def _collect(self, result: Result) -> dict[str, Any]:
        results: list[TokenDelta | Finished] = []
        while True:
            if isinstance(result, Failed):
                raise self.failure(result)
            results.append(result)
            if isinstance(result, Finished):
                whole = merged(results)
                piece = self.choice.piece(whole)
                body = protocol.full_response(
                    self.params,
                    self.response_id,
                    self.created,
                    piece.text,
                    self._finish_reason(result),
                    self._usage(result),
                    piece.logprobs,
                    piece.prompt_logprobs,
                )
                if self.tool_calls is not None:
                    body = {**body, "choices": [self.tool_calls.fill(c) for c in body["choices"]]}
                body["choices"][0]["index"] = self.index
                return body
            result = await self.next_result()

    def _finish_reason(self, finished: Finished) -> str:
        """Echo with ``max_tokens`` 0 generated nothing it shows: it ends on its length, as vLLM's."""
        return "length" if self.choice.echo_only else finished.finish_reason

    def _usage(self, finished: Finished) -> dict[str, Any]:
        shown = 0 if self.choice.echo_only else finished.completion_tokens
        return protocol.usage(finished.prompt_tokens, shown, finished.cached_tokens)

    def _mark_sse(self, merged: list[Result]) -> None:
        """Hop marks: the first event built (``api.sse``), and each entry's (``tok.sse``)."""
        hopmarks.mark(self.request_id, "api.sse")
        for result in merged:
            hopmarks.mark_entry(self.request_id, result.seq, "tok.sse")

    async def sse(self, first: Result) -> AsyncIterator[bytes]:
        """Server-sent events, then the end of the stream."""
        async for event in self.events(first):
            yield event
        yield b"data: [DONE]\n\n"

    async def events(self, first: Result) -> AsyncIterator[bytes]:
        """The choice's server-sent events; an error after the headers went out becomes an error event."""
        reason: str | None = "client_disconnected"  # unless the loop below ends the stream
        try:
            head = self._role_chunk() if self.params.kind == "chat" else b""
            result, opening = first, True
            while True:
                # A chat's role chunk goes out with its first token's events, in one write (the
                # first, which ``EventStream`` sends from the request's own task). The first pass
                # always yields, b"" when the first token shows nothing (part of a character): the
                # wait for the next result is then Starlette's, under its disconnect listener.
                chunk, merged = self._chunk_of(result, head)
                result, head = merged[-1], b""
                if chunk or opening:
                    if hopmarks.on and chunk:
                        self._mark_sse(merged)
                    yield chunk
                    opening = False
                if result.terminal:
                    break
                result = await self.next_result()
            reason = None
        except ClientDisconnected:
            return  # the client is gone: nothing to send it (``reason`` says why the request is cancelled)
        except ApiError as exc:
            reason = cancel_reason(exc)
            yield event(exc.body())
        finally:
            self.close(reason)

    def _chunk_of(self, result: Result, head: bytes) -> tuple[bytes, list[Result]]:
        """``head`` and the events of ``result`` and those ready after it (``_merge_ready``), and those results."""
        merged = self._merge_ready(result)
        return head + b"".join(event for r in merged for event in self._events(r)), merged

    def _role_chunk(self) -> bytes:
        """A chat stream's first chunk: the assistant's role, no content yet (as OpenAI's)."""
        delta = {"role": "assistant", "content": ""}
        return self._out(protocol.chat_chunk(self.response_id, self.created, self.params.model, delta, None))

    def _merge_ready(self, result: Result) -> list[Result]:
        """Token deltas that have arrived together go out as one event with their text joined
        (as vLLM's stream interval does): under load a client gets fewer, larger chunks, and
        the API writes once per stream instead of once per token. An error that arrived with
        them follows as its own event."""
        together: list[TokenDelta | Finished] = [result] if not isinstance(result, Failed) else []
        while together and isinstance(together[-1], TokenDelta) and (ready := self._ready()) is not None:
            if isinstance(ready, Failed):
                return [merged(together), ready]
            together.append(ready)
        return [merged(together)] if together else [result]

    def _ready(self) -> Result | None:
        assert self.sub is not None
        ready = self.sub.get_nowait()
        if ready is not None:
            self._observe(ready)
        return ready

    def _events(self, result: Result) -> list[bytes]:
        if isinstance(result, Failed):
            return [event(self.failure(result).body())]
        finish = self._finish_reason(result) if isinstance(result, Finished) else None
        piece = self.choice.piece(result)
        shown = piece.text or finish or (piece.logprobs and any(piece.logprobs.values()))
        events = [self._chunk(piece.text, finish, piece.logprobs)] if shown else []
        if isinstance(result, Finished):
            self.usage = self._usage(result)
            if self.params.include_usage and self.usage_chunk:
                events.append(event(protocol.usage_chunk(self.params, self.response_id, self.created, self.usage)))
        return events

    def _chunk(self, text: str, finish: str | None, logprobs: dict[str, Any] | None = None) -> bytes:
        rid, model = self.response_id, self.params.model
        if self.params.kind == "chat" and self.tool_calls is not None:
            return self._tool_chunks(text, finish, logprobs)
        if self.params.kind == "chat":
            delta = {"content": text} if text else {}
            return self._out(protocol.chat_chunk(rid, self.created, model, delta, finish, logprobs))
        return self._out(protocol.completion_chunk(rid, self.created, model, text, finish, logprobs))

    def _out(self, chunk: dict[str, Any]) -> bytes:
        """A chunk of this choice as an event: its ``index`` in the response."""
        chunk["choices"][0]["index"] = self.index
        return event(chunk)

    def _tool_chunks(self, text: str, finish: str | None, logprobs: dict[str, Any] | None) -> bytes:
        """A chat with tools: its content and the calls read from it (``tools.ToolCallStream``).
        The text's logprobs go with its first chunk, or with an empty delta when the parser holds
        all of it back (a call not complete yet): every token's logprobs are sent once, in order."""
        rid, model = self.response_id, self.params.model
        assert self.tool_calls is not None
        chunks = self.tool_calls.deltas(text, finish) or ([({}, None)] if logprobs else [])
        return b"".join(
            self._out(protocol.chat_chunk(rid, self.created, model, delta, reason, logprobs if i == 0 else None))
            for i, (delta, reason) in enumerate(chunks)
        )

    def failure(self, failed: Failed) -> ApiError:
        """The client's error for a worker's or scheduler's error entry; its own message (worker
        ids, exception text) is logged here, under the request id the client is given."""
        log.warning(
            "request %s failed (status %d, code %s): %s", self.request_id, failed.status, failed.code, failed.message
        )
        return from_failure(failed.status, failed.code, self.request_id)

    def _observe(self, result: Result) -> None:
        if self._last_token_at is None:  # it runs on a worker: a lost entry is not the API's to publish again
            self.state.started(self.request_id)
        now = time.monotonic()
        if isinstance(result, TokenDelta) or (isinstance(result, Finished) and result.token_ids):
            metrics.GENERATION_TOKENS.inc(len(result.token_ids))
            metrics.TENANT_GENERATION_TOKENS.labels(metrics.TENANT_LABEL(self.queueing.tenant)).inc(
                len(result.token_ids)
            )
            self.output_tokens += len(result.token_ids)
            if self._last_token_at is None:
                metrics.TTFT.observe(now - self.arrival)
                metrics.TENANT_TTFT.labels(metrics.TENANT_LABEL(self.queueing.tenant)).observe(now - self.arrival)
            else:
                metrics.ITL.observe(now - self._last_token_at)
            self._last_token_at = now
        if result.terminal:
            metrics.E2E.observe(now - self.arrival)

    def close(self, cancel: str | None) -> None:
        """Release the request's slot and subscription. With a reason, the request did not end
        on the workers' side: cancel it on the bus, so they free its KV blocks and queues."""
        if self._closed:
            return
        self._closed = True
        self.state.started(self.request_id)
        if self.sub is not None:
            self.state.reader.unsubscribe(self.sub)
            if cancel is not None:
                self.state.cancel_later(self.request_id, cancel)
        self.state.release()
        if self.lease is not None:
            self.lease.done(self.output_tokens)


def cancel_reason(exc: BaseException) -> str | None:
    """Why a request that failed with ``exc`` must be cancelled on the bus, if it must.
    An error a worker reported has ended the request already."""
    if isinstance(exc, GatewayTimeout):
        return "deadline"
    if isinstance(exc, ApiError):
        return None if exc.status != 503 else "publish_failed"
    return "client_disconnected"


class EventStream(StreamingResponse):
    """A ``StreamingResponse`` whose start and first event go out from the request's own task.
    Starlette streams a body (under uvicorn's ASGI 2.3) from a task group: a task started for it,
    a turn of the loop before its first byte. The first event is ready when the response is made
    (``answer`` has the first result), so nothing waits here that a disconnect must interrupt;
    the rest streams as Starlette does, with its disconnect listener."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await super().__call__(scope, receive, send)
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        self.body_iterator = body = aiter(self.body_iterator)
        first = await anext(body, None)
        if first:  # an empty first chunk (``events``: its first token showed nothing) is not sent
            chunk = first if isinstance(first, bytes | memoryview) else first.encode(self.charset)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        return await super().__call__(scope, receive, send)

    async def stream_response(self, send: Send) -> None:
        """The rest of the body (``StreamingResponse``'s, less the start already sent), empty chunks left out."""
        async for chunk in self.body_iterator:
            body = chunk if isinstance(chunk, bytes | memoryview) else chunk.encode(self.charset)
            if body:
                await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


@dataclasses.dataclass(eq=False)
class _Watch:
    """``first_result``'s watch on its client: the subscription told when the client leaves,
    until ``armed`` is cleared (the first result returned)."""

    sub: Subscription
    armed: bool = True

    def ended(self, watcher: asyncio.Future[None]) -> None:
        """The watcher ended: unless it was cancelled or the wait is over, the client went away."""
        if self.armed and not watcher.cancelled():
            self.sub.leave()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
