"""A Redis restart while a limited tenant's clients send steady traffic through `splitbus up
--engine sim` (issue 38: "a Redis failover during limiting: limits may be briefly loose, never
lost requests").

The Redis is the test's own (``EmbeddedRedis``, AOF on, as the embedded Redis of `up`): it is
stopped mid-traffic (SIGTERM), left away while the clients go on, and started again on its port
from its AOF, as test_redis_restart.py does. A cluster primary's failover (test_cluster_failover.py)
is the same outage to the limiter: the tenant's two keys share the cell's tag, so they are away,
and back, together.

Checked by counts, never by time:

- every request ends: 200 with its exact text, 429 at the tenant's limit, or 503 while Redis is
  away; none hangs past its timeout, none is cut off;
- none is lost: once every request has ended, the tenant holds no place (its ``concurrency``
  leases, which would otherwise last the request timeout plus 30 s): each admitted request's end
  reached Redis, those that ended while it was away too;
- while Redis is away, no request is refused for the limit (docs/tenants.md, "Limits": the limiter
  that cannot answer admits unchecked; what the API answers then is its own 503 "Redis is
  unreachable");
- once Redis is back, the limit holds again: a burst past ``rps`` and ``concurrency`` gets 429s
  naming the limit, the tenant's keys are written again, and never more than ``concurrency`` of
  its requests hold a place at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest
import redis

from splitbus.bus.core.keys import Keys
from splitbus.bus.tenants import key_digest
from splitbus.redis_server import EmbeddedRedis
from splitbus.worker.engines.sim import sim_text
from tests.e2e.conftest import System, start_system, stop_system
from tests.faults.conftest import wait_until

TENANT = "steady"
RPS = 5
CONCURRENCY = 3
CLIENTS = 4
"""More clients than places, each sending its next request 20 ms after its last ended (``PAUSE_S``
after a refusal): the limits refuse some of them before, and after, the restart."""
TOKENS = 8
"""At 20 ms per decode step a request takes ~0.2 s."""
PER_CLIENT = 150
"""Each client's bound on requests (the run stops them far sooner)."""
BURST = 20
"""Requests sent at once after the restart: four times ``rps``, seven times ``concurrency``."""
BURST_TOKENS = 30
"""A burst request runs ~0.6 s: the burst's admitted requests overlap."""
DEADLINE_S = 15
"""``--request-timeout``: a request's place is a lease of DEADLINE_S + 30 s."""
AWAY = 5
"""Requests answered while Redis is away before it is started again."""
LEAVERS = 2
"""Streams admitted before Redis stops, whose clients leave while it is away: the API ends them
then (their places given back), when Redis cannot take the end."""
LEAVER_TOKENS = 500
"""~10 s of tokens: a leaver is mid-stream when Redis stops."""
ALLOWED = {200, 429, 503}
PAUSE_S: dict[int | str, float] = {429: 0.1, 503: 0.2}
"""How long a client waits before its next request after a refusal (else 20 ms)."""


@dataclass
class Outcome:
    """One request as its client saw it."""

    seed: int
    tokens: int
    sent_at: float
    done_at: float = 0.0
    status: int | str = "unsent"
    """The HTTP status, or what went wrong before one came (``timeout``, ``connection``)."""
    text: str = ""
    message: str = ""
    headers: dict[str, str] = field(default_factory=dict)

    def wrong(self) -> str | None:
        """What is wrong with how it ended (None: completed exactly, or a clear refusal)."""
        if self.status not in ALLOWED:
            return f"request {self.seed}: {self.status} {self.message}"
        if self.status == 200 and self.text != sim_text(self.seed, self.tokens):
            return f"request {self.seed}: 200 with the wrong text {self.text!r}"
        if self.status == 429 and "Rate limit reached for tenant" not in self.message:
            return f"request {self.seed}: a 429 not of the tenant's limit: {self.message}"
        return None


async def _send(client: openai.AsyncOpenAI, seed: int, tokens: int) -> Outcome:
    outcome = Outcome(seed, tokens, time.monotonic())
    try:
        raw = await client.completions.with_raw_response.create(model="tiny", prompt="go", max_tokens=tokens, seed=seed)
        outcome.status, outcome.text, outcome.headers = 200, raw.parse().choices[0].text, dict(raw.headers)
    except openai.APIStatusError as exc:
        outcome.status, outcome.message, outcome.headers = exc.status_code, exc.message, dict(exc.response.headers)
    except openai.APITimeoutError:
        outcome.status = "timeout"
    except openai.APIConnectionError as exc:
        outcome.status, outcome.message = "connection", str(exc)
    outcome.done_at = time.monotonic()
    return outcome


def _client(system: System, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=system.v1, api_key=key, max_retries=0, timeout=DEADLINE_S + 10)


