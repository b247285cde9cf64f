"""A seeded fault run against a running `splitbus up`: streams flow continuously while, at
moments drawn from ``random.Random(seed)``, one prefill worker, decode worker or scheduler
replica is killed (SIGKILL) or stopped for a few seconds (SIGSTOP, then SIGCONT).

Everything random comes from the seed: the faults (kind, part, which of the two, delay, stop
length) and each request (prompt, ``max_tokens``, sampling seed), so the expected text of each
request is known (:func:`splitbus.worker.engines.sim.sim_text`) and a failing run is replayed with
``SPLITBUS_FAULT_SEED``. Only the timing of the machine is not: a replay lands the same faults
on the same parts, at about the same moments.

One fault at a time, and the next waits until every role has its two live members again (a
killed part is restarted by `up`), so a run never leaves a role without a live worker: a request
that fails is then a defect, not bad luck.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import openai
import redis

from splitbus.bus.core.keys import Keys
from splitbus.worker.engines.sim import sim_text

ROLES = {"prefill": r"--role prefill", "decode": r"--role decode", "scheduler": r"splitbus\.cli\.main scheduler "}


@dataclass(frozen=True)
class RunConfig:
    seed: int
    faults: int = 10
    """Faults to inject (fewer if ``window_s`` ends first)."""
    window_s: float = 55.0
    """No fault starts after this many seconds from the first request."""
    gap_s: tuple[float, float] = (0.5, 1.5)
    """Wait between a recovered system and the next fault (uniform): each stream completes a
    request or two on the whole system before the next fault lands. (It was 1-3 s: the same
    faults on the same parts, ~11 s more of CI time for seed 17.)"""
    stop_s: tuple[float, float] = (1.0, 4.5)
    """How long a stopped part stays stopped (uniform): around the 3 s lease, both sides."""
    streams: int = 6
    """Concurrent streams."""
    request_bound_s: float = 25.0
    """A request with no complete answer by then counts as failed (a lease, a stop, a restart
    and a reaper pass fit many times over)."""
    drain_s: float = 30.0
    """After the window, how long the requests still running may take."""
    recover_s: float = 20.0
    """How long a fault's role may take to have two live members again."""


@dataclass(frozen=True)
class Fault:
    delay_s: float
    action: str  # "kill" or "stop"
    role: str
    index: int
    stop_s: float

    def __str__(self) -> str:
        held = f" for {self.stop_s:.1f}s" if self.action == "stop" else ""
        return f"{self.action} {self.role}[{self.index}]{held}"


@dataclass(frozen=True)
class Request:
    index: int
    prompt: list[int]
    max_tokens: int
    seed: int

    @property
    def expected(self) -> str:
        return sim_text(self.seed, self.max_tokens)


@dataclass
class Outcome:
    request: Request
    started_s: float
    ended_s: float = 0.0
    text: str = ""
    error: str = ""
    request_id: str = ""
    """From the first chunk (none if no chunk came): to find the request in `up`'s log."""

    @property
    def exact(self) -> bool:
        return not self.error and self.text == self.request.expected


@dataclass
class Log:
    """What happened, in run time (seconds since the first request)."""

    t0: float = field(default_factory=time.monotonic)
    faults: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    injected: int = 0
    outcomes: list[Outcome] = field(default_factory=list)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def note(self, line: str) -> None:
        self.faults.append(f"{self.now():6.2f}s {line}")
        print(f"fault run: {self.faults[-1]}", flush=True)


def plan(config: RunConfig) -> list[Fault]:
    rng = random.Random(config.seed)
    return [
        Fault(
            rng.uniform(*config.gap_s),
            rng.choice(("kill", "stop")),
            rng.choice(tuple(ROLES)),
            rng.randrange(2),
            rng.uniform(*config.stop_s),
        )
        for _ in range(config.faults)
    ]


def request(seed: int, index: int) -> Request:
    rng = random.Random(f"{seed}/{index}")
    prompt = [rng.randrange(97, 123) for _ in range(rng.randint(3, 8))]
    return Request(index, prompt, rng.randint(8, 48), rng.randrange(2**31))


