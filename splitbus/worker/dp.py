"""DP groups: the ranks of a group step together, as EP's all-to-all forces. A group's ranks
share a role: mixed, prefill or decode (``DpStepper``).

Before each step every rank posts its plan (has prefill work, has decode work, how long its next
prefill, the first of its queue by priority then arrival, has waited) to ``sb:dp:{group}`` and
reads the others'. From the same plans every rank makes the same decision: the group steps if any
rank has work, and a rank with nothing to do runs an idle forward (counted). With ``dp_align_ms``
above 0 (0, off, by default) prefills are aligned: a task of a staggered batch names the batch and
how many ranks it went to, and a rank waits (up to ``dp_align_ms``) until all of them have their
part, so the batch's prefills share a step. Prefill work that comes after a rank
posted its plan still joins the step (``bind_late``). With the sim engine, which has no EP, the
ranks also wait for each other at the end of each step (``GroupBarrier.finish``), so tokens
come out when the group's step ends, as they would with EP; the engine says how long the step
lasts, EP's all-to-all included, from every rank's plan (``forwards``, ``decided_step_s``).
A group with no work blocks on its stream; a rank that gets work posts a ``wake`` entry there.

The group starts when all its ranks are live in the registry and each has joined the same
epoch: the latest ``started_ms`` among them (Redis server time); only plans of that epoch count.
A joining rank asks the registry again until the group has formed, so ranks that come back after
a break, in any order, end up in one epoch (``GroupBarrier.form``). A rank
missing from a step for ``dp_barrier_timeout_s`` breaks the group and every rank exits, instead of
hanging: a mixed rank fails what it holds with a reason and leaves the registry; a prefill or decode
rank gives up its lease, so the scheduler's reaper moves what it holds to another group of the role
(``DpStepper.hand_over``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from dataclasses import asdict, dataclass, field

import orjson
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from splitbus.bus.core.config import BusConfig
from splitbus.bus.dp import ExpertStore, PlanStream, StoreAddress
from splitbus.bus.messages import Task
from splitbus.bus.registry import WorkerInfo
from splitbus.bus.roles import Role
from splitbus.bus.tasks import task_consumer
from splitbus.worker import engines, metrics
from splitbus.worker.engines.interface import ExpertParallel, SimulatedGroup
from splitbus.worker.steps import CollectiveFailed, StepParts
from splitbus.worker.table import Status

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.5
EXIT_GROUP_BROKEN = 3
"""The exit code of a rank that left its broken group (``splitbus up`` restarts the group)."""
FORM_POLL_S = 0.05
"""How often a forming rank asks the registry for the group's epoch (it wakes sooner on a join),
and a rank of a group with expert parallelism looks for rank 0's store address."""


class GroupBroken(Exception):
    """A rank did not reach a step in time; the message says which and when."""

    def __init__(self, message: str, missing: list[int] | None = None) -> None:
        super().__init__(message)
        self.missing = missing or []


@dataclass(frozen=True)
class StepPlan:
    rank: int
    prefill: bool
    decode: bool
    waited_ms: float
    batch_id: str = ""
    """The scheduler batch of this rank's next prefill (``RequestTable.next_prefill``: the
    first by priority, then arrival; "" when not staggered)."""
    batch_ranks: int = 0
    held_batches: tuple[str, ...] = ()
    """Every staggered batch this rank holds prefill work from: a rank still working through
    an older batch has its part of a newer one too, and must not hold that batch back."""
    prefill_tokens: int = 0
    """The tokens of the prefill batch it would run in the step; with ``decode_seqs``, what an
    engine that simulates EP sizes the step's all-to-all by (``forwards``)."""
    decode_seqs: int = 0
    """The sequences it would decode in the step."""

    @classmethod
    def from_json(cls, raw: bytes) -> StepPlan:
        fields = orjson.loads(raw)
        counts = {k: _count(fields.get(k, 0)) for k in ("prefill_tokens", "decode_seqs")}
        return cls(**{**fields, "held_batches": tuple(fields.get("held_batches", ())), **counts})