class Traffic:
    """``CLIENTS`` clients of the tenant, each sending one request after another (on a thread of
    their own, so that the test's thread may stop and start Redis, which must outlive it)."""

    def __init__(self, system: System, key: str) -> None:
        self.outcomes: list[Outcome] = []
        self.streaming: set[int] = set()
        """The leavers whose stream has begun (admitted, tokens coming)."""
        self.leave = threading.Event()
        self.left: list[Outcome] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=asyncio.run, args=(self._run(system, key),), daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> bool:
        """Stop the clients once their requests have ended; whether they all have."""
        self._stop.set()
        self.leave.set()
        self._thread.join(DEADLINE_S + 20)
        return not self._thread.is_alive()

    def count(self, status: int, since: float = 0.0, until: float = float("inf")) -> int:
        """Requests answered ``status`` between ``since`` and ``until``."""
        return sum(o.status == status for o in self.between(since, until))

    def between(self, since: float, until: float = float("inf")) -> list[Outcome]:
        return [o for o in list(self.outcomes) if since <= o.done_at < until]

    async def _run(self, system: System, key: str) -> None:
        client = _client(system, key)
        try:
            leavers = [self._leaver(client, 3000 + i) for i in range(LEAVERS)]
            await asyncio.gather(*(self._one_client(client, c) for c in range(CLIENTS)), *leavers)
        finally:
            await client.close()

    async def _leaver(self, client: openai.AsyncOpenAI, seed: int) -> None:
        """A stream that is admitted (sent again while refused), then left once ``leave`` is set:
        its client goes away while Redis is."""
        for _ in range(PER_CLIENT):
            try:
                stream = await client.completions.create(
                    model="tiny", prompt="go", max_tokens=LEAVER_TOKENS, seed=seed, stream=True
                )
                break
            except openai.RateLimitError:
                await asyncio.sleep(0.05)
        else:
            return
        outcome = Outcome(seed, LEAVER_TOKENS, time.monotonic(), status="left")

        async def read() -> None:
            async for chunk in stream:
                outcome.text += chunk.choices[0].text
                self.streaming.add(seed)

        reading = asyncio.ensure_future(read())
        while not self.leave.is_set() and not reading.done():
            await asyncio.sleep(0.02)
        reading.cancel()
        with contextlib.suppress(asyncio.CancelledError, openai.APIError):
            await reading
        await stream.close()  # the client goes: its connection closes mid-stream
        outcome.done_at = time.monotonic()
        self.left.append(outcome)

    async def _one_client(self, client: openai.AsyncOpenAI, c: int) -> None:
        for i in range(PER_CLIENT):
            if self._stop.is_set():
                return
            outcome = await _send(client, 1000 + c * PER_CLIENT + i, TOKENS)
            self.outcomes.append(outcome)
            await asyncio.sleep(PAUSE_S.get(outcome.status, 0.02))


def _tenants_file(tmp_path: Path, key: str) -> Path:
    path = tmp_path / "tenants.json"
    limits = {"rps": RPS, "concurrency": CONCURRENCY, "keys_sha256": [key_digest(key)]}
    path.write_text(json.dumps({"tenants": {TENANT: limits}}))
    return path


def _places(client: redis.Redis) -> list[str]:
    """The tenant's leases not run out, at Redis's time (as ``splitbus status`` counts them)."""
    seconds, micros = client.time()
    now_ms = seconds * 1000 + micros // 1000
    return list(client.zrange(Keys().inflight(TENANT), f"({now_ms}", "+inf", byscore=True))


@dataclass
class Burst:
    """What Redis held of the tenant while a burst ran, sampled from another thread."""

    most_places: int = 0
    buckets_seen: bool = False
    outcomes: list[Outcome] = field(default_factory=list)

    def sample(self, client: redis.Redis, running: threading.Event) -> None:
        while running.is_set():
            self.most_places = max(self.most_places, int(client.zcard(Keys().inflight(TENANT))))
            self.buckets_seen = self.buckets_seen or bool(client.exists(Keys().limits(TENANT)))
            time.sleep(0.01)


def _burst(system: System, key: str, client: redis.Redis) -> Burst:
    """``BURST`` requests at once, Redis's view of the tenant sampled meanwhile."""
    seen, running = Burst(), threading.Event()
    running.set()
    sampler = threading.Thread(target=seen.sample, args=(client, running), daemon=True)
    sampler.start()

    async def send_all() -> list[Outcome]:
        api = _client(system, key)
        try:
            return list(await asyncio.gather(*(_send(api, 5000 + i, BURST_TOKENS) for i in range(BURST))))
        finally:
            await api.close()

    try:
        seen.outcomes = asyncio.run(send_all())
    finally:
        running.clear()
        sampler.join(5)
    return seen


def _restart(server: EmbeddedRedis, traffic: Traffic) -> tuple[float, float]:
    """Stop Redis mid-traffic, and start it again from its AOF once ``AWAY`` requests were
    answered meanwhile. When it stopped, and when it was started again."""
    server.stop()
    stopped = time.monotonic()
    traffic.leave.set()
    wait_until(lambda: len(traffic.between(stopped)) >= AWAY and len(traffic.left) == LEAVERS, 10)
    restarted = time.monotonic()
    server.start()  # same port, same AOF; from this (long-lived) thread
    return stopped, restarted


