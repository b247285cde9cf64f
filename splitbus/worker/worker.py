"""A worker process: pull tasks while there is room, step the engine, publish results.

Roles: a ``prefill`` worker prefills, publishes the first token and hands the KV cache to the
decode worker named in its task; a ``decode`` worker reserves KV blocks, waits for that cache
and decodes; a ``mixed`` worker does both. Tasks are acked once their work is handed on: by P
when D has the cache, by D when the final entry is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from splitbus.bus.aio import cancel_and_wait
from splitbus.bus.cancel import CancelListener, publish_cancel
from splitbus.bus.connection import connect, forever, is_transient, transient_suppressed, until_done
from splitbus.bus.keys import WORKER_GROUP
from splitbus.bus.messages import Task
from splitbus.bus.registry import Registry, Reserved, WorkerLoad, WorkerRecord
from splitbus.bus.reservations import Reservation, Reservations
from splitbus.bus.results import ResultWriter
from splitbus.bus.scheduler.policy import blocks_needed
from splitbus.bus.scheduler.reaper import REAPING_TTL_S
from splitbus.bus.streams import Delivery, GroupConsumer, trim_consumed
from splitbus.tokenization import ModelTokenizer
from splitbus.worker import metrics
from splitbus.worker.config import WorkerConfig
from splitbus.worker.control import control_server
from splitbus.worker.engine import Engine
from splitbus.worker.handoff import meta_problem
from splitbus.worker.links import PeerLinks
from splitbus.worker.sequence import Sequence
from splitbus.worker.text import TextStream
from splitbus.worker.transfer import (
    Header,
    TransferClient,
    TransferError,
    TransferServer,
    Unreachable,
    new_secret,
    proof_matches,
)

log = logging.getLogger(__name__)
TRIM_EVERY_S = 5.0
RECENT_CANCELS = 10_000
EXIT_FATAL = 1
"""The exit code of a worker stopped by a fatal error (a bug in a loop, never an entry)."""
RETRY_FIRST_S = 0.02
RETRY_MAX_S = 0.5
"""Backoff between hand-off attempts to a decode worker that does not answer (capped)."""
LIVENESS_POLL_S = 0.25
"""While a transfer waits on its decode worker, how often P checks whether that worker is gone."""
REAPED_WAIT_S = 10.0
"""A worker back from a lapsed lease whose reaper has started waits this long for it to finish."""
REJOIN_HOLD_S = 2
"""After a rejoin, ``sb:reaping:{worker}`` is kept this long: a reaper acting on a registry
snapshot from before the rejoin (100 ms old at most) cannot take the worker again."""


class PeerGone(Exception):
    """The decode worker of a hand-off is dead, or the request moved: the reaper has it."""


class Abandoned(Exception):
    """The hand-off's request left this worker while it was being shipped (it moved)."""