def _count(value: object) -> int:
    """A token or sequence count from another rank's plan (untrusted): a non-negative int, else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31 else 0


def decide(mine: StepPlan, plans: list[StepPlan], align_ms: float) -> str:
    """What this rank does in a step: ``prefill``, ``decode``, ``idle`` or ``none`` (the whole
    group has nothing to do). Every rank computes it from the same plans.

    A prefill from a staggered batch waits, up to ``align_ms``, until every rank the batch went
    to has its part, so the batch's prefills share a step (0 turns alignment off).
    """
    if not any(p.prefill or p.decode for p in plans):
        return "none"
    if mine.prefill and (align_ms <= 0 or _batch_arrived(mine, plans) or mine.waited_ms >= align_ms):
        return "prefill"
    return "decode" if mine.decode else "idle"


def bind_late(action: str, posted: StepPlan, current: StepPlan, plans: list[StepPlan], align_ms: float) -> str:
    """Prefill work that reached a rank after it posted its plan (``current`` has it,
    ``posted`` had not) joins this step, not the next. In lock-step the rank that finishes
    first posts first, so during a long prefill step its plan would miss nearly all that
    arrives meanwhile. Safe for the lock-step: the group steps anyway, and the prefill is this
    rank's forward instead of an idle one or a decode."""
    if action not in ("idle", "decode") or posted.prefill or not current.prefill:
        return _kv_came_late(action, posted, current)
    return decide(current, [current if p.rank == current.rank else p for p in plans], align_ms)


def _kv_came_late(action: str, posted: StepPlan, current: StepPlan) -> str:
    """A decode rank whose KV came after it posted its plan decodes in this step instead of its
    idle forward (a mixed rank's decode work never comes between its plan and its step)."""
    return "decode" if action == "idle" and current.decode and not posted.decode else action


def forwards(plans: list[StepPlan], align_ms: float) -> list[tuple[str, int]]:
    """Every rank's forward in a step, as every rank decides it from the same plans: what it
    does (``decide``) and the tokens it puts through (its prefill batch's tokens, its decode
    batch size, 0 in an idle forward). EP's all-to-all waits for the rank with the most."""
    return [_forward(decide(p, plans, align_ms), p) for p in plans]


def _forward(action: str, plan: StepPlan) -> tuple[str, int]:
    return action, plan.prefill_tokens if action == "prefill" else plan.decode_seqs if action == "decode" else 0


def _batch_arrived(mine: StepPlan, plans: list[StepPlan]) -> bool:
    if not mine.batch_id:
        return True
    return sum(1 for p in plans if p.prefill and mine.batch_id in (p.batch_id, *p.held_batches)) >= mine.batch_ranks