def _wrong(outcomes: Iterable[Outcome]) -> list[str]:
    return [w for w in (o.wrong() for o in outcomes) if w is not None]


def _summary(outcomes: Iterable[Outcome], message: bool = False) -> dict[str, int]:
    """How many requests ended each way (by status; with ``message``: by status and message)."""
    counts: dict[str, int] = {}
    for outcome in outcomes:
        name = f"{outcome.status} {outcome.message[:90]}" if message else str(outcome.status)
        counts[name] = counts.get(name, 0) + 1
    return counts


Log = Callable[[str], str]
"""What a failed check says: its own words, then the end of what ``up`` printed."""


def _up(tmp_path: Path, server: EmbeddedRedis, key: str) -> System:
    return start_system(
        tmp_path / "up",
        "--redis-url",
        server.url,
        "--request-timeout",
        str(DEADLINE_S),
        "--tenants-file",
        str(_tenants_file(tmp_path, key)),
        "--worker-arg=--sim-decode-step-ms",
        "--worker-arg=20",
    )


def _until_limited(traffic: Traffic, log: Log) -> None:
    """Start the traffic, and wait until the limits both admit and refuse, the leavers streaming."""
    traffic.start()
    limited = wait_until(
        lambda: traffic.count(200) >= 5 and traffic.count(429) >= 1 and len(traffic.streaming) == LEAVERS, 60
    )
    begun = f"{len(traffic.streaming)} of {LEAVERS} leavers' streams begun"
    assert limited, log(f"no 200s and 429s before the restart: {_summary(traffic.outcomes)}, {begun}")


def _through_restart(server: EmbeddedRedis, traffic: Traffic, admin: redis.Redis, log: Log) -> None:
    """Steady traffic, limited, through a restart: every request ended clearly, none refused for
    the limit while Redis was away, every place given back."""
    _until_limited(traffic, log)
    stopped, restarted = _restart(server, traffic)
    served = wait_until(lambda: traffic.count(200, since=restarted) >= 5, 30)
    assert traffic.stop(), log("a client still waits past its timeout")
    away = traffic.between(stopped, restarted)
    print(f"\nsteady traffic: {_summary(traffic.outcomes)}; while Redis was away: {_summary(away)}")
    assert served, log(f"not served after the restart: {_summary(traffic.between(restarted), message=True)}")
    assert _wrong(traffic.outcomes) == [], log("\n".join(_wrong(traffic.outcomes)[:10]))
    _check_away(away, log)
    mid_stream = [o.done_at > stopped and o.text != sim_text(o.seed, o.tokens) for o in traffic.left]
    assert mid_stream == [True] * LEAVERS, f"the leavers did not leave mid-stream while Redis was away: {mid_stream}"
    assert wait_until(lambda: not _places(admin), 10), log(f"places never given back: {_places(admin)}")


def _check_away(away: list[Outcome], log: Log) -> None:
    """While Redis was away: no request refused for the limit (admitted unchecked), the API's own
    503 "Redis is unreachable" (it could not publish them) instead."""
    assert len(away) >= AWAY, log(f"few requests ended while Redis was away: {_summary(away)}")
    assert {o.status for o in away} <= {200, 503}, log(f"while Redis was away: {_summary(away, message=True)}")
    assert all("Redis is unreachable" in o.message for o in away if o.status == 503), _summary(away, message=True)


def _check_burst(burst: Burst, log: Log) -> None:
    """The limits hold again: some of the burst admitted, some refused for them, never more places
    than ``concurrency`` held, the tenant's buckets written again."""
    print(f"burst after the restart: {_summary(burst.outcomes)}, at most {burst.most_places} places held")
    assert _wrong(burst.outcomes) == [], log("\n".join(_wrong(burst.outcomes)))
    assert _summary(burst.outcomes).keys() == {"200", "429"}, _summary(burst.outcomes)
    assert 0 < burst.most_places <= CONCURRENCY and burst.buckets_seen
    assert all("retry-after" in o.headers for o in burst.outcomes if o.status == 429)
    assert all(o.headers.get("x-ratelimit-limit-requests") == str(RPS) for o in burst.outcomes)


@pytest.mark.timeout(120)
def test_a_redis_restart_during_limiting_loses_no_request_and_the_limit_holds_again(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis")
    server.start()
    key = "sk-failover-" + secrets.token_hex(16)
    system = _up(tmp_path, server, key)
    admin = redis.Redis.from_url(system.redis_url, decode_responses=True)
    traffic = Traffic(system, key)
    try:
        log: Log = lambda what: what + "\n" + "".join(system.output[-200:])  # noqa: E731
        _through_restart(server, traffic, admin, log)
        # The buckets full again (their hash expires then): the burst starts from a full bucket,
        # and whatever the tenant's hash holds after it, the burst wrote.
        assert wait_until(lambda: not admin.exists(Keys().limits(TENANT)), 10)
        _check_burst(_burst(system, key, admin), log)
        assert wait_until(lambda: not _places(admin), 10), _places(admin)
    finally:
        traffic.stop()
        admin.close()
        stop_system(system)
        server.stop()
