"""Everything an API process holds, created in the app's lifespan (no module globals)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from splitbus.api import admission, metrics
from splitbus.api.config import ApiConfig
from splitbus.api.errors import ApiError, ModelNotFound, ServiceUnavailable, TooManyRequests
from splitbus.api.limits import LEASE_GRACE_S, TenantLimiter
from splitbus.api.logprobs import TokenLabels
from splitbus.api.placing import ApiPlacer
from splitbus.api.tenants import Authenticator
from splitbus.api.tenants_file import seed
from splitbus.bus.cancel import publish_cancel
from splitbus.bus.core.connection import TRANSIENT_ERRORS, connect
from splitbus.bus.core.loops import Loops
from splitbus.bus.core.streams import Producer
from splitbus.bus.limits import Limiter
from splitbus.bus.messages import GenerateRequest
from splitbus.bus.registry import Registry
from splitbus.bus.registry_view import RegistryView
from splitbus.bus.request_stream import Submissions, backlog, unplaced_requests
from splitbus.bus.results import ResultReader
from splitbus.bus.runs import Runs, ServerRuns
from splitbus.bus.tenants import TenantStore
from splitbus.tokenization import ModelTokenizer
from splitbus.tokenization.template_process import TemplateLimits, TemplatePool

log = logging.getLogger(__name__)
T = TypeVar("T")
RUNS_EVERY_S = 0.5
TEMPLATES_START_S = 10.0
"""The longest an API waits at start for its chat-template children to be up (they take ~0.5 s)."""
"""How often the API looks for a new Redis server run (one ``INFO server`` per primary)."""


class ApiState:
    def __init__(self, config: ApiConfig, tokenizers: dict[str, ModelTokenizer]) -> None:
        self.config = config
        self.tokenizers = tokenizers
        self._token_labels: dict[str, TokenLabels] = {}
        self.redis = connect(config.bus, max_connections=config.redis_connections, name=config.node_id)
        self.reader = ResultReader(config.bus, self.redis, name=f"{config.node_id}.out", shards=config.reader_shards)
        self.producer = Producer(self.redis, config.bus, batched=True)  # concurrent requests share XADD pipelines
        self.submissions = Submissions(self.redis, self.producer, config.bus.keys)
        self.runs = ServerRuns(self.redis, f"api {config.node_id}")
        self._resubmit_owed = False
        self.workers = RegistryView(Registry(self.redis, config.bus), self.redis)
        self.placer = (
            ApiPlacer(self.redis, config.bus, self.workers, config.dispatch_mode, config.node_id)
            if config.dispatch == "api"
            else None
        )
        """With ``--dispatch api``: what places requests here (``submit``)."""
        self.tenants = TenantStore(self.redis, config.bus.keys)
        self._seed_owed = bool(config.tenants)
        self.auth = Authenticator(config.api_keys, self.tenants, config.tenant_cache_s, config.tenant_cache_entries)
        """Who a key belongs to, and whether keys are required (``RequireApiKey``)."""
        self.limits = TenantLimiter(
            Limiter(self.redis, config.bus.keys), config.request_timeout_s + LEASE_GRACE_S, self.spawn
        )
        """Tenants' limits, checked with every other API node (``generate.Generation.limit``)."""
        self.inflight = 0
        self.backlog = 0
        self.unread = 0
        """Requests in the request stream no scheduler replica has read yet (early refusal's
        queue: read in arrival order, whatever their priority)."""
        self.held = 0
        """Requests a scheduler replica read and holds for a worker (early refusal's queue: ordered
        by priority, as the workers' queues are)."""
        self.prefill_rates = admission.PrefillRates()
        """Each model's measured prefill rate, for early refusal (``admit``)."""
        self.waiting = admission.Waiting()
        """This node's published requests not started yet, by priority: early refusal's estimate
        of the queue ahead's priorities (``refuse_late``)."""
        self.bodies = BodySlots(config)
        self.tokenizing = anyio.CapacityLimiter(config.tokenize_threads)
        self.templates = TemplatePool(TemplateLimits(workers=config.tokenize_threads))
        """Where chat templates render: one killable child per tokenizer thread (``template_process``)."""
        # A loop's bug stops the server (SIGTERM: uvicorn's own graceful shutdown), non-zero.
        self.loops = Loops(f"api {config.node_id}", part="the API", on_fail=lambda: signal.raise_signal(signal.SIGTERM))

    @classmethod
    async def open(cls, config: ApiConfig) -> ApiState:
        tokenizers = {name: ModelTokenizer.load(folder, name) for name, folder in config.models}
        state = cls(config, tokenizers)
        # Its children load Jinja now, not on the first chat request, and are up before the API says it is.
        await asyncio.to_thread(state.templates.start, TEMPLATES_START_S)
        with contextlib.suppress(*TRANSIENT_ERRORS):  # Redis away: keys are required until it answers
            await state.watch_tenants()
        await state.reader.start()
        await state.workers.refresh()
        state.loops.start(state.workers.follow, name="registry view")
        state.loops.start(state.read_backlog, every_s=config.registry_refresh_s)
        state.loops.start(state.watch_runs, every_s=RUNS_EVERY_S)
        state.loops.start(state.watch_tenants, every_s=config.tenant_cache_s, name="tenant store")
        return state

    async def submit(self, request: GenerateRequest) -> None:
        """Dispatch the request here (``--dispatch api``) or, when it is not placed here, write it
        to the request stream for the schedulers; either way it is held until it starts, to be
        submitted again after a new Redis run."""
        if self.placer is not None and await self.placer.place(request):
            self.submissions.hold(request)
        else:
            await self.submissions.submit(request)
        self.waiting.add(request.request_id, request.priority)

    async def submit_together(self, requests: Sequence[GenerateRequest]) -> None:
        """``submit`` the choices of one response: each placed here in order (``--dispatch
        api``), and those not placed here written for the schedulers as one transaction, so
        that one replica reads and places them together (docs/api.md, "n")."""
        placed = (
            await self.placer.place_together(list(requests)) if self.placer is not None else [False] * len(requests)
        )
        for request in (r for r, here in zip(requests, placed, strict=True) if here):
            self.submissions.hold(request)
        rest = [r for r, here in zip(requests, placed, strict=True) if not here]
        if rest:
            await self.submissions.submit_together(rest)
        for request in requests:  # each choice a request of the queue ahead, as the stream counts them
            self.waiting.add(request.request_id, request.priority)

    def started(self, request_id: str) -> None:
        """The request has its first result, or ended without one (refused, failed, cancelled,
        its client gone): nothing to submit again, and it no longer waits (called on every path:
        ``Generation.close``; twice is harmless)."""
        self.submissions.started(request_id)
        self.waiting.started(request_id)

    async def watch_tenants(self) -> None:
        """Put ``--tenants-file``'s tenants in the store (once: at start, or as soon as Redis takes
        them), then look whether the store holds a tenant (keys are then required)."""
        if self._seed_owed:
            await seed(self.tenants, self.config.tenants)
            self._seed_owed = False
        await self.auth.watch()

    async def watch_runs(self) -> None:
        """After a new Redis run, submit again the requests not yet started (owed until done: a
        Redis error on the way leaves it to the next step)."""
        if await self.runs.poll() is Runs.NEW:
            self._resubmit_owed = True
        if self._resubmit_owed:
            again = await self.submissions.resubmit()
            self._resubmit_owed = False
            if again:
                log.warning(
                    "api %s: after a new Redis run, %d request(s) not yet started: submitted again",
                    self.config.node_id,
                    again,
                )

    async def read_backlog(self) -> None:
        """The request stream's length and its entries not yet placed, at the registry's pace (never
        per request), and a reading of the workers' prefill counters (``admission.PrefillRates``)."""
        self.prefill_rates.observe(self.workers.live(), time.monotonic())
        with contextlib.suppress(*TRANSIENT_ERRORS):
            self.backlog = await backlog(self.redis, self.config.bus.keys)
            self.unread, self.held = await unplaced_requests(self.redis, self.config.bus.keys)

    async def close(self) -> None:
        self.workers.stop()
        await self.reader.close()
        await self.loops.close()
        await self.redis.aclose()
        await anyio.to_thread.run_sync(self.templates.close)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run in the background, kept referenced until done (cancellations outlive the
        handler that a client disconnect cancelled)."""
        self.loops.spawn(coro)

    def token_labels(self, model: str) -> TokenLabels:
        """How logprobs name ``model``'s tokens (made once per model, each label once per token)."""
        labels = self._token_labels.get(model)
        if labels is None:
            labels = self._token_labels[model] = TokenLabels(self.tokenizer(model))
        return labels

    def tokenizer(self, model: str) -> ModelTokenizer:
        try:
            return self.tokenizers[model]
        except KeyError:
            raise ModelNotFound(f"The model '{model}' does not exist", "model") from None

    async def off_loop(self, work: Callable[[], T]) -> T:
        """Run CPU-bound ``work`` (tokenizing, templating) in the bounded tokenizer pool, so the
        event loop keeps answering /health and streaming tokens meanwhile; 429 when too many
        requests already wait for a thread (each waiting one holds its prompt in memory)."""
        if self.tokenizing.statistics().tasks_waiting >= self.config.max_tokenize_queue:
            waiting = self.config.max_tokenize_queue
            raise TooManyRequests(f"more than {waiting} prompts wait to be tokenized; retry later")
        metrics.TOKENIZING.inc()
        try:
            # Not abandoned on cancel: a thread that still runs keeps its place, so the bound holds.
            return await anyio.to_thread.run_sync(work, limiter=self.tokenizing)
        finally:
            metrics.TOKENIZING.dec()

    def admit(self, model: str, tenant: str = "", timeout_s: float | None = None, priority: int = 0) -> None:
        """Take an in-flight slot for a request of ``tenant`` (its name; "" the default one) and
        ``priority`` whose deadline is ``timeout_s`` from now (None: the server's), or say why not
        (429 over the bound, 503 nobody to serve or not in time)."""
        if self.inflight >= self.config.max_inflight:
            message = f"more than {self.config.max_inflight} requests in flight; retry later"
            raise refused(tenant, "inflight", "with 429: too many requests in flight", TooManyRequests(message))
        if self.backlog >= self.config.max_backlog:
            message = f"the request queue holds {self.backlog} entries (bound {self.config.max_backlog}); retry later"
            raise refused(tenant, "backlog", "with 429: the request queue is full", TooManyRequests(message))
        if not self.workers.redis_ok:
            raise refused(
                tenant, "unavailable", "with 503: Redis is unreachable", ServiceUnavailable("Redis is unreachable")
            )
        if not self.workers.serves(model):
            message = f"no live worker serves model '{model}'"
            raise refused(tenant, "no_worker", "with 503: no live worker serves the model", ServiceUnavailable(message))
        self.refuse_late(model, tenant, timeout_s, priority)
        self.inflight += 1
        metrics.INFLIGHT.set(self.inflight)

    def refuse_late(self, model: str, tenant: str = "", timeout_s: float | None = None, priority: int = 0) -> None:
        """503 with ``Retry-After`` when the request could not start before its deadline
        (``timeout_s``, or the server's ``request_timeout_s``) at the measured prefill rate, behind
        the share of the queue ahead at its ``priority`` or earlier (``admission.ahead_at``, from
        this node's requests not started yet; docs/tenants.md, "Early refusal"), counted and
        logged as a refusal of ``tenant`` (``overloaded``); never with ``config.early_refusal`` off."""
        if not self.config.early_refusal:
            return
        deadline_s = self.config.request_timeout_s if timeout_s is None else timeout_s
        ordered = admission.queued_ahead(self.workers.live(), model, self.held)
        ahead = self.unread + admission.ahead_at(ordered, self.waiting.mix, priority)  # the unread in arrival order
        refused = admission.judge(admission.predicted_wait_s(ahead, self.prefill_rates.rate(model)), deadline_s)
        if refused is None:
            return
        metrics.REFUSALS.add(tenant, "overloaded", "with 503: the queue ahead was predicted to outlast their timeout")
        raise ServiceUnavailable(
            f"the queue ahead is predicted to take {refused.wait_s:.0f}s, past the "
            f"{deadline_s:g}s timeout; retry in {refused.retry_after_s}s",
            retry_after_s=refused.retry_after_s,
            code="overloaded",
        )

    def release(self) -> None:
        self.inflight -= 1
        metrics.INFLIGHT.set(self.inflight)

    def cancel_later(self, request_id: str, reason: str) -> None:
        metrics.CANCELLATIONS.labels(reason).inc()
        self.spawn(self._cancel(request_id, reason))

    async def _cancel(self, request_id: str, reason: str) -> None:
        with contextlib.suppress(*TRANSIENT_ERRORS):
            await publish_cancel(self.redis, self.config.bus, request_id, reason)