class GroupBarrier:
    def __init__(
        self, redis: aioredis.Redis, config: BusConfig, group: str, rank: int, size: int, timeout_s: float
    ) -> None:
        self._redis = redis
        self._stream = PlanStream(redis, config.keys, group)
        self.group, self.rank, self.size, self.timeout_s = group, rank, size, timeout_s
        self.epoch = 0
        self._last_id = "0-0"
        self._seen: dict[int, dict[int, StepPlan]] = {}
        self._done: dict[int, set[int]] = {}
        self._joined: set[int] = set()

    def begin(self, epoch_ms: int) -> None:
        self.epoch = epoch_ms
        self._last_id = f"{epoch_ms}-0"  # entry ids are Redis server time: older ones are another run
        self._seen, self._done, self._joined = {}, {}, set()

    async def form(
        self, group_epoch: Callable[[], Awaitable[int]], timeout_s: float, stopped: Callable[[], bool] = lambda: False
    ) -> int:
        """Join the group; return its epoch once every rank has joined that same epoch.

        ``group_epoch`` is the epoch the registry shows now (0 while not every rank is live). It
        is asked again until the group has formed: a rank restarted while the old group still
        stepped took an epoch that only it joins, and the others, restarted once the old group
        broke, take a later one. Fixed once at start, the two waited in different epochs and
        broke each other at step 0, over and over, until the restart delays happened to line up.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not stopped():
            epoch = await group_epoch()
            if epoch and epoch != self.epoch:
                await self._join(epoch)
            if self.epoch and len(self._joined) == self.size:
                return self.epoch
            await self._read(FORM_POLL_S)
        raise GroupBroken(
            f"DP group {self.group}: not all {self.size} ranks came up and joined one epoch within {timeout_s:g}s"
        )

    async def _join(self, epoch_ms: int) -> None:
        self.begin(epoch_ms)
        await self._stream.join(epoch_ms, self.rank)

    async def exchange(self, step: int, plan: StepPlan, pipe: Pipeline | None = None) -> list[StepPlan]:
        """Post this rank's plan (with whatever ``pipe`` already holds) and wait for every rank's."""
        pipe = pipe if pipe is not None else self._redis.pipeline(transaction=False)
        self._stream.queue_plan(pipe, self.epoch, step, orjson.dumps(asdict(plan)))
        await pipe.execute()
        await self._wait_for_all(self._seen, step, "reach")
        plans = [self._seen[step][r] for r in range(self.size)]
        for old in [s for s in self._seen if s <= step]:
            del self._seen[old]
        return plans

    async def finish(self, step: int) -> None:
        """Return once every rank has finished its forward of ``step``: the collective end of a
        step that EP's all-to-all gives real forwards, for engines that have no EP to do it."""
        await self._stream.done(self.epoch, step, self.rank)
        await self._wait_for_all(self._done, step, "finish")
        for old in [s for s in self._done if s <= step]:
            del self._done[old]

    async def _wait_for_all(self, posts: Mapping[int, Collection[int]], step: int, what: str) -> None:
        """Until every rank has posted for ``step`` (``posts``: step -> the ranks, or their plans by rank)."""
        deadline = time.monotonic() + self.timeout_s
        while len(posts.get(step, ())) < self.size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(self.size)) - set(posts.get(step, ())))
                raise GroupBroken(
                    f"DP group {self.group} is broken: rank(s) {missing} did not {what} step {step} "
                    f"within {self.timeout_s:g}s",
                    missing,
                )
            await self._read(min(left, 1.0))

    async def nudge(self) -> None:
        """Wake the ranks of an idle group: this one has work."""
        await self._stream.wake(self.epoch, self.rank)

    async def wait_for_news(self, timeout_s: float) -> None:
        """While the group is idle: return when a rank posts to the group (a plan or a nudge),
        or after about ``timeout_s``."""
        await self._read(timeout_s)

    async def _read(self, block_s: float) -> None:
        self._last_id, posts = await self._stream.read(self._last_id, block_s)
        for post in posts:
            if post.epoch != self.epoch:
                continue
            if post.kind == "done":
                self._done.setdefault(post.step, set()).add(post.rank)
            elif post.kind == "plan":
                plan = StepPlan.from_json(post.plan)
                self._seen.setdefault(post.step, {})[plan.rank] = plan
            elif post.kind == "join":
                self._joined.add(post.rank)
                self._joined &= set(range(self.size))  # a rank this group does not have forms nothing


@dataclass
class ForwardClock:
    """How long this rank's forwards take, learned from those it ran: a prefill's fixed part and
    its part per token (a least-squares line through the last ``PREFILLS_KEPT`` prefills; seconds
    per token alone until two sizes were seen), and seconds per decode or idle forward (EWMAs).
    Unknown (0) until observed.

    A prefill's fixed part matters under EP: every MoE layer's exchanges cost about the same for
    64 tokens as for 1024 (51 ms of 51 + 0.06 per token in ``bench ep --engine paddle``'s
    calibration), and a per-token rate learned from short prompts announced a long one's step
    several times too long, so stagger windows held arrivals to their bound."""

    prefill_s_per_token: float = 0.0
    decode_s: float = 0.0
    idle_s: float = 0.0
    prefills: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=PREFILLS_KEPT))

    def observe(self, action: str, prefill_tokens: int, seconds: float) -> None:
        if action == "prefill" and prefill_tokens:
            self.prefill_s_per_token = _ewma(self.prefill_s_per_token, seconds / prefill_tokens)
            self.prefills.append((prefill_tokens, seconds))
        elif action == "decode":
            self.decode_s = _ewma(self.decode_s, seconds)
        elif action == "idle":
            self.idle_s = _ewma(self.idle_s, seconds)

    def estimate(self, action: str, prefill_tokens: int) -> float:
        if action == "prefill":
            line = _line(self.prefills)
            return line[0] + line[1] * prefill_tokens if line else self.prefill_s_per_token * prefill_tokens
        return self.decode_s if action == "decode" else self.idle_s


PREFILLS_KEPT = 32
"""The prefills a rank's clock fits its line to: recent enough to follow the load."""


