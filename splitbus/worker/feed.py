"""The task feed, a bus edge: take tasks from this worker's stream while there is room, each
once, whatever happened to the read that brought it; check each one, reserve its blocks, and
give the scheduler back what it reserved for it. Also what a worker back from a lapsed lease
drops: the tasks a reaper took while it was out."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable

from splitbus.bus.core.connection import is_transient
from splitbus.bus.core.streams import Delivery, GroupConsumer, entry_order
from splitbus.bus.dispatch import blocks_needed
from splitbus.bus.messages import GenerateRequest, Task
from splitbus.bus.registry import Registry, Reserved, WorkerLoad
from splitbus.bus.tasks import missing_entries, trim_tasks
from splitbus.tokenization import ModelTokenizer
from splitbus.worker import metrics
from splitbus.worker.cancellation import Cancellation
from splitbus.worker.publisher import Publisher
from splitbus.worker.receiver import Receiver
from splitbus.worker.requests import HELD, Status
from splitbus.worker.sequence import Sequence, kv_tokens
from splitbus.worker.shared import Shared
from splitbus.worker.text import TextStream

log = logging.getLogger(__name__)
TRIM_EVERY_S = 5.0
SEEN_KEPT = 10_000
"""How many task entries taken lately are remembered (a lost one found again is not taken twice)."""


class TaskFeed:
    """``feed_tasks``, ``find_lost_tasks`` and ``trim_tasks`` are loop steps; ``work_arrived``
    is called once tasks were taken (the stepper's: a DP rank wakes its group), ``load`` gives
    the load reported with the reservations given back."""

    def __init__(
        self,
        shared: Shared,
        tokenizer: ModelTokenizer,
        tasks: GroupConsumer,
        registry: Registry,
        publisher: Publisher,
        cancellation: Cancellation,
        receiver: Receiver,
        *,
        work_arrived: Callable[[], Awaitable[None]],
        load: Callable[[], WorkerLoad],
    ) -> None:
        self.config, self.id, self.redis, self.keys = shared.config, shared.id, shared.redis, shared.config.bus.keys
        self.table, self.engine, self.wake, self.room = shared.table, shared.engine, shared.wake, shared.room
        self.tokenizer, self.tasks, self.registry = tokenizer, tasks, registry
        self.publisher, self.cancellation, self.receiver = publisher, cancellation, receiver
        self.work_arrived, self.load = work_arrived, load
        self.unreturned = Reserved()  # reservations of tasks taken, not given back yet
        self.unaccepted: deque[Delivery] = deque()  # tasks read, not taken yet
        self.reread_pending = False  # a task read failed: its reply may have held tasks (take_lost)
        self.seen_entries: dict[str, None] = {}  # task entries taken lately, oldest first (bounded)
        self.after_new_run = False
        """Redis has a new server run whose recovery is not done (``recovery``): a held task's
        entry missing from the stream was lost with the run, not moved by a reaper."""

    async def drop_moved(self) -> None:
        """Drop every task the reaper took: those no longer pending to this worker. In place: a
        read still in flight adds what it brings to this same backlog (a task written while the
        reaper worked is this worker's)."""
        before = self.known_entries()  # what arrives while XPENDING is on its way is this worker's
        mine = await self.tasks.pending_ids()
        kept = [d for d in self.unaccepted if d.entry_id in mine or d.entry_id not in before]
        self.unaccepted.clear()
        self.unaccepted.extend(kept)
        held = self.table.of()
        moved = [seq for seq in held if seq.entry_id not in mine and seq.entry_id in before]
        if self.after_new_run:  # a moved task's entry is still in the stream (claimed, or acked)
            lost = await missing_entries(self.redis, self.keys, self.id, [seq.entry_id for seq in moved])
            moved = [seq for seq in moved if seq.entry_id not in lost]
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
            lost = sorted(await self.tasks.pending_ids(min_idle_ms) - self.known_entries(), key=entry_order)
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
        held = {s.entry_id for s in self.table.of()}
        return (
            held
            | {d.entry_id for d in self.unaccepted}
            | set(self.publisher.done_entries)
            | set(self.seen_entries)
            | self.tasks.unsent_letters()
        )

    def saw(self, entry_id: str) -> None:
        self.seen_entries[entry_id] = None
        while len(self.seen_entries) > SEEN_KEPT:
            del self.seen_entries[next(iter(self.seen_entries))]

    def moved_away(self, seq: Sequence) -> None:
        """Forget a request the reaper moved: free its blocks, write nothing more for it. One
        being imported only leaves the table: the engine still writes its blocks, and the import
        lets the task go when it ends."""
        importing = self.table.holds(seq, Status.IMPORTING)
        self.table.remove(seq)
        self.wake.set()
        if not importing:
            self.publisher.retire(seq)
            self.publisher.writer.discard(seq.request_id)

    def held(self) -> int:
        return self.table.count(*HELD)

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
        while self.unaccepted and self.kv_room_for(self.unaccepted[0]):
            await self.accept_safely(self.unaccepted.popleft())
        await self.work_arrived()
        # The engine loop starts on them first (the next turn of the loop is its), then the
        # reservations go back while it runs: a first token does not wait for that write.
        await asyncio.sleep(0)
        await self.give_back_reservations()
        if self.unaccepted:  # no KV blocks for the next one yet: it waits, read, until a request leaves
            self.room.clear()
            await self.room.wait()

    def kv_room_for(self, delivery: Delivery) -> bool:
        """Whether the engine has KV blocks for a decode task now (it takes them as it is taken,
        for its KV to arrive in), or never will (it holds nothing that could free them: the task
        is taken and fails). One without room waits, not taken (its scheduler's reservation still
        counted), until a request leaves this worker: a burst that outran the registry view waits
        for blocks instead of failing. Other tasks take their blocks when their prefill starts."""
        task = delivery.message
        if not isinstance(task, Task) or task.phase != "decode" or not self.held():
            return True
        return self.engine.can_reserve(task, kv_tokens(task))

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
        seq = Sequence(task, delivery.entry_id, TextStream.for_request(self.tokenizer, task.request.sampling))
        log.debug(
            "took task %s: %s of %s, peer %s, hand-off %s",
            delivery.entry_id,
            task.phase,
            task.request.request_id,
            task.peer or "-",
            task.handoff or "-",
        )
        if task.request.request_id in self.cancellation:
            self.publisher.ack_later(delivery.entry_id)
            return
        if self.holds_dispatch(task):
            # A copy its peer sent again after a new Redis run (``recovery``): the task is held
            # already, its hand-off under way; taking the copy would void it.
            log.info(
                "task %s: a copy of the held task of %s (hand-off %s); acked",
                delivery.entry_id,
                seq.request_id,
                task.handoff,
            )
            self.publisher.ack_later(delivery.entry_id)
            return
        for older in [s for s in self.table.of() if s.request_id == seq.request_id]:
            self.moved_away(older)  # the request moved here again (its other worker died): its older task is void
        if task.phase == "decode":
            if self.take_blocks(seq):
                await self.receiver.expect(seq)
        else:
            self.queue(seq)

    def queue(self, seq: Sequence) -> None:
        """A task that prefills joins the queue, without blocks: they are taken when its prefill
        starts (``EngineSteps.allocate``), so a queue does not evict the prefix cache its
        requests will want, and each finds what its siblings stored meanwhile."""
        task = seq.task
        self.publisher.writer.open(seq.request_id, reader=task.request.reader, first_seq=task.first_seq)
        seq.output_ids = list(task.output_token_ids)
        seq.text.push(seq.output_ids)
        if self.fits(seq):
            seq.prompt_cached = self.engine.cached_prefix(task)
            self.table.add(seq, Status.QUEUED)

    def holds_dispatch(self, task: Task) -> bool:
        """Whether this worker holds the request's task of this very dispatch and phase (a new
        dispatch has a new hand-off id)."""
        held = self.table.get(task.request.request_id)
        return (
            bool(task.handoff)
            and held is not None
            and (held.task.handoff, held.task.phase)
            == (
                task.handoff,
                task.phase,
            )
        )

    def fits(self, seq: Sequence) -> bool:
        """Whether the request would fit this worker's KV cache, were it empty; if not it fails."""
        tokens, room = kv_tokens(seq.task), self.engine.total_blocks * self.config.block_size
        if tokens <= room:
            return True
        message = f"worker {self.id} has {self.engine.total_blocks} KV blocks in all, not enough for {tokens} tokens"
        self.publisher.fail(seq, "out_of_kv_blocks", message, 503)
        return False

    def check_reservation(self, task: Task) -> str | None:
        """Why the task's ``reserved`` cannot be given back, or None. A scheduler reserves at
        most the task's prompt tokens (phases that prefill), one request and the KV blocks of
        prompt + max_tokens (phases that decode); a task claiming more was not written by one,
        and giving its numbers back would drive this worker's counters negative."""
        tokens, blocks = len(task.request.prompt_token_ids), blocks_needed(task.request, self.config.block_size)
        bound = {"prefill": (tokens, 0, 0), "decode": (0, 1, blocks), "mixed": (tokens, 1, blocks)}[task.phase]
        if all(r <= b for r, b in zip(task.reserved, bound, strict=False)):
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
        request = getattr(delivery.message, "request", None)
        if isinstance(request, GenerateRequest):
            self.fail_request(request.request_id, f"{code}: {reason}", reader=request.reader)

    def fail_request(self, request_id: str, reason: str, *, reader: str) -> None:
        """End a request whose task was dead-lettered with an error entry, so its client is not
        left waiting for its deadline; not one this worker still holds (that one answers)."""
        if self.table.get(request_id, *HELD) is not None:
            return
        code = reason.split(":", 1)[0]
        self.publisher.writer.fail(
            request_id, code, f"worker {self.id} could not handle this request's task: {reason}", 500, reader=reader
        )
        metrics.REQUESTS_FINISHED.labels(code).inc()
        self.publisher.soon()

    def take_blocks(self, seq: Sequence) -> bool:
        """KV room for the request: its prompt on a prefill worker, prompt + max_tokens where
        it decodes."""
        tokens = kv_tokens(seq.task)
        if not self.engine.reserve(seq, tokens):
            free = self.engine.free_blocks
            self.publisher.fail(
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
        await trim_tasks(self.redis, self.keys, self.id)


def _add(a: Reserved, b: Reserved) -> Reserved:
    return Reserved(
        a.reserved_prefill_tokens + b.reserved_prefill_tokens,
        a.reserved_requests + b.reserved_requests,
        a.reserved_kv_blocks + b.reserved_kv_blocks,
    )