class FaultRun:
    """``pids_of(pattern)``: the live pids of `up`'s children whose command line matches."""

    def __init__(
        self, config: RunConfig, base_url: str, admin: redis.Redis, pids_of: Callable[[str], list[int]]
    ) -> None:
        self.config, self.base_url, self.admin, self.pids_of = config, base_url, admin, pids_of
        self.log = Log()
        self.stopped: set[int] = set()
        self.admitting = True

    async def run(self) -> Log:
        bound = self.config.request_bound_s
        client = openai.AsyncOpenAI(base_url=self.base_url, api_key="x", max_retries=0, timeout=bound)
        counter = iter(range(10**9))
        self.log = Log()
        try:
            streams = [asyncio.create_task(self._stream(client, counter)) for _ in range(self.config.streams)]
            await self._inject()
            self.admitting = False
            done, late = await asyncio.wait(streams, timeout=self.config.drain_s)
            for task in late:
                task.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
        finally:
            self._wake_all()
            await client.close()
        return self.log

    async def _stream(self, client: openai.AsyncOpenAI, counter: Iterator[int]) -> None:
        while self.admitting:
            outcome = Outcome(request(self.config.seed, next(counter)), self.log.now())
            self.log.outcomes.append(outcome)
            try:
                outcome.text = await asyncio.wait_for(self._one(client, outcome), self.config.request_bound_s)
            except asyncio.TimeoutError:
                outcome.error = f"no complete answer within {self.config.request_bound_s:.0f}s"
            except asyncio.CancelledError:
                outcome.error = f"still running {self.config.drain_s:.0f}s after the last fault (cancelled)"
                raise
            except openai.APIError as exc:
                outcome.error = f"{type(exc).__name__}: {exc}"
            finally:
                outcome.ended_s = self.log.now()

    @staticmethod
    async def _one(client: openai.AsyncOpenAI, outcome: Outcome) -> str:
        r = outcome.request
        stream = await client.completions.create(
            model="tiny", prompt=r.prompt, max_tokens=r.max_tokens, seed=r.seed, stream=True
        )
        parts = []
        async for chunk in stream:
            outcome.request_id = chunk.id
            parts.extend(c.text for c in chunk.choices)
        return "".join(parts)

    async def _inject(self) -> None:
        for fault in plan(self.config):
            await asyncio.sleep(fault.delay_s)
            if self.log.now() > self.config.window_s:
                self.log.note(f"window over: {self.log.injected} fault(s) injected")
                return
            await self._apply(fault)
            await self._recover(fault.role)

    async def _apply(self, fault: Fault) -> None:
        pids = sorted(self.pids_of(ROLES[fault.role]))
        if not pids:
            self.log.problems.append(f"{self.log.now():.2f}s: no {fault.role} process to {fault.action}")
            return
        pid = pids[fault.index % len(pids)]
        self.log.note(f"{fault} (pid {pid})")
        self.log.injected += 1
        if fault.action == "kill":
            _signal(pid, signal.SIGKILL)
            return
        _signal(pid, signal.SIGSTOP)
        self.stopped.add(pid)
        await asyncio.sleep(fault.stop_s)
        _signal(pid, signal.SIGCONT)
        self.stopped.discard(pid)
        self.log.note(f"woke {fault.role} pid {pid}")

    async def _recover(self, role: str) -> None:
        """Until the role has two processes and, for workers, two live registered members."""
        deadline = time.monotonic() + self.config.recover_s
        while not self._healthy(role):
            if time.monotonic() > deadline:
                self.log.problems.append(
                    f"{self.log.now():.2f}s: {role} not back to 2 live members "
                    f"within {self.config.recover_s:.0f}s of the fault ({self._census(role)})"
                )
                return
            await asyncio.sleep(0.1)

    def _healthy(self, role: str) -> bool:
        processes = len(self.pids_of(ROLES[role]))
        return processes == 2 and (role == "scheduler" or self._live_workers(role) == 2)

    def _census(self, role: str) -> str:
        live = "" if role == "scheduler" else f", {self._live_workers(role)} live in the registry"
        return f"{len(self.pids_of(ROLES[role]))} process(es){live}"

    def _live_workers(self, role: str) -> int:
        """Members holding a lease whose process runs (a worker id ends in its pid: a killed
        worker's lease outlives it by up to 3 s and must not count)."""
        pids = {str(p) for p in self.pids_of(ROLES[role])}
        ids = [w.decode() for w in self.admin.zrange(Keys().workers, 0, -1)]
        return sum(
            1
            for w in ids
            if w.rsplit("-", 1)[-1] in pids
            and self.admin.exists(Keys().lease(w))
            and self.admin.hget(Keys().worker(w), "role") == role.encode()
        )

    def _wake_all(self) -> None:
        for pid in list(self.stopped):
            _signal(pid, signal.SIGCONT)
        self.stopped.clear()


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def summary(config: RunConfig, log: Log) -> str:
    bad = [o for o in log.outcomes if not o.exact]
    slowest = max((o.ended_s - o.started_s for o in log.outcomes), default=0.0)
    lines = [
        f"fault run seed {config.seed} (replay: SPLITBUS_FAULT_SEED={config.seed}): "
        f"{len(log.outcomes)} requests, {len(bad)} not exact, "
        f"{log.injected} faults, slowest request {slowest:.1f}s",
        *(f"  {f}" for f in log.faults),
        *(f"  problem: {p}" for p in log.problems),
    ]
    slow = sorted((o for o in log.outcomes if o.exact and o.ended_s - o.started_s > 5), key=lambda o: o.started_s)
    lines += [f"  slow but exact: request {o.request.index} ({o.started_s:.2f}s-{o.ended_s:.2f}s)" for o in slow[:10]]
    for o in bad[:20]:
        got = o.error or f"text {o.text!r} != expected {o.request.expected!r}"
        lines.append(
            f"  request {o.request.index} {o.request_id or '(no chunk)'} ({o.started_s:.2f}s-{o.ended_s:.2f}s): {got}"
        )
    return "\n".join(lines)