def refused(tenant: str, reason: str, why: str, error: ApiError) -> ApiError:
    """``error``, once counted and logged (once per reason per interval, saying ``why``: no
    client text in it) as a refusal of ``tenant`` for ``reason`` (a ``TENANT_REQUESTS`` outcome)."""
    metrics.REFUSALS.add(tenant, reason, why)
    return error


class BodySlots:
    """Bounds the request bodies being read at once, in two classes, so that memory held by
    uploads in progress is bounded however many stall, and stalled large uploads cannot take
    the slots that ordinary (small) requests need. Over the bound: 429 at once, never a wait
    (a waiting request would hold its connection and buffers all the same)."""

    def __init__(self, config: ApiConfig) -> None:
        self.config = config
        self.reading = {"small": 0, "large": 0}
        self.limits = {"small": config.max_small_body_reads, "large": config.max_large_body_reads}

    @contextlib.contextmanager
    def slot(self, declared: int | None) -> Iterator[None]:
        """Hold a read slot for a body that declares ``declared`` bytes (None: chunked)."""
        kind = "small" if declared is not None and declared <= self.config.small_body_bytes else "large"
        if self.reading[kind] >= self.limits[kind]:
            metrics.BODY_REJECTED.labels(kind).inc()
            busy = f"{self.limits[kind]} {kind} request bodies are being received already; retry later"
            raise TooManyRequests(busy, close=True)
        self.reading[kind] += 1
        try:
            yield
        finally:
            self.reading[kind] -= 1
