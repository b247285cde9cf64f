"""A tenant's limits at admission (docs/tenants.md, "Limits"): every API node asks the bus's
limiter (``splitbus.bus.limits``), so that the nodes enforce one tenant's limits together.

A response is one request to its tenant's limits whatever its ``n`` (as OpenAI counts it): one
request of ``rps``, one place of ``concurrency``, its prompt's tokens once; its choices' output
tokens are charged together when the last of them ends. The default tenant (the keys the API was
started with, or none) and a tenant without limits never reach Redis here.

While Redis cannot answer, requests are admitted unchecked (limits are briefly loose; a request
is never refused or lost for it), and the API says so in its log once a minute; a request that
ends meanwhile gives its place back once Redis answers again.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Coroutine
from typing import Any

from starlette.requests import Request
from starlette.types import Message, Send

from splitbus.api import metrics
from splitbus.api.errors import TooManyRequests
from splitbus.api.tenants import UNREADABLE
from splitbus.bus.core.connection import backoff_delays, is_transient
from splitbus.bus.limits import Admission, BadLimiterReply, Limiter, Verdict, limited
from splitbus.bus.tenants import TenantLimits

log = logging.getLogger(__name__)

LEASE_GRACE_S = 30.0
"""How long past the request timeout a request's place (``concurrency``) is held if its API node
never ends it (a crash): then the place is free again."""
END_RETRY_S = (0.05, 2.0)
"""An end Redis cannot take is tried again after a jittered wait from the first, doubling, to the
second (at most): a request that ends during a failover gives its place back once Redis is back,
not when its lease runs out (the request timeout plus ``LEASE_GRACE_S``)."""
WARN_EVERY_S = 60.0
"""How often a limiter that cannot answer is logged (not once per request)."""
TOKEN_BUCKETS = (("tok", "tpm"), ("prompt", "prompt_tpm"), ("output", "output_tpm"))
"""Which bucket OpenAI's ``x-ratelimit-*-tokens`` headers describe: the first the tenant has."""
REFUSED = {
    Verdict.REQUESTS: "requests per second",
    Verdict.CONCURRENCY: "concurrent requests",
    Verdict.TOKENS: "tokens per minute",
}
"""What a refusal names as the limit reached."""
Spawn = Callable[[Coroutine[Any, Any, Any]], None]
UNANSWERED: tuple[type[BaseException], ...] = (*UNREADABLE, BadLimiterReply)
"""What a limiter that cannot answer raises: then the request is admitted unchecked."""


def duration(ms: int) -> str:
    """A wait as OpenAI's ``x-ratelimit-reset-*`` headers write it: ``20ms``, ``1.5s``, ``6m0s``."""
    if ms < 1000:
        return f"{max(ms, 0)}ms"
    minutes, seconds = divmod(round(ms / 1000, 3), 60)
    return f"{int(minutes)}m{seconds:g}s" if minutes else f"{seconds:g}s"


def headers(limits: TenantLimits, admission: Admission) -> list[tuple[bytes, bytes]]:
    """OpenAI's ``x-ratelimit-*`` headers: the requests bucket (``rps``) and a tokens bucket, those
    the tenant has."""
    found: list[tuple[str, float, str]] = []
    if limits.rps is not None and "req" in admission.rooms:
        found.append(("requests", max(limits.rps, 1), "req"))
    bucket = next(((b, f) for b, f in TOKEN_BUCKETS if getattr(limits, f) is not None and b in admission.rooms), None)
    if bucket is not None:
        found.append(("tokens", getattr(limits, bucket[1]), bucket[0]))
    return [header for kind, size, name in found for header in _bucket_headers(kind, size, admission, name)]


def _bucket_headers(kind: str, size: float, admission: Admission, bucket: str) -> list[tuple[bytes, bytes]]:
    room = admission.rooms[bucket]
    values = {"limit": f"{size:g}", "remaining": str(room.left), "reset": duration(room.full_in_ms)}
    return [(f"x-ratelimit-{name}-{kind}".encode(), value.encode()) for name, value in values.items()]


def with_headers(state: dict[str, Any], send: Send) -> Send:
    """``send``, adding the ``x-ratelimit-*`` headers the request's admission left in ``state``
    (``ratelimit_headers``) to its response's start: a refusal's, an error's, a body's or a stream's."""

    async def sending(message: Message) -> None:
        extra = state.get("ratelimit_headers")
        if message["type"] == "http.response.start" and extra:
            message = {**message, "headers": [*message.get("headers", []), *extra]}
        await send(message)

    return sending


class Lease:
    """An admitted response's hold on its tenant's limits, ended once each of its ``choices`` has
    ended (``done``), however it ended."""

    def __init__(self, limits: TenantLimiter, tenant: str, request_id: str, tenant_limits: TenantLimits, choices: int):
        self._limits = limits
        self._args = (tenant, request_id, tenant_limits)
        self._pending = choices
        self._output_tokens = 0
        self._runs_out = limits.lease_runs_out()
        """When its place would be given back by itself (its lease's end, on this node's clock)."""

    def done(self, output_tokens: int) -> None:
        """One choice ended, having generated ``output_tokens``."""
        self._output_tokens += output_tokens
        self._pending -= 1
        if self._pending == 0:
            self._limits.end(*self._args, self._output_tokens, self._runs_out)