def traces(log: Log, output: list[str], per_request: int = 4) -> str:
    """For each request that went wrong, the lines of `up`'s output that name it."""
    lines = []
    for o in [o for o in log.outcomes if not o.exact and o.request_id][:10]:
        named = [line.rstrip() for line in output if o.request_id in line][:per_request]
        lines += [f"  {o.request_id}: {line}" for line in named] or [f"  {o.request_id}: named in no line"]
    return "\n".join(lines)


def stuck_tasks(admin: redis.Redis, idle_ms: int = 10_000) -> str:
    """Task entries pending (read, not acked) for longer than ``idle_ms`` at the end of the run,
    with their consumer: where a request that never finished was left."""
    lines = []
    for worker in sorted(w.decode() for w in admin.zrange(Keys().workers, 0, -1)):
        stream = Keys().tasks(worker)
        if not admin.exists(stream):
            continue
        for row in admin.xpending_range(stream, "workers", min="-", max="+", count=100, idle=idle_ms):
            entry = admin.xrange(stream, row["message_id"], row["message_id"])
            data = entry[0][1].get(b"data", b"")[:160].decode(errors="replace") if entry else "(trimmed)"
            lines.append(
                f"  stuck: {stream} {row['message_id'].decode()} with {row['consumer'].decode()}, "
                f"idle {row['time_since_delivered'] / 1000:.1f}s, {row['times_delivered']} deliveries: {data}"
            )
    return "\n".join(lines)


def notable(output: list[str], limit: int = 30) -> str:
    """The lines of `up`'s output that say something went wrong (to point at the part)."""
    keys = (" WARNING ", " ERROR ", "exited with code", "was killed by", "Error:")
    found = [line.rstrip() for line in output if any(k in line for k in keys)]
    return "\n".join(f"  up: {line}" for line in found[:limit])