def _line(points: Iterable[tuple[int, float]]) -> tuple[float, float] | None:
    """(fixed seconds, seconds per token) of the least-squares line through ``points``, both at
    least 0; None with fewer than two token counts."""
    pairs = list(points)
    n = len(pairs)
    mean_x, mean_y = sum(x for x, _ in pairs) / max(n, 1), sum(y for _, y in pairs) / max(n, 1)
    spread = sum((x - mean_x) ** 2 for x, _ in pairs)
    if n < 2 or spread == 0:
        return None
    slope = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in pairs) / spread)
    return max(0.0, mean_y - slope * mean_x), slope


def _ewma(old: float, new: float, weight: float = 0.2) -> float:
    return new if not old else (1 - weight) * old + weight * new


class DpStepper:
    """The stepper of a worker that is one rank of a DP group. The ranks of a group share a role:
    a mixed rank prefills or decodes in a step, a prefill rank prefills (its KV then goes to a
    decode worker, as a prefill worker's does), and a decode rank decodes what its KV came for;
    each runs an idle forward in a step it has nothing for (a decode rank waiting for its KV too)."""

    def __init__(self, parts: StepParts) -> None:
        self.parts, self.config, self.steps = parts, parts.config, parts.steps
        self.core, self.table = parts.steps.core, parts.steps.core.table
        c = self.config
        self.id = c.worker_id
        self.barrier = GroupBarrier(parts.redis, c.bus, c.dp_group, c.dp_rank, c.dp_size, c.dp_barrier_timeout_s)
        self.step_no = 0
        self.steps_end_together = engines.get(self.config.engine).capabilities.simulated_group
        """An engine with no EP (sim) has its ranks end each step together as EP's all-to-all makes
        real ones do: a token is out when the group's step ends, not when this rank's share of
        it does (the benchmark's processes then behave like the group they stand for)."""
        self.group_idle = False
        """True while the whole group waits for work: new work here must wake the others."""
        self.clock = ForwardClock()
        self.step_s = 0.0
        """How long the last step lasted for the whole group, as its engine decided it
        (``decided_step_s``); 0: as long as the ranks' forwards took."""
        self.steps.collective = c.ep

    async def start(self) -> None:
        try:
            epoch = await self.wait_for_group()
            if self.config.ep:
                await self.form_experts(epoch)
            self.steps.counters["dp_epoch"] = epoch  # schedulers place on a group whose ranks all show it
        except GroupBroken as exc:
            await self.leave(str(exc), exc.missing)
            return
        self.steps.report_load_soon()  # schedulers place on the group once every rank shows its epoch
        log.info(
            "DP group %s: rank %d of %d in step with the others",
            self.config.dp_group,
            self.config.dp_rank,
            self.config.dp_size,
        )

    async def wait_for_group(self) -> int:
        """The group's epoch, once every rank is live and has joined it."""
        timeout_s = max(60.0, self.config.dp_barrier_timeout_s)
        return await self.barrier.form(self.group_epoch, timeout_s, lambda: self.parts.loops.stopped)

    async def form_experts(self, epoch: int) -> None:
        """Form the group's expert-parallel process group for ``epoch``: rank 0 posts its store
        address (a free port on its KV transfer host) to ``sb:ep:{group}``, the others read it,
        and every rank's engine joins (``ExpertParallel.form_expert_group``)."""
        c, engine = self.config, self.steps.engine
        if not isinstance(engine, ExpertParallel):
            raise GroupBroken(f"the {c.engine} engine cannot split experts over ranks (--ep)")
        store = ExpertStore(self.parts.redis, c.bus.keys, c.dp_group)
        timeout_s = max(60.0, c.dp_barrier_timeout_s)
        if c.dp_rank == 0:
            address = StoreAddress(epoch, c.advertised_transfer_host, free_port(c.transfer_host))
            await store.post(address, int(timeout_s))
        else:
            address = await self.store_address(store, epoch, timeout_s)
        try:
            await engine.form_expert_group(address.host, address.port, c.dp_rank, c.dp_size, timeout_s)
        except Exception as exc:  # the store's or gloo's timeout, a refused connection
            raise GroupBroken(f"DP group {c.dp_group}: the expert-parallel group did not form: {exc}") from exc
        log.info("DP group %s: expert-parallel group formed at %s:%d", c.dp_group, address.host, address.port)

    async def store_address(self, store: ExpertStore, epoch: int, timeout_s: float) -> StoreAddress:
        deadline = time.monotonic() + timeout_s
        while (address := await store.read(epoch)) is None:
            if time.monotonic() > deadline or self.parts.loops.stopped:
                raise GroupBroken(
                    f"DP group {self.config.dp_group}: rank 0 posted no expert store within {timeout_s:g}s"
                )
            await asyncio.sleep(FORM_POLL_S)
        return address

    async def group_epoch(self) -> int:
        """The latest ``started_ms`` of the group's ranks while all of them are live, else 0."""
        ranks = self.group_ranks(await self.parts.registry.snapshot())
        if len(ranks) == self.config.dp_size and all(r.record.started_ms for r in ranks):
            return max(r.record.started_ms for r in ranks)
        return 0

    def group_ranks(self, workers: list[WorkerInfo]) -> list[WorkerInfo]:
        return [w for w in workers if w.alive and w.record.dp_group == self.config.dp_group]

    async def step(self) -> None:
        try:
            await self.lock_step()
        except GroupBroken as exc:
            await self.leave(str(exc), exc.missing)

    async def lock_step(self) -> None:
        self.steps.expire()
        mine = self.plan()
        started = time.monotonic()
        plans = await self.barrier.exchange(self.step_no, mine, self.load_report())
        action = bind_late(
            decide(mine, plans, self.config.dp_align_ms), mine, self.plan(), plans, self.config.dp_align_ms
        )
        tokens = self.core.prefill_batch_size()[1] if action == "prefill" else 0
        self.step_s = self.decided_step_s(plans, action, tokens)
        timed = self.timed_forward(plans, action, tokens)
        self.announce_forward(*timed)
        acting = time.monotonic()
        ran = await self.act(action)
        acted = time.monotonic()
        self.clock.observe(*(timed if self.config.ep else (ran, tokens)), acted - acting)
        if action != "none" and self.steps_end_together:
            await asyncio.sleep(acting + self.step_s - time.monotonic())  # the rest of the group's step
            await self.barrier.finish(self.step_no)
        self.step_no += 1
        self.parts.outbox.soon()
        if action != "none":
            self.observe_step(ran, time.monotonic() - started, acted - acting)

    def decided_step_s(self, plans: list[StepPlan], action: str, prefill_tokens: int) -> float:
        """The group step's duration where the engine decides it (the sim engine, which stands
        for EP: the slowest rank's compute plus the all-to-all, from every rank's plan, this
        rank's forward as it is bound); 0 for any other engine."""
        engine = self.steps.engine
        if not self.steps_end_together or not isinstance(engine, SimulatedGroup):
            return 0.0
        decode_seqs = self.table.count(Status.RUNNING) if action == "decode" else 0
        mine = (action, prefill_tokens if action == "prefill" else decode_seqs)
        ranks = forwards(plans, self.config.dp_align_ms)
        return engine.group_step_s(
            mine if p.rank == self.config.dp_rank else f for p, f in zip(plans, ranks, strict=True)
        )

    def timed_forward(self, plans: list[StepPlan], action: str, tokens: int) -> tuple[str, int]:
        """The forward whose duration this rank's clock learns and announces. Under EP every
        rank's forward lasts the group's step, which the largest forward sets (an idle rank waits
        in the exchanges for it): the step's largest prefill, else a decode. A rank that timed
        its own forward instead learned an idle forward's time from steps with a long prefill
        elsewhere, and announced it in steps with a short one: every stagger window then held
        its arrivals past the step's end (bench ep --engine paddle, high load: TTFT p50 +51 %)."""
        if not self.config.ep or action == "none":
            return action, tokens
        ranks = forwards(plans, self.config.dp_align_ms)
        prefills = [t for a, t in ranks if a == "prefill"] + ([tokens] if action == "prefill" else [])
        if prefills:
            return "prefill", max(prefills)
        return ("decode", 0) if any(a == "decode" for a, _ in ranks) or action == "decode" else (action, tokens)

    def announce_forward(self, action: str, prefill_tokens: int) -> None:
        """Tell schedulers when this forward should end, so their stagger windows close just
        before the group's next step: the step's arrivals are then spread together, in time to
        join it. The load goes with it, written once the forward has taken its prefill batch
        (a spawned task starts only when this one yields, in the forward); it is this rank's
        one load report per step (a prefill batch taken reports nothing more)."""
        if action == "none":
            return
        ends_in = self.step_s or self.clock.estimate(action, prefill_tokens)
        self.steps.counters["forward_ends_ms"] = int((time.time() + ends_in) * 1000)
        self.steps.report_load_soon()

    def load_report(self) -> Pipeline:
        """The rank's load, to go out with its step plan. It changes every step, and the
        scheduler spreads the group's work by it: with heartbeats alone (every 0.5 s), finished
        prefills still counted, so new work piled on the ranks that had reported little."""
        pipe = self.parts.redis.pipeline(transaction=False)
        self.parts.registry.queue_load(pipe, self.id, self.core.load())
        return pipe

    def observe_step(self, action: str, step_s: float, act_s: float) -> None:
        self.steps.counters["step_time_us"] += int(step_s * 1e6)
        self.steps.counters["idle_time_us" if action == "idle" else "busy_time_us"] += int(
            (step_s if action == "idle" else act_s) * 1e6
        )
        if action == "idle":
            self.steps.counters["idle_forward_us"] += int(act_s * 1e6)

    def plan(self) -> StepPlan:
        first, running = self.table.next_prefill(), self.table.count(Status.RUNNING)
        if first is None:
            return StepPlan(self.config.dp_rank, False, bool(running), 0.0, decode_seqs=running)
        # The prefill this rank runs next, not its oldest: an older one of a lower priority waits
        # behind it, so the batch to align is this one's, and its wait is what bounds the alignment.
        waited = (time.monotonic() - first.queued_at) * 1000
        queued = self.table.of(Status.QUEUED)
        held = tuple(dict.fromkeys(seq.task.batch_id for seq in queued if seq.task.batch_id))
        tokens = self.core.prefill_batch_size()[1]
        batch = first.task.batch_id, first.task.batch_ranks
        return StepPlan(self.config.dp_rank, True, bool(running), waited, *batch, held, tokens, running)

    async def act(self, action: str) -> str:
        """Run this rank's part of a step; what it ran (``action``, or ``idle`` where a prefill or
        decode under EP found nothing to run)."""
        if action == "none":
            await self.wait_for_group_work()
            return action
        self.steps.counters["steps"] += 1
        if not self.config.ep:
            return await self.forward(action)
        try:  # a collective: a rank that died or hangs must not hang this one
            return await asyncio.wait_for(self.forward(action), self.config.ep_timeout_s)
        except TimeoutError:
            raise GroupBroken(
                f"DP group {self.config.dp_group} is broken: a forward's expert exchange did not finish "
                f"within {self.config.ep_timeout_s:g}s (a rank died or hangs)"
            ) from None
        except CollectiveFailed as exc:
            raise GroupBroken(f"DP group {self.config.dp_group} is broken: {exc}") from exc

    async def forward(self, action: str) -> str:
        """This rank's forward in a step; what it ran. Under expert parallelism every rank must
        run exactly one: a prefill or decode that found nothing to run (no blocks) runs the idle
        forward."""
        ran = False
        if action == "prefill":
            ran = await self.steps.prefill_queued(report_load=False)
        elif action == "decode":
            ran = await self.steps.decode_running()
        if action != "idle" and (ran or not self.config.ep):
            return action
        self.steps.counters["idle_forwards"] += 1
        with metrics.ENGINE_STEP.labels("idle").time():
            try:
                await self.steps.engine.idle()
            except Exception as exc:
                if not self.config.ep:
                    raise
                raise CollectiveFailed(f"an idle forward failed: {exc}") from exc
        return "idle"

    async def wait_for_group_work(self) -> None:
        """The whole group is idle: no forward. Wait until a rank gets work: this one (its
        ``work_arrived`` nudges the group) or another (its nudge or plan reaches the group's
        stream). Each rank used to wait on its own tasks only, so a request that reached one
        rank of an idle group waited for the others' idle timeout."""
        self.steps.expire()
        self.group_idle = True
        if not self.steps.has_work():  # work that came before group_idle was set sent no nudge
            await self.wait_for_news()
        self.group_idle = False

    async def wait_for_news(self) -> None:
        """Until a rank posts to the group's stream, or about ``IDLE_WAIT_S``. A decode rank's work
        comes with a KV cache, not with its task: while it waits here, the cache's arrival wakes
        the group too (else its first decode would wait for the idle timeout)."""
        if self.config.role != Role.DECODE:
            await self.barrier.wait_for_news(IDLE_WAIT_S)
            return
        watcher = asyncio.ensure_future(self.wake_group_when_kv_comes())
        try:
            await self.barrier.wait_for_news(IDLE_WAIT_S)
        finally:
            watcher.cancel()

    async def wake_group_when_kv_comes(self) -> None:
        """Once an import has made a request RUNNING here (the receiver sets ``wake``). The nudge
        is spawned: this watcher is cancelled as the wait ends, and a nudge cut off mid-write
        would cost the connection."""
        while not self.steps.has_work():
            self.steps.wake.clear()
            await self.steps.wake.wait()
        self.parts.loops.spawn(self.wake_group())

    async def work_arrived(self) -> None:
        self.steps.wake.set()
        if self.config.role != Role.DECODE or self.steps.has_work():  # a decode task's work comes with its KV
            await self.wake_group()

    async def wake_group(self) -> None:
        """Wake the ranks of an idle group: this one has work."""
        if self.group_idle:
            self.group_idle = False
            await self.barrier.nudge()

    async def leave(self, reason: str, missing: list[int]) -> None:
        """The group is broken: stop with ``EXIT_GROUP_BROKEN`` (``splitbus up`` restarts the rank,
        and the group re-forms once all its ranks are back). A mixed rank fails what it holds
        (and, on the lowest surviving rank, what the missing ranks were given) and leaves the
        registry; a prefill or decode rank hands what it holds over (``hand_over``).

        Called by the engine loop (or at start-up) when the group broke, in the caller's task:
        the worker's background loops are stopped before anything else."""
        log.error(
            "%s; %s held requests and stopping", reason, "failing" if self.config.role == Role.MIXED else "moving"
        )
        # The other loops stop first, as they did when the group's break ended the worker: a
        # task read after the sweep below would be queued with nobody to fail it (the reaper
        # never looks at a deregistered worker), and a heartbeat or a reservation give-back
        # written after the deregister would leave a ghost record (or lease) behind.
        self.parts.loops.exit_code = EXIT_GROUP_BROKEN
        await self.parts.loops.close()
        if self.config.role != Role.MIXED:
            await self.hand_over()
            return
        self.steps.apply(self.core.group_broken(reason))
        if self.config.dp_rank == min(set(range(self.config.dp_size)) - set(missing), default=-1):
            await self.fail_orphaned_tasks(reason, missing)
        await self.parts.publish()
        await self.parts.registry.deregister(self.id)

    async def hand_over(self) -> None:
        """A prefill or decode rank's requests must not be lost with its group: what its steps
        made goes out, then the rank gives up its lease (``Registry.resign``) with its tasks
        still unacked in its stream. A reaper takes it as dead and moves them, as a dead
        worker's, to another group of the role (the scheduler places only on complete groups),
        each continuing at the next ``seq`` from the tokens already sent; with no other group it
        keeps them until this one re-forms, within their deadline. The missing ranks' tasks move
        the same way once their leases lapse: nothing is swept here."""
        await self.parts.publish()
        await self.parts.registry.resign(self.id)

    async def fail_orphaned_tasks(self, reason: str, missing: list[int]) -> None:
        """Tasks in the missing ranks' streams would wait forever: answer them with the reason."""
        dead = [
            w.record.worker_id
            for w in await self.parts.registry.snapshot()
            if w.record.dp_group == self.config.dp_group and w.record.dp_rank in missing
        ]
        redis, bus = self.parts.redis, self.config.bus
        for worker_id in dead:
            stream = task_consumer(redis, bus, worker_id, self.id)
            orphans = await stream.read(10_000, block_ms=0) + await stream.claim_idle(10_000, min_idle_ms=0)
            for delivery in orphans:
                if isinstance(delivery.message, Task):
                    request = delivery.message.request
                    self.parts.outbox.writer.fail(
                        request.request_id, "dp_group_broken", reason, 503, reader=request.reader
                    )
            await stream.ack(*[d.entry_id for d in orphans])


def free_port(host: str) -> int:
    """A port free on ``host`` now (the store binds it a moment later)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