class TenantLimiter:
    """Admits an API node's requests against their tenants' limits, and ends them."""

    def __init__(self, limiter: Limiter, lease_s: float, spawn: Spawn, clock: Callable[[], float] = time.monotonic):
        self._limiter = limiter
        self._lease_ms = int(lease_s * 1000)
        self._spawn = spawn
        self._clock = clock
        self._warned_at: float | None = None

    async def admit(self, request: Request, prompt_tokens: int, request_id: str, choices: int) -> Lease | None:
        """Take the request's tenant's limits for one request of ``prompt_tokens``, or refuse it
        (429, ``Retry-After``). None: nothing to end (no limits, or the limiter could not answer)."""
        name, limits = request_tenant(request)
        if limits is None:
            return None
        admission = await self._ask(name, request_id, limits, prompt_tokens)
        if admission is None:
            return None
        request.state.ratelimit_headers = headers(limits, admission)
        if admission.verdict is not Verdict.ADMITTED:
            metrics.REFUSALS.add(
                name, admission.verdict.name.lower(), f"at their tenant's {REFUSED[admission.verdict]}"
            )
            raise refusal(name, admission)
        return Lease(self, name, request_id, limits, choices) if limits.concurrency or _charged_after(limits) else None

    async def _ask(self, name: str, request_id: str, limits: TenantLimits, prompt_tokens: int) -> Admission | None:
        try:
            return await self._limiter.admit(name, request_id, limits, prompt_tokens, self._lease_ms)
        except UNANSWERED as exc:
            self._warn(exc)
            return None
        except asyncio.CancelledError:  # its client left mid-call: a place it may hold is given back
            self.end(name, request_id, limits, 0)
            raise

    def _warn(self, exc: BaseException) -> None:
        now = self._clock()
        if self._warned_at is None or now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            log.warning("tenants' limits are not checked (admitting unchecked) while the limiter fails: %s", exc)

    def lease_runs_out(self) -> float:
        """When a lease taken now runs out by itself (this node's monotonic clock)."""
        return self._clock() + self._lease_ms / 1000

    def end(
        self, tenant: str, request_id: str, limits: TenantLimits, output_tokens: int, until: float | None = None
    ) -> None:
        """End an admitted response in the background (one Redis cannot take is tried again until
        ``until``, when its lease runs out by itself; default: a lease taken now). Only a response
        admitted with a lease has an end to retry, so the retries are bounded by the responses in
        flight when Redis went away: while it is away the API admits none (503), or none with a
        lease (admitted unchecked). An end whose reply was lost (a timeout) and that is tried again
        may charge its output tokens twice; its place is given back once."""
        self._spawn(self._end(tenant, request_id, limits, output_tokens, until or self.lease_runs_out()))

    async def _end(self, tenant: str, request_id: str, limits: TenantLimits, output_tokens: int, until: float) -> None:
        """Tried again while Redis cannot take it (a failover, a restart), until its lease would
        have run out by itself: then there is nothing left to give back."""
        delays = backoff_delays(*END_RETRY_S)
        while not await self._ended(tenant, request_id, limits, output_tokens) and self._clock() < until:
            await anext(delays)

    async def _ended(self, tenant: str, request_id: str, limits: TenantLimits, output_tokens: int) -> bool:
        """Whether the end is done with: written, or refused for good (an error retrying cannot fix)."""
        try:
            await self._limiter.end(tenant, request_id, limits, output_tokens)
        except UNREADABLE as exc:
            return not is_transient(exc)
        except ValueError:  # a reply that is not the script's: nothing to retry
            return True
        return True


def _charged_after(limits: TenantLimits) -> bool:
    """Whether output tokens are charged when the response ends."""
    return limits.tpm is not None or limits.output_tpm is not None


def request_tenant(request: Request) -> tuple[str, TenantLimits | None]:
    """The request's tenant's name and limits (``RequireApiKey`` put them on its state); None for
    limits where it has none to check."""
    limits = getattr(request.state, "tenant_limits", None)
    name = getattr(request.state, "tenant_name", "")
    if not isinstance(limits, TenantLimits) or not limited(limits) or not isinstance(name, str):
        return name, None
    return name, limits


def refusal(tenant: str, admission: Admission) -> TooManyRequests:
    """The 429 for a refused admission."""
    retry_s = max(math.ceil(admission.retry_after_ms / 1000), 1)
    return TooManyRequests(
        f"Rate limit reached for tenant {tenant} on {REFUSED[admission.verdict]}; please try again in {retry_s}s",
        retry_after_s=retry_s,
        code="rate_limit_exceeded",
    )