class Worker:
    def __init__(self, config: WorkerConfig, tokenizer: ModelTokenizer, engine: Engine) -> None:
        self.config = config
        self.id = config.worker_id
        self.tokenizer = tokenizer
        self.engine = engine
        self.redis = connect(config.bus, max_connections=16, name=self.id)
        self.keys = config.bus.keys
        self.registry = Registry(self.redis, config.bus)
        self.tasks = GroupConsumer(
            self.redis, config.bus, self.keys.tasks(self.id), WORKER_GROUP, self.id, on_dead=self.fail_request
        )
        self.writer = ResultWriter(self.redis, config.bus)
        self.cancels = CancelListener(self.redis, config.bus)
        self.server = TransferServer(self.id, self.admit_kv, self.import_kv)
        self.links = PeerLinks(self.redis, config.bus, self.id, TransferClient(self.id, config.transfer_timeout_s))
        self.control = control_server(self)
        self.stop_reporting_load = metrics.watch_load(self.load)
        self.endpoint = ""
        self.queued: deque[Sequence] = deque()  # to prefill
        self.awaiting_kv: dict[str, tuple[Sequence, float]] = {}  # decode: waiting for P's cache
        self.running: list[Sequence] = []  # decoding
        self.handing_off: dict[str, Sequence] = {}  # prefill: cache on its way to D
        self.prefilling: list[Sequence] = []  # in the engine's prefill step now
        self.last_beat = 0.0  # monotonic time of the last heartbeat Redis took (before its call)
        self.done_entries: list[str] = []  # task entries to ack at the next publish
        self.stale_reservations: list[tuple[str, str]] = []  # (request, task entry) of decode tasks that left
        self.unreturned = Reserved()  # reservations of tasks taken, not given back yet
        self.unaccepted: deque[Delivery] = deque()  # tasks read, not taken yet
        self.reread_pending = False  # a task read failed: its reply may have held tasks (take_lost)
        self.seen_entries: dict[str, None] = {}  # task entries taken lately, oldest first (bounded)
        self.reservations = Reservations(self.redis, self.keys)
        self.recently_cancelled: dict[str, float] = {}
        self.counters = dict.fromkeys(
            (
                "prefills_done",
                "decodes_done",
                "steps",
                "idle_forwards",
                "step_time_us",
                "idle_time_us",
                "busy_time_us",
                "forward_ends_ms",
            ),
            0,
        )
        self.exit_code = 0
        self.started_ms = 0
        self.wake = asyncio.Event()
        self.room = asyncio.Event()
        self.to_publish = asyncio.Event()
        self._publishing = asyncio.Lock()
        self.stopping = asyncio.Event()
        self._background: set[asyncio.Task[Any]] = set()

    # ------------------------------------------------------------ main loop

    async def run(self) -> None:
        """The engine loop until stopped. Every loop here, this one and the background ones,
        runs under ``forever``'s one policy: Redis refusing (down, LOADING, OOM...) is waited
        out with nothing buffered dropped; an entry that cannot be handled fails its request
        alone; anything else is a bug, and the worker stops with exit code ``EXIT_FATAL``."""
        await self.start()
        try:
            await forever(self.step, self.stopping.is_set, f"worker {self.id}: engine loop")
        except Exception:
            self.exit_code = self.exit_code or EXIT_FATAL
            raise
        finally:
            await self.close()

    async def step(self) -> None:
        # Results go out after each engine call, written by the publisher task while the
        # engine goes on: a first token waits neither for the decode nor for Redis.
        await self.settle_if_lapsed()  # back from a stop: what moved away is dropped before anything
        await self.wait_for_work()
        await self.prefill_queued()
        self.publish_soon()
        await self.decode_running()
        self.publish_soon()

    # ------------------------------------------------------------ life cycle

    async def start(self) -> None:
        self.endpoint = await self.server.start(
            self.config.transfer_host, self.config.transfer_port, self.config.advertised_transfer_host
        )
        await until_done(self.join_bus, self.redis, self.stopping.is_set, "start-up")
        for loop in (
            self.feed_tasks,
            self.heartbeat,
            self.listen_for_cancels,
            self.trim_tasks,
            self.answer_commands,
            self.publisher,
            self.find_lost_tasks,
        ):
            self.spawn(self._forever(loop))
        log.info("worker %s (%s) ready, KV endpoint %s", self.id, self.config.role, self.endpoint)

    async def join_bus(self) -> None:
        """The start-up steps on Redis; each is safe to repeat (retried while Redis loads)."""
        await self.tasks.ensure_group()
        await self.cancels.start()
        await self.control.start()
        self.started_ms = await self.registry.register(self.record(), self.config.lease_ms)
        await self.beat()  # now with started_ms

    async def close(self) -> None:
        self.stopping.set()
        self.room.set()
        with transient_suppressed("the last publish"):
            await self.publish()  # what the last steps left
        await cancel_and_wait(self._background)
        self.stop_reporting_load()
        with transient_suppressed("leaving the registry"):
            if self.exit_code == 0 and not self.held():
                await self.registry.deregister(self.id)
            else:  # what it held must move: deregistered, no reaper would ever look at it
                await self.registry.resign(self.id)
        await self.server.close()
        await self.links.client.close()
        await self.redis.aclose()

    def record(self) -> WorkerRecord:
        return WorkerRecord(
            worker_id=self.id,
            role=self.config.role,
            model=self.config.model_name,
            engine=self.config.engine,
            transfer_endpoint=self.endpoint,
            block_size=self.config.block_size,
            max_model_len=self.tokenizer.context_length,
            load=self.load(),
            started_ms=self.started_ms,
            dp_group=self.config.dp_group,
            dp_rank=self.config.dp_rank,
            dp_size=self.config.dp_size,
        )

    def load(self) -> WorkerLoad:
        return WorkerLoad(
            running=len(self.running) + len(self.handing_off),
            waiting=len(self.queued) + len(self.awaiting_kv),
            queued_prefill_tokens=sum(s.prompt_len for s in self.queued),
            free_kv_blocks=self.engine.free_blocks,
            total_kv_blocks=self.engine.total_blocks,
            **self.counters,
        )

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _forever(self, step: Callable[[], Awaitable[None]]) -> None:
        """Run a background loop's step under ``forever``; a fatal error stops the worker with a
        non-zero exit code (it used to exit 0, which supervisors read as a clean stop)."""
        try:
            await forever(step, self.stopping.is_set, f"worker {self.id}: {step.__name__}")
        except Exception:
            log.exception("%s failed; stopping the worker", step.__name__)
            self.exit_code = self.exit_code or EXIT_FATAL
            self.stopping.set()
            self.wake.set()
            self.room.set()

    # ------------------------------------------------------------ bus edges

    async def heartbeat(self) -> None:
        # The whole record each time (~20 small fields): a worker whose record was removed, say
        # by a reaper during a long Redis outage, is whole again at its next beat.
        if self.lapsed():
            await self.settle_if_lapsed()
        else:
            await self.beat()
        await asyncio.sleep(self.config.heartbeat_s)

    async def settle_if_lapsed(self) -> None:
        """Rejoin first if the lease lapsed; under the publish lock, so that nothing is written
        until the worker knows what moved away. A local check when it did not."""
        if self.lapsed():
            async with self._publishing:
                await self.rejoin()

    async def beat(self) -> None:
        before = time.monotonic()
        await self.registry.register(self.record(), self.config.lease_ms)
        self.last_beat = before

    def lapsed(self) -> bool:
        """Whether the lease may have expired: no beat for a lease (the process was stopped,
        hung, or cut off from Redis). Monotonic time counts while a process is stopped. False
        before the first beat (nothing is held yet)."""
        return bool(self.last_beat) and time.monotonic() - self.last_beat > self.config.lease_ms / 1000

    # ------------------------------------------------------------ back from a lapsed lease

    async def rejoin(self) -> None:
        """Back after the lease lapsed (SIGSTOP, a long pause, an outage): a reaper may have
        moved this worker's tasks. Whoever takes ``sb:reaping:{worker}`` first decides: if this
        worker takes it, no reaper can start and it keeps everything; if a reaper has it, the
        worker waits for it to finish, drops every request whose task the reaper took (no longer
        pending to this worker), with what it buffered for them unwritten, and joins again.
        Runs under the publish lock: no late write goes out before this is settled."""
        if not self.lapsed():
            return
        key = self.keys.reaping(self.id)
        log.warning(
            "worker %s: no heartbeat for %.1f s, more than its lease; rejoining",
            self.id,
            time.monotonic() - self.last_beat,
        )
        if not await self.redis.set(key, f"{self.id}:rejoining", nx=True, ex=REAPING_TTL_S):
            await self.wait_until_reaped()
            await self.drop_moved()
        await self.beat()
        await self.redis.expire(key, REJOIN_HOLD_S)
        log.warning("worker %s rejoined the live set", self.id)

    async def wait_until_reaped(self) -> None:
        deadline = time.monotonic() + REAPED_WAIT_S
        while time.monotonic() < deadline:
            if await self.redis.hget(self.keys.worker(self.id), "state") == b"dead":
                return
            await asyncio.sleep(0.05)
        log.warning("worker %s: its reaper did not finish within %.0f s; dropping what it took", self.id, REAPED_WAIT_S)

    async def drop_moved(self) -> None:
        """Drop every task the reaper took: those no longer pending to this worker. In place: a
        read still in flight adds what it brings to this same backlog (a task written while the
        reaper worked is this worker's)."""
        before = self.known_entries()  # what arrives while XPENDING is on its way is this worker's
        mine = await self.tasks.pending_ids()
        kept = [d for d in self.unaccepted if d.entry_id in mine or d.entry_id not in before]
        self.unaccepted.clear()
        self.unaccepted.extend(kept)
        held = [*self.held_sequences(), *self.prefilling]
        moved = [seq for seq in held if seq.entry_id not in mine and seq.entry_id in before]
        for seq in moved:
            self.moved_away(seq)
        log.warning("worker %s: %d request(s) moved away while it was out: dropped", self.id, len(moved))
        await self.take_lost()

    async def find_lost_tasks(self) -> None:
        """Now and then, take tasks lost without an error: redis-py retries a read whose reply
        timed out (a stop, a stall past the socket timeout) and returns the retry's reply, while
        Redis had delivered entries to the first. Only entries older than a read and its timeout
        are looked at, so none that a read in flight is bringing."""
        await asyncio.sleep(self.config.bus.socket_timeout_s)
        await self.take_lost(int(self.config.bus.socket_timeout_s * 1000) + self.config.bus.block_ms)

    async def take_lost(self, min_idle_ms: int = 0) -> None:
        """Take the tasks pending to this worker that it has never seen: Redis delivered them to
        a read whose reply was lost (it timed out after a long stop, or its connection dropped).
        Nobody else would: a live worker's pending entries are not claimed."""
        if not self.tasks.rereading_backlog:  # else its next reads bring back all that is pending anyway
            lost = sorted(await self.tasks.pending_ids(min_idle_ms) - self.known_entries(), key=_entry_order)
            if lost:
                log.warning(
                    "worker %s: %d task(s) delivered to a read whose reply was lost; taking them", self.id, len(lost)
                )
                self.unaccepted.extend(await self.tasks.fetch(lost))
        if not min_idle_ms:
            self.reread_pending = False  # only now: a Redis error above leaves it to the next feed

    def known_entries(self) -> set[str]:
        """Task entries this worker has seen: held, in its backlog, taken lately (done, perhaps
        acked already), or dead-lettered with the letter not sent yet."""
        held = {s.entry_id for s in [*self.held_sequences(), *self.prefilling]}
        return (
            held
            | {d.entry_id for d in self.unaccepted}
            | set(self.done_entries)
            | set(self.seen_entries)
            | self.tasks.unsent_letters()
        )

    def saw(self, entry_id: str) -> None:
        self.seen_entries[entry_id] = None
        while len(self.seen_entries) > RECENT_CANCELS:
            del self.seen_entries[next(iter(self.seen_entries))]

    def moved_away(self, seq: Sequence) -> None:
        """Forget a request the reaper moved: free its blocks, write nothing more for it."""
        if self.handing_off.get(seq.request_id) is seq:
            del self.handing_off[seq.request_id]
        self.prefilling = [s for s in self.prefilling if s is not seq]
        self._remove(seq.request_id)
        self.retire(seq)
        self.writer.discard(seq.request_id)
        self.wake.set()

    def held(self) -> int:
        return len(self.queued) + len(self.awaiting_kv) + len(self.running) + len(self.handing_off)

    async def feed_tasks(self) -> None:
        """Read tasks, only while there is room for them. What was read is taken from a backlog,
        so a Redis refusal while taking one task (a decode worker writes its KV reservation)
        leaves the tasks read with it to be taken once Redis is back, not dropped."""
        if self.reread_pending:
            await self.take_lost()
        if not self.unaccepted:
            room = self.config.max_requests - self.held()
            if room <= 0:
                self.room.clear()
                await self.room.wait()
                return
            try:
                read = await self.tasks.read(room)
            except Exception as exc:
                self.reread_pending = is_transient(exc)  # its reply may have held tasks: look for them
                raise
            self.unaccepted.extend(read)
        while self.unaccepted:
            await self.accept_safely(self.unaccepted.popleft())
        await self.work_arrived()  # the engine loop starts on them while the reservations go back
        await self.give_back_reservations()

    async def work_arrived(self) -> None:
        self.wake.set()

    async def give_back_reservations(self) -> None:
        """Give back what the scheduler reserved for the tasks taken, with the load that now
        counts them: until the next heartbeat the tasks would otherwise be in neither. Kept
        until Redis takes it (the publisher tries again): a lost give-back would leave this
        worker looking busier for good."""
        taken, self.unreturned = self.unreturned, Reserved()
        if taken == Reserved():
            return
        try:
            await self.registry.report_load(self.id, self.load(), taken)
        except BaseException:
            self.unreturned = _add(self.unreturned, taken)
            raise

    async def accept_safely(self, delivery: Delivery) -> None:
        """Take one task. One that cannot be handled fails its request alone (an error entry
        for its client, a dead letter with the reason); the worker goes on."""
        try:
            await self.accept(delivery)
        except Exception as exc:
            if is_transient(exc):
                raise
            log.exception("task %s failed as it was taken", delivery.entry_id)
            await self.reject(delivery, "handler_failed", f"{type(exc).__name__}: {exc}")

    async def accept(self, delivery: Delivery) -> None:
        task = delivery.message
        if delivery.entry_id in self.seen_entries:  # taken as lost while its read's reply was on its way
            return
        self.saw(delivery.entry_id)
        if not isinstance(task, Task):
            await self.reject(delivery, "handler_failed", f"a {type(task).__name__} entry is not a task")
            return
        overdrawn = self.check_reservation(task)
        if overdrawn is None:
            self.unreturned = _add(self.unreturned, Reserved(*task.reserved))
        problem = overdrawn or self.check_task(task)
        if problem is not None:
            await self.reject(delivery, "invalid_task", problem)
            return
        seq = Sequence(task, delivery.entry_id, TextStream(self.tokenizer, task.request.sampling.stop))
        log.debug(
            "took task %s: %s of %s, peer %s, hand-off %s",
            delivery.entry_id,
            task.phase,
            task.request.request_id,
            task.peer or "-",
            task.handoff or "-",
        )
        if task.request.request_id in self.recently_cancelled:
            self.done_entries.append(delivery.entry_id)
            return
        for older in [s for s in [*self.held_sequences(), *self.prefilling] if s.request_id == seq.request_id]:
            self.moved_away(older)  # the request moved here again (its other worker died): its older task is void
        if task.phase != "decode":
            self.writer.open(seq.request_id, first_seq=task.first_seq)
            seq.output_ids = list(task.output_token_ids)
            seq.text.push(seq.output_ids)
        if self.take_blocks(seq):
            await self.accept_with_blocks(seq)

    async def accept_with_blocks(self, seq: Sequence) -> None:
        if seq.task.phase != "decode":
            self.queued.append(seq)
            return
        # The secret makes the reservation usable only by who can read it from Redis: P proves
        # it in its KV frame, so knowing a request id (every client does) is not enough to send one.
        seq.kv_secret = new_secret()
        self.awaiting_kv[seq.request_id] = (seq, time.monotonic() + self.config.kv_wait_s)
        reservation = Reservation(
            decode_worker=self.id,
            endpoint=self.endpoint,
            blocks=seq.blocks,
            prefill_worker=seq.task.peer,
            task_entry=seq.entry_id,
            secret=seq.kv_secret,
            handoff=seq.task.handoff,
        )
        if not await self.reservations.reserve(seq.request_id, reservation):
            # The reaper replaced this task's dispatch before it came here: nobody will send its KV.
            log.info("task %s of %s is void (the request was dispatched again); dropped", seq.entry_id, seq.request_id)
            if self.awaiting_kv.get(seq.request_id, (None,))[0] is seq:
                del self.awaiting_kv[seq.request_id]
                self.retire(seq)

    def check_reservation(self, task: Task) -> str | None:
        """Why the task's ``reserved`` cannot be given back, or None. A scheduler reserves at
        most the task's prompt tokens (phases that prefill), one request and the KV blocks of
        prompt + max_tokens (phases that decode); a task claiming more was not written by one,
        and giving its numbers back would drive this worker's counters negative."""
        tokens, blocks = len(task.request.prompt_token_ids), blocks_needed(task.request, self.config.block_size)
        bound = {"prefill": (tokens, 0, 0), "decode": (0, 1, blocks), "mixed": (tokens, 1, blocks)}[task.phase]
        if all(r <= b for r, b in zip(task.reserved, bound)):
            return None
        return f"reserved {task.reserved} exceeds what a {task.phase} task of this request can reserve, {list(bound)}"

    def check_task(self, task: Task) -> str | None:
        """Why this worker cannot run the task, or None: its tokens must be in this model's
        vocabulary (the tokenizer raises on ids it does not know) and fit its context."""
        request, vocab = task.request, self.tokenizer.vocab_size
        if request.model != self.config.model_name:
            return f"the task is for model {request.model!r}; this worker serves {self.config.model_name!r}"
        for name, ids in (("prompt_token_ids", request.prompt_token_ids), ("output_token_ids", task.output_token_ids)):
            bad = next((i for i in ids if i >= vocab), None)
            if bad is not None:
                return f"{name} holds token id {bad}, outside this model's vocabulary [0, {vocab})"
        if len(task.output_token_ids) > request.sampling.max_tokens:
            return f"{len(task.output_token_ids)} output tokens exceed max_tokens {request.sampling.max_tokens}"
        prompt, most = len(request.prompt_token_ids), request.sampling.max_tokens
        if prompt + most > self.tokenizer.context_length:
            return f"prompt ({prompt}) + max_tokens ({most}) exceed the context ({self.tokenizer.context_length})"
        return None

    async def reject(self, delivery: Delivery, code: str, reason: str) -> None:
        """Dead-letter a task this worker cannot handle, and fail its request."""
        log.warning("task %s rejected: %s", delivery.entry_id, reason)
        await self.tasks.dead_letter(delivery, f"{code}: {reason}")
        request_id = getattr(getattr(delivery.message, "request", None), "request_id", None)
        if isinstance(request_id, str):
            self.fail_request(request_id, f"{code}: {reason}")

    def fail_request(self, request_id: str, reason: str) -> None:
        """End a request whose task was dead-lettered with an error entry, so its client is not
        left waiting for its deadline; not one this worker still holds (that one answers)."""
        if any(s.request_id == request_id for s in self.held_sequences()):
            return
        code = reason.split(":", 1)[0]
        self.writer.fail(request_id, code, f"worker {self.id} could not handle this request's task: {reason}", 500)
        metrics.REQUESTS_FINISHED.labels(code).inc()
        self.publish_soon()

    def held_sequences(self) -> list[Sequence]:
        waiting = [entry[0] for entry in self.awaiting_kv.values()]
        return [*self.queued, *self.running, *self.handing_off.values(), *waiting]

    def take_blocks(self, seq: Sequence) -> bool:
        """KV room for the request: its prompt on a prefill worker, prompt + max_tokens where
        it decodes."""
        tokens = len(seq.all_tokens)
        if seq.task.phase != "prefill":
            tokens = seq.prompt_len + seq.request.sampling.max_tokens
        if not self.engine.reserve(seq, tokens):
            free = self.engine.free_blocks
            self.fail(
                seq,
                "out_of_kv_blocks",
                f"worker {self.id} has {free} free KV blocks, not enough for {tokens} tokens",
                503,
            )
            return False
        return True

    async def trim_tasks(self) -> None:
        """Delete this worker's task entries once acked (never an unacked one)."""
        await asyncio.sleep(TRIM_EVERY_S)
        await trim_consumed(self.redis, self.keys.tasks(self.id))

    async def answer_commands(self) -> None:
        await self.control.serve_once()

    async def listen_for_cancels(self) -> None:
        for cancel in await self.cancels.poll():
            if cancel.entry_id and cancel.worker == self.id:
                self.drop_task(cancel.entry_id)
            elif not cancel.worker:
                self.drop(cancel.request_id)

    # ------------------------------------------------------------ engine steps

    async def wait_for_work(self) -> None:
        self.expire_waits()
        if self.queued or self.running:
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.wake.wait(), 0.5)
        self.wake.clear()

    async def prefill_queued(self) -> None:
        batch = self.next_prefill_batch()
        if not batch:
            return
        self.batch_taken()
        metrics.PROMPT_TOKENS.inc(sum(len(seq.all_tokens) for seq in batch))
        self.prefilling = list(batch)
        try:
            results = await self.run_engine(self.engine.prefill, batch)
            await self.settle_if_lapsed()  # stopped during the step: its moved requests go first
        finally:
            still, self.prefilling = self.prefilling, []
        results = [(seq, token) for seq, token in results if any(s is seq for s in still)]  # not moved away meanwhile
        metrics.GENERATION_TOKENS.inc(len(results))
        for seq, token in results:
            self.emit(seq, token)
            self.after_prefill(seq)

    def batch_taken(self) -> None:
        """The engine took a prefill batch: report the load without it, which schedulers place
        the next work by while the batch runs. Until the next report the batch still counted as
        queued, so new work avoided the ranks that were prefilling most and piled onto the
        others, whose next prefill steps grew long (in the 4-rank benchmark, one rank
        prefilled up to 5 times as long as another in the same step)."""
        self.spawn(self.report_load_now())

    async def report_load_now(self) -> None:
        """Advisory: an outage only leaves it to the next report."""
        with transient_suppressed("a load report"):
            await self.registry.report_load(self.id, self.load())

    def next_prefill_batch(self) -> list[Sequence]:
        count, _ = self.prefill_batch_size()
        return [self.queued.popleft() for _ in range(count)]

    def prefill_batch_size(self) -> tuple[int, int]:
        """How many queued sequences the next prefill batch takes, and their tokens."""
        count = tokens = 0
        for seq in self.queued:
            if count and tokens + len(seq.all_tokens) > self.config.max_prefill_tokens:
                break
            count, tokens = count + 1, tokens + len(seq.all_tokens)
        return count, tokens

    def after_prefill(self, seq: Sequence) -> None:
        self.counters["prefills_done"] += 1
        if seq.task.phase == "mixed" and not seq.finished:
            self.running.append(seq)
        elif seq.finished:  # done at its first token: D has nothing to decode
            self.finish(seq)
            if seq.task.phase == "prefill":
                self.cancel_peer(seq, "finished_on_prefill")
        else:
            self.handing_off[seq.request_id] = seq
            self.spawn(self.hand_off(seq))

    async def decode_running(self) -> None:
        if not self.running:
            return
        # A snapshot: imports and cancellations change self.running while the engine computes.
        batch = list(self.running)
        results = await self.run_engine(self.engine.decode, batch)
        await self.settle_if_lapsed()
        still_running = set(map(id, self.running))
        emitted = [(seq, token) for seq, token in results if id(seq) in still_running]
        metrics.GENERATION_TOKENS.inc(len(emitted))
        for seq, token in emitted:
            self.emit(seq, token)
        for seq in [s for s in self.running if s.finished]:
            self.running.remove(seq)
            self.counters["decodes_done"] += 1
            self.finish(seq)

    async def run_engine(
        self, step: Callable[[list[Sequence]], Awaitable[list[int]]], batch: list[Sequence]
    ) -> list[tuple[Sequence, int]]:
        """One engine call for the batch. If it raises, each sequence runs alone to find the
        one that breaks it: that request is poison and ends with an error and a dead letter,
        and the others go on."""
        try:
            with metrics.ENGINE_STEP.labels(getattr(step, "__name__", "step")).time():
                return list(zip(batch, await step(batch)))
        except Exception as exc:
            if is_transient(exc):
                raise
            log.error("engine step failed on a batch of %d (%s); running each alone", len(batch), exc)
        done = []
        for seq in batch:
            try:
                done += list(zip([seq], await step([seq])))
            except Exception as exc:
                if is_transient(exc):
                    raise
                await self.poison(seq, exc)
        return done

    async def poison(self, seq: Sequence, exc: Exception) -> None:
        self._remove(seq.request_id)
        self.handing_off.pop(seq.request_id, None)
        await self.tasks.dead_letter(Delivery(self.tasks.stream, seq.entry_id, seq.task), f"engine_error: {exc}")
        self.fail(seq, "engine_error", f"the engine failed on this request: {exc}", 500)

    def emit(self, seq: Sequence, token_id: int) -> None:
        self.writer.tokens(seq.request_id, [token_id], seq.add_token(token_id, self.engine.eos_token_ids))

    def finish(self, seq: Sequence) -> None:
        text = seq.text.flush()
        metrics.REQUESTS_FINISHED.labels(seq.finish_reason or "stop").inc()
        self.writer.finish(seq.request_id, seq.finish_reason or "stop", seq.prompt_len, len(seq.output_ids), text)
        self.retire(seq)

    def fail(self, seq: Sequence, code: str, message: str, status: int) -> None:
        log.warning("request %s failed: %s", seq.request_id, message)
        metrics.REQUESTS_FINISHED.labels(code).inc()
        self.writer.fail(seq.request_id, code, message, status)
        self.retire(seq)

    def retire(self, seq: Sequence) -> None:
        """The request leaves this worker: free its blocks, ack its task at the next publish."""
        self.engine.release(seq)
        self.done_entries.append(seq.entry_id)
        self.writer.forget(seq.request_id)
        if seq.task.phase == "decode":
            self.stale_reservations.append((seq.request_id, seq.entry_id))
        self.room.set()
        self.publish_soon()

    def publish_soon(self) -> None:
        self.to_publish.set()

    async def publisher(self) -> None:
        """Writes what the engine loop and the hand-offs leave, one write at a time, so entries
        keep their order. While Redis refuses (OOM, outage) everything stays buffered."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.to_publish.wait(), 0.5)
        self.to_publish.clear()
        await self.publish()

    async def publish(self) -> None:
        """Write the results, then ack finished tasks and drop stale reservations; each list is
        cleared only once written, so an outage loses nothing."""
        async with self._publishing:
            await self._publish()

    async def _publish(self) -> None:
        await self.rejoin()  # back from a lapsed lease: drop what moved away before writing for it
        if self.writer.pending:
            await self.writer.flush()
        await self.tasks.send_graves()
        await self.give_back_reservations()
        if self.done_entries:
            done = list(self.done_entries)
            await self.tasks.ack(*done)
            del self.done_entries[: len(done)]
        if self.stale_reservations:
            stale = list(self.stale_reservations)
            pipe = self.redis.pipeline(transaction=False)
            for request_id, entry_id in stale:
                await self.reservations.drop(request_id, entry_id, client=pipe)
            await pipe.execute()
            del self.stale_reservations[: len(stale)]

    # ------------------------------------------------------------ P -> D hand-off

    async def hand_off(self, seq: Sequence) -> None:
        """Ship the cache to the decode worker named in the task, then ack (or fail) the task.
        A dead or hung decode worker does not fail the request: once it is found gone, the
        request is the reaper's (it gets a new P/D pair, prefilled again), and P only lets go."""
        try:
            await self.ship_kv(seq)
        except Abandoned:
            pass  # moved away (retired where it was dropped)
        except PeerGone as exc:
            if self.handing_off.get(seq.request_id) is seq:
                log.warning("%s; leaving %s to the reaper", exc, seq.request_id)
                self.retire(seq)
        except (TransferError, asyncio.TimeoutError) as exc:
            if self.handing_off.get(seq.request_id) is seq:
                await self.transfer_failed(seq, exc)
        except Exception as exc:  # a bug: this request alone fails (its task acked), the worker goes on
            log.exception("hand-off of %s failed", seq.request_id)
            if self.handing_off.get(seq.request_id) is seq:
                self.fail(seq, "handler_failed", f"the KV hand-off failed: {type(exc).__name__}: {exc}", 500)
        else:
            if self.handing_off.get(seq.request_id) is seq:  # else voided meanwhile (retired there)
                self.retire(seq)
        finally:
            if self.handing_off.get(seq.request_id) is seq:
                del self.handing_off[seq.request_id]
            seq.kv = None
            self.wake.set()

    async def ship_kv(self, seq: Sequence) -> None:
        """Send the KV; a failure at the connection level (refused, reset, closed, no answer) is
        tried again with capped backoff while the decode worker's liveness is undecided, until
        ``kv_wait``. PeerGone once it is decided dead; TransferError for a refusal by a live one."""
        deadline, delay = time.monotonic() + self.config.kv_wait_s, RETRY_FIRST_S
        while True:
            try:
                endpoint, secret = await self.wait_for_reservation(seq)
                return await self.watched(seq, self.send_kv(seq, endpoint, secret))
            except Unreachable as exc:
                problem: Exception = exc
            except Exception as exc:
                if not is_transient(exc):  # Redis refusing for now: the same as no answer
                    raise
                problem = exc
            await self.still_undecided(seq, problem, deadline)
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)

    async def send_kv(self, seq: Sequence, endpoint: str, secret: str) -> None:
        await self.links.ensure(seq.task.peer, endpoint)
        meta = {"output_token_ids": seq.output_ids, "next_seq": self.writer.next_seq(seq.request_id)}
        with metrics.KV_TRANSFER.time():
            payload = await self.engine.export_kv(seq)
            self.check_still_mine(seq)  # a worker back from a stop must not ship a moved request
            await self.links.client.send(endpoint, seq.request_id, meta, payload, secret)
        metrics.KV_TRANSFER_BYTES.inc(len(payload))

    def check_still_mine(self, seq: Sequence) -> None:
        if self.handing_off.get(seq.request_id) is not seq:
            raise Abandoned(seq.request_id)
        if self.lapsed():
            raise Unreachable("this worker's own lease lapsed: it sends nothing until it has rejoined")

    async def watched(self, seq: Sequence, work: Awaitable[None]) -> None:
        """Run ``work`` (a connect and send) while checking that the decode worker lives: a
        hung one holds the connection open without answering, and the transfer would otherwise
        wait its whole timeout (10 s) after the reaper has moved the request."""
        task = asyncio.ensure_future(work)
        try:
            while not (await asyncio.wait({task}, timeout=LIVENESS_POLL_S))[0]:
                gone = await self.peer_gone(seq)
                if gone:
                    raise PeerGone(gone)
            return task.result()
        finally:
            await cancel_and_wait({task})

    async def still_undecided(self, seq: Sequence, exc: Exception, deadline: float) -> None:
        """After a failed attempt: PeerGone if the decode worker is decided gone; TransferError
        past the deadline (it holds its lease but takes no connection); else back to retrying."""
        if self.handing_off.get(seq.request_id) is not seq:
            raise Abandoned(seq.request_id)
        if seq.request_id in self.recently_cancelled:
            raise TransferError("the request was cancelled")
        gone = await self.peer_gone(seq)
        if gone:
            raise PeerGone(gone)
        if time.monotonic() > deadline:
            waited = f"retried for {self.config.kv_wait_s:.0f}s"
            raise TransferError(f"{exc}; {seq.task.peer} still holds its lease, {waited}")
        log.info(
            "hand-off of %s to %s failed (%s); retrying while its liveness is undecided",
            seq.request_id,
            seq.task.peer,
            exc,
        )

    async def peer_gone(self, seq: Sequence) -> str | None:
        """Why the request's decode side is decided gone, or None while undecided: a reaper
        marked the decode worker dead, or dispatched the request again (a worker back from a
        stop has its lease and record again, but the request's current dispatch is not this
        task's). An expired lease alone is not enough: until a reaper takes the worker, it may
        come back and keep its tasks (docs/reliability.md). Redis refusing: undecided."""
        with transient_suppressed("checking a decode worker's liveness"):
            pipe = self.redis.pipeline(transaction=False)
            pipe.hget(self.keys.worker(seq.task.peer), "state")
            pipe.get(self.keys.current(seq.request_id))
            state, current = await pipe.execute()
            if state == b"dead":
                return f"decode worker {seq.task.peer} is dead (reaped)"
            return self.dispatched_again(seq, current)
        return None

    def dispatched_again(self, seq: Sequence, current: bytes | None) -> str | None:
        """Why this task is void, given its request's current hand-off id: a reaper moved the
        request to another pair. (No id: a task from before hand-off ids, or a current id that
        outlived its TTL; nothing newer is known.)"""
        if seq.task.handoff and current is not None and current != seq.task.handoff.encode():
            return f"{seq.request_id} was dispatched again (the reaper moved it off {seq.task.peer} or this worker)"
        return None

    async def transfer_failed(self, seq: Sequence, exc: Exception) -> None:
        """A failure not about the decode worker's death (a refusal by a live one, a bad
        reservation, the kv wait deadline) ends the request with an error, and cancels it;
        unless the request belongs to a newer dispatch now (its error and cancel would end that
        one): then P only lets go."""
        if await self.superseded(seq):
            log.warning("hand-off of %s failed (%s), but it was dispatched again; leaving it", seq.request_id, exc)
            self.retire(seq)
            return
        self.fail(seq, "kv_transfer_failed", f"could not hand the KV cache to {seq.task.peer}: {exc}", 503)
        self.cancel_peer(seq, "kv_transfer_failed")

    async def wait_for_reservation(self, seq: Sequence) -> tuple[str, str]:
        """D's transfer endpoint and the reservation's secret, once D has reserved blocks.

        The endpoint is the one in D's own registry record, never one read from ``sb:kv``
        alone: a reservation naming another endpoint (forged, or a stale one) would have P send
        the request's KV to whoever listens there, so it is not taken; P waits on for D's own
        until ``kv_wait``, then fails the request saying why."""
        deadline = time.monotonic() + self.config.kv_wait_s
        delay, mismatch = 0.002, ""
        while time.monotonic() < deadline:
            reservation, registered, peer_alive, current = await self._read_reservation(seq)
            # Only the reservation of this task's own dispatch: a request moved (off a dead
            # decode worker, or a dead prefill worker) still finds the older dispatch's one
            # here until its decode worker replaces it, and its secret is not this task's.
            if reservation is not None and self.reserved_for(seq, reservation) and reservation.secret:
                endpoint, secret = reservation.endpoint, reservation.secret
                if endpoint and endpoint == registered:
                    log.debug("found %s's reservation for %s; sending to %s", seq.task.peer, seq.request_id, endpoint)
                    return registered, secret
                mismatch = mismatch or self._endpoint_mismatch(seq, endpoint, registered)
            gone = self.dispatched_again(seq, current) or (None if peer_alive else await self.peer_gone(seq))
            if gone:
                raise PeerGone(gone)
            if seq.request_id in self.recently_cancelled:
                raise TransferError("the request was cancelled")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)
        waited = f"decode worker {seq.task.peer} reserved no KV blocks within {self.config.kv_wait_s:.0f}s"
        raise TransferError(mismatch or waited)

    async def superseded(self, seq: Sequence) -> bool:
        """Whether the request now belongs to another dispatch: ``sb:current`` names another, or
        D's reservation was made for another (D took the newer task first). A reservation gone
        proves nothing (D may have given up on it); Redis refusing: not known, so no."""
        with transient_suppressed("reading a KV reservation"):
            reservation, _, _, current = await self._read_reservation(seq)
            handoff = reservation.handoff if reservation is not None else ""
            return bool(self.dispatched_again(seq, current)) or bool(handoff and handoff != seq.task.handoff)
        return False

    def reserved_for(self, seq: Sequence, reservation: Reservation) -> bool:
        """Whether a reservation's (decode_worker, prefill_worker, handoff) are this task's."""
        return reservation.made_for(seq.task.peer, self.id, seq.task.handoff)

    async def _read_reservation(self, seq: Sequence) -> tuple[Reservation | None, str, bool, bytes | None]:
        """(sb:kv's reservation, if a valid one; D's registered endpoint; whether D is alive;
        the request's current hand-off id), in one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        self.reservations.queue_read(pipe, seq.request_id)
        pipe.hget(self.keys.worker(seq.task.peer), "transfer_endpoint")
        pipe.exists(self.keys.lease(seq.task.peer))
        pipe.get(self.keys.current(seq.request_id))
        reservation, registered, peer_alive, current = await pipe.execute()
        endpoint = (registered or b"").decode(errors="replace")
        return self.reservations.parse(seq.request_id, reservation), endpoint, bool(peer_alive), current

    def _endpoint_mismatch(self, seq: Sequence, endpoint: str, registered: str) -> str:
        why = (
            f"the KV reservation for {seq.request_id} names endpoint {endpoint!r}, not {registered!r} from "
            f"{seq.task.peer}'s registry record; nothing was sent there"
        )
        log.warning("%s (forged or stale reservation); waiting for %s's own", why, seq.task.peer)
        return why

    def admit_kv(self, sender: str, header: Header) -> str | None:
        """Transfer-server check on D, before the frame's payload is read. A frame not from the
        task's P, or without the proof of the reservation's secret, is refused and changes
        nothing: the reservation waits for the real P (a stranger must not be able to fail
        someone else's request). A proven frame that is larger than the reserved blocks or
        whose meta P could not have sent fails the request, freeing its blocks."""
        entry = self.awaiting_kv.get(header.ident)
        if entry is None:
            return f"decode worker {self.id} holds no reservation for {header.ident}"
        seq = entry[0]
        if sender != seq.task.peer or not proof_matches(seq.kv_secret, sender, header):
            log.warning(
                "refused a KV frame for %s from %r: not from %s with the reservation's secret",
                header.ident,
                sender,
                seq.task.peer,
            )
            return f"{header.ident}: not from its prefill worker with the reservation's secret"
        problem = self.kv_problem(seq, header)
        if problem is not None:
            del self.awaiting_kv[header.ident]
            self.fail(seq, "kv_rejected", f"the KV frame from {sender} was refused: {problem}", 500)
            self.wake.set()
        return problem

    def kv_problem(self, seq: Sequence, header: Header) -> str | None:
        capacity = self.engine.kv_capacity(seq)
        if header.size > capacity:
            return f"a KV payload of {header.size} bytes is more than the {capacity} bytes reserved"
        return meta_problem(seq.task, header.meta, self.engine.vocab_size)

    async def import_kv(self, sender: str, header: Header, payload: bytes) -> str | None:
        """Transfer-server callback on D, once the payload is in: take the cache and the tokens
        P generated."""
        # Checked again: while the payload came, the request may have been cancelled, or moved
        # here again under a new task and secret.
        refusal = self.admit_kv(sender, header)
        if refusal is not None:
            return refusal
        seq = self.awaiting_kv.pop(header.ident)[0]
        error = await self.engine.import_kv(seq, payload)
        if error:
            self.fail(seq, "kv_import_failed", error, 500)
            return error
        seq.output_ids = list(header.meta["output_token_ids"])
        seq.text.push(seq.output_ids)  # replay: the same text state P had
        self.writer.open(seq.request_id, first_seq=header.meta["next_seq"])
        self.running.append(seq)
        self.wake.set()
        return None

    def cancel_peer(self, seq: Sequence, reason: str) -> None:
        self.spawn(publish_cancel(self.redis, self.config.bus, seq.request_id, reason))

    # ------------------------------------------------------------ cancellation and deadlines

    def drop(self, request_id: str) -> None:
        """Forget a cancelled request wherever it is here, freeing its blocks."""
        self.recently_cancelled[request_id] = time.monotonic()
        while len(self.recently_cancelled) > RECENT_CANCELS:
            self.recently_cancelled.pop(next(iter(self.recently_cancelled)))
        seq = self._remove(request_id)
        if seq is not None:
            log.info("dropped cancelled request %s", request_id)
            self.retire(seq)
            self.wake.set()

    def drop_task(self, entry_id: str) -> None:
        """Forget one task (its request moved to other workers), freeing its blocks."""
        for request_id, (seq, _) in list(self.awaiting_kv.items()):
            if seq.entry_id == entry_id:
                del self.awaiting_kv[request_id]
                self.retire(seq)
                self.wake.set()

    def _remove(self, request_id: str) -> Sequence | None:
        for seq in list(self.queued):
            if seq.request_id == request_id:
                self.queued.remove(seq)
                return seq
        for seq in self.running:
            if seq.request_id == request_id:
                self.running.remove(seq)
                return seq
        entry = self.awaiting_kv.pop(request_id, None)
        return entry[0] if entry else None

    def expire_deadlines(self) -> None:
        """Past its deadline a request ends here with an error, freeing its blocks, whether or
        not its API node is still there to cancel it."""
        now_ms = time.time() * 1000
        held = [*self.queued, *self.running, *(entry[0] for entry in self.awaiting_kv.values())]
        for seq in [s for s in held if s.request.deadline_ms and now_ms > s.request.deadline_ms]:
            self._remove(seq.request_id)
            self.fail(seq, "deadline", "the request's deadline passed before it finished", 504)

    def expire_waits(self) -> None:
        self.expire_deadlines()
        now = time.monotonic()
        for request_id, (seq, deadline) in list(self.awaiting_kv.items()):
            if now > deadline:
                del self.awaiting_kv[request_id]
                self.spawn(self._expire(seq))

    async def _expire(self, seq: Sequence) -> None:
        """No KV came: fail the request, unless it was dispatched again (its new workers answer).
        A task from before hand-off ids: unless the reaper ever moved it."""
        with transient_suppressed("checking for a moved request"):
            if seq.task.handoff:
                moved = self.dispatched_again(seq, await self.redis.get(self.keys.current(seq.request_id)))
            else:
                moved = bool(await self.redis.exists(self.keys.moved(seq.request_id)))
            if moved:
                self.retire(seq)
                return
        self.fail(
            seq,
            "kv_transfer_timeout",
            f"no KV cache arrived from {seq.task.peer} within {self.config.kv_wait_s:.0f}s",
            503,
        )
        self.wake.set()


def _entry_order(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _add(a: Reserved, b: Reserved) -> Reserved:
    return Reserved(
        a.reserved_prefill_tokens + b.reserved_prefill_tokens,
        a.reserved_requests + b.reserved_requests,
        a.reserved_kv_blocks + b.reserved_kv_blocks,
    )
