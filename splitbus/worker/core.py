"""The worker's core: its requests and its engine, and every rule about them, without I/O.

``WorkerCore`` owns the request table (``splitbus.worker.table``) and the engine's KV blocks.
It takes decoded tasks (``admit``) and KV arrivals (``admit_kv``, ``start_import``,
``end_import``), plans a step and takes its results, as nano-vllm's ``step()`` does (schedule ->
run -> postprocess), and says what must happen as plain data: a list of effects
(``splitbus.worker.effects``) that the shell applies: result entries to buffer, tasks to ack,
KV to ship, cancels to send.

How a step runs: the engine interface is async (an engine call takes a step's time), so the
core does not call it. ``plan_prefill``/``plan_decode`` pick the batch (synchronous), the shell
awaits the engine call on it (``splitbus.worker.steps``), and ``end_prefill``/``end_decode``
take the tokens (synchronous). Between the two, the shell's other loops may change the table
(a cancel, a move, an import): each postprocess writes only for what is still where the plan
left it. A DP rank runs the same plan/run/postprocess; the barrier around it is the shell's
(``splitbus.worker.dp``). Every method is called from the one event loop and returns before
anything else runs, so no rule sees the table half-changed.

The core reads two clocks (``clock``: monotonic, for kv waits; ``wall``: for deadlines) that a
test may replace. What it logs is what happened to a request, as the rooms it replaces did.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from splitbus.bus.messages import Task
from splitbus.bus.messages._check import PRIORITY_RANGE, traceparent_problem
from splitbus.bus.records import Reservation, Reserved, WorkerLoad, blocks_needed
from splitbus.bus.roles import Phase
from splitbus.grammar.outcomes import GrammarError
from splitbus.tokenization import ModelTokenizer
from splitbus.worker.effects import (
    Ack,
    CancelPeer,
    DeadLetter,
    Discard,
    DropReservation,
    Effect,
    Emit,
    Fail,
    Finish,
    Forget,
    Left,
    Open,
    ShipKv,
    Wake,
)
from splitbus.worker.engines.interface import Engine, ExpertParallel, ForksTwins
from splitbus.worker.kv_proof import Header, new_secret, proof_matches
from splitbus.worker.sequence import Sequence, kv_tokens
from splitbus.worker.table import DROPPABLE, HELD, RequestTable, Status
from splitbus.worker.text import TextStream
from splitbus.worker.twins import NO_FORKS, Forks, Gathering

log = logging.getLogger(__name__)
RECENT_CANCELS = 10_000
"""How many cancelled request ids are remembered (a task of one that comes later is dropped)."""
COUNTERS = (
    "prefills_done",
    "prefills_shared",
    "decodes_done",
    "steps",
    "idle_forwards",
    "step_time_us",
    "idle_time_us",
    "busy_time_us",
    "idle_forward_us",
    "forward_ends_ms",
    "dp_epoch",
    "prompt_tokens_done",
    "prompt_tokens_cached",
    "prefill_busy_us",
    "decode_tokens_done",
    "decode_steps",
    "decode_time_us",
)
"""What the worker's load report carries from its steps: counters, and two DP values a rank sets
(``forward_ends_ms``, ``dp_epoch``; see ``WorkerLoad``)."""
RESERVABLE = {Phase.PREFILL: (1, 0, 0), Phase.DECODE: (0, 1, 1), Phase.MIXED: (1, 1, 1)}
"""Which of (prompt tokens, one request, KV blocks) a scheduler reserves for a task of each phase."""


@dataclass(frozen=True)
class Limits:
    """What the core checks tasks against (from the worker's ``WorkerConfig``)."""

    worker_id: str
    model_name: str
    block_size: int = 16
    max_prefill_tokens: int = 4096
    """Prompt tokens in one prefill batch."""
    kv_wait_s: float = 30.0
    """How long a decode task waits for its KV before it fails."""


@dataclass(frozen=True)
class Admission:
    """What taking one task entry came to."""

    effects: list[Effect] = field(default_factory=list)
    reserved: Reserved | None = None
    """The scheduler's reservation for the task, to give back (None: it claimed more than a
    scheduler reserves, and is not given back)."""
    rejected: tuple[str, str] | None = None
    """(code, reason): the task is dead-lettered and its request failed (``fail_unheld``)."""
    awaiting_kv: Sequence | None = None
    """A decode task holding its blocks, AWAITING_KV: its reservation goes to ``sb:kv``."""


class HandOffEnd(enum.Enum):
    """How shipping a prefilled request's KV to its decode worker ended (``splitbus.worker.handoff``)."""

    SHIPPED = "shipped"
    """The decode worker has the cache."""
    PEER_GONE = "peer_gone"
    """The decode worker is decided gone (reaped, or the request dispatched again): the request is the reaper's."""
    REFUSED = "refused"
    """Not about the decode worker's death: a refusal by a live one, a bad reservation, the kv wait deadline."""
    BROKEN = "broken"
    """The hand-off raised (a bug)."""


class AdmissionFailed(Exception):
    """Taking a task raised (an engine's bug) after the core had changed what it holds:
    ``so_far`` still goes through (the reservation given back, a void older task's effects),
    then ``cause`` fails the task alone, as any error while taking one does."""

    def __init__(self, so_far: Admission, cause: Exception) -> None:
        super().__init__(str(cause))
        self.so_far, self.cause = so_far, cause


class WorkerCore:
    """The request table and the engine's blocks, and the rules that change them. Each method
    says who calls it; each returns the effects of what it did, in order."""

    def __init__(self, limits: Limits, engine: Engine, tokenizer: ModelTokenizer) -> None:
        self.limits, self.engine, self.tokenizer = limits, engine, tokenizer
        self.table = RequestTable()
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.kv_blocked = False
        """The last prefill plan found requests queued but no blocks to prefill any of them into."""
        self.cancelled: dict[str, float] = {}  # request ids cancelled lately, oldest first (bounded)
        self.endpoint = ""
        """This worker's KV endpoint (set by the shell once its transfer server listens)."""
        self.clock: Callable[[], float] = time.monotonic
        self.wall: Callable[[], float] = time.time
        self.fork = engine.fork if isinstance(engine, ForksTwins) else None
        """How the engine forks a twin from its leader (None: it does not; each prefills alone)."""
        self.gathering = Gathering()
        """When each response's first twin came here (``splitbus.worker.twins``)."""
        self.draining = False
        """Set once the worker drains (``Worker.drain``): every load it reports from then on says
        so, and schedulers place nothing more on it."""

    @property
    def id(self) -> str:
        return self.limits.worker_id

    # ------------------------------------------------------------ load

    def load(self) -> WorkerLoad:
        table = self.table
        return WorkerLoad(
            running=table.count(Status.RUNNING, Status.HANDING_OFF),
            waiting=table.count(Status.QUEUED, Status.AWAITING_KV),
            queued_prefill_tokens=sum(
                len(s.all_tokens) - max(s.cached, s.prompt_cached) for s in table.of(Status.QUEUED)
            ),
            free_kv_blocks=self.engine.free_blocks,
            total_kv_blocks=self.engine.total_blocks,
            **self.counters,
            first_queued_priority=first_priority(table.next_prefill()),
            draining=int(self.draining),
            experts=self.engine.expert_load() if isinstance(self.engine, ExpertParallel) else None,
        )

    def held(self) -> int:
        """Requests that count against ``max_requests``."""
        return self.table.count(*HELD)

    def has_work(self) -> bool:
        """Whether a step would do something: requests RUNNING, or QUEUED with blocks to take."""
        table = self.table
        return bool(table.count(Status.RUNNING)) or (bool(table.count(Status.QUEUED)) and not self.kv_blocked)

    # ------------------------------------------------------------ tasks

    def admit(self, entry_id: str, task: object) -> Admission:
        """Take one decoded task entry (called by the task feed for each task it reads, once).
        A task that is not one, claims more than a scheduler reserves, or that this worker
        cannot run is rejected; one of a request cancelled lately, or a copy of a held task's
        own dispatch, is acked; else it is queued to prefill or, a decode task, takes its blocks
        and waits for its KV."""
        if not isinstance(task, Task):
            return Admission(rejected=("handler_failed", f"a {type(task).__name__} entry is not a task"))
        overdrawn = self.check_reservation(task)
        reserved = Reserved(*task.reserved) if overdrawn is None else None
        problem = overdrawn or self.check_task(task)
        if problem is not None:
            return Admission(reserved=reserved, rejected=("invalid_task", problem))
        log.debug(
            "took task %s: %s of %s, peer %s, hand-off %s",
            entry_id,
            task.phase,
            task.request.request_id,
            task.peer or "-",
            task.handoff or "-",
        )
        if task.request.request_id in self.cancelled or self.holds_dispatch(task, entry_id):
            return Admission([Ack(entry_id)], reserved)
        effects: list[Effect] = []
        try:
            return self.take(entry_id, task, reserved, effects)
        except Exception as exc:
            raise AdmissionFailed(Admission(effects, reserved), exc) from exc

    def take(self, entry_id: str, task: Task, reserved: Reserved | None, effects: list[Effect]) -> Admission:
        """A task this worker runs: its request's older task here is void (the request moved
        here again, its other worker died); queued to prefill, or a decode task with its blocks.
        ``effects`` gathers what it did so far (the caller's, should this raise)."""
        for older in [s for s in self.table.of() if s.request_id == task.request.request_id]:
            effects += self.moved_away(older)
        text = TextStream.for_request(self.tokenizer, task.request.sampling)
        seq = Sequence(task, entry_id, text, queued_at=self.clock())
        problem = self.constrain(seq)
        if problem is not None:
            return Admission([*effects, *self.fail(seq, "invalid_grammar", problem, 400)], reserved)
        if task.phase != Phase.DECODE:
            self.queue(seq, effects)
            return Admission(effects, reserved)
        if not self.take_blocks(seq, effects):
            return Admission(effects, reserved)
        return Admission(effects, reserved, awaiting_kv=self.await_kv(seq))

    def constrain(self, seq: Sequence) -> str | None:
        """Build the request's grammar (structured output), given the tokens its task already
        has; why it does not build or they break it, or None. The grammar came over the bus:
        one that is bad fails its request alone."""
        if seq.request.sampling.grammar is None:
            return None
        # Here, not at the top: llguidance loads socket (importlib.metadata), and the core loads no I/O module.
        from splitbus.grammar.constraint import Constraint
        from splitbus.grammar.tokenizer import grammar_tokenizer

        try:
            seq.grammar = Constraint.build(grammar_tokenizer(self.tokenizer), seq.request.sampling.grammar)
            seq.grammar.follow(seq.task.output_token_ids)
        except GrammarError as exc:
            return str(exc)
        return None

    def check_reservation(self, task: Task) -> str | None:
        """Why the task's ``reserved`` cannot be given back, or None. A scheduler reserves at
        most the task's prompt tokens (phases that prefill), one request and the KV blocks of
        prompt + max_tokens (phases that decode); a task claiming more was not written by one,
        and giving its numbers back would drive this worker's counters negative."""
        most = (len(task.request.prompt_token_ids), 1, blocks_needed(task.request, self.limits.block_size))
        bound = tuple(n * used for n, used in zip(most, RESERVABLE[Phase(task.phase)], strict=True))
        if all(r <= b for r, b in zip(task.reserved, bound, strict=False)):
            return None
        return f"reserved {task.reserved} exceeds what a {task.phase} task of this request can reserve, {list(bound)}"

    def check_task(self, task: Task) -> str | None:
        """Why this worker cannot run the task, or None: its tokens must be in this model's
        vocabulary (the tokenizer raises on ids it does not know) and fit its context."""
        request, vocab = task.request, self.tokenizer.vocab_size
        if request.model != self.limits.model_name:
            return f"the task is for model {request.model!r}; this worker serves {self.limits.model_name!r}"
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

    def holds_dispatch(self, task: Task, entry_id: str) -> bool:
        """Whether this worker holds the request's task of this very dispatch and phase (a new
        dispatch has a new hand-off id): a copy its peer sent again after a new Redis run
        (``recovery``), its hand-off under way; taking the copy would void it."""
        held = self.table.get(task.request.request_id)
        if not task.handoff or held is None or (held.task.handoff, held.task.phase) != (task.handoff, task.phase):
            return False
        log.info("task %s: a copy of the held task of %s (hand-off %s); acked", entry_id, held.request_id, task.handoff)
        return True

    def kv_room_for(self, task: object) -> bool:
        """Whether the engine has KV blocks for a decode task now (it takes them as it is taken,
        for its KV to arrive in), or never will (it holds nothing that could free them: the task
        is taken and fails). One without room waits, not taken (its scheduler's reservation still
        counted), until a request leaves this worker: a burst that outran the registry view waits
        for blocks instead of failing. Other tasks take their blocks when their prefill starts."""
        if not isinstance(task, Task) or task.phase != Phase.DECODE or not self.held():
            return True
        return self.engine.can_reserve(task, kv_tokens(task))

    def queue(self, seq: Sequence, effects: list[Effect]) -> None:
        """A task that prefills joins the queue, without blocks: they are taken when its prefill
        starts (``plan_prefill``), so a queue does not evict the prefix cache its requests will
        want, and each finds what its siblings stored meanwhile. One that would not fit the
        whole cache fails. Its effects are added to ``effects``."""
        task = seq.task
        effects.append(Open(seq.request_id, task.request.reader, task.first_seq))
        seq.output_ids = list(task.output_token_ids)
        seq.text.push(seq.output_ids)
        tokens, room = kv_tokens(task), self.engine.total_blocks * self.limits.block_size
        if tokens > room:
            total = self.engine.total_blocks
            message = f"worker {self.id} has {total} KV blocks in all, not enough for {tokens} tokens"
            effects += self.fail(seq, "out_of_kv_blocks", message, 503)
            return
        seq.prompt_cached = self.engine.cached_prefix(task)
        self.gathering.note(seq, self.clock())
        self.table.add(seq, Status.QUEUED)

    def take_blocks(self, seq: Sequence, effects: list[Effect]) -> bool:
        """KV room for a decode task's prompt + max_tokens; without it the request fails (its
        effects added to ``effects``)."""
        tokens = kv_tokens(seq.task)
        if self.engine.reserve(seq, tokens):
            return True
        message = f"worker {self.id} has {self.engine.free_blocks} free KV blocks, not enough for {tokens} tokens"
        effects += self.fail(seq, "out_of_kv_blocks", message, 503)
        return False

    def await_kv(self, seq: Sequence) -> Sequence:
        """A decode task with its blocks waits for its KV, until ``kv_wait_s``. The secret makes
        its reservation usable only by who can read it from Redis: P proves it in its KV frame,
        so knowing a request id (every client does) is not enough to send one."""
        seq.kv_secret = new_secret()
        self.table.add(seq, Status.AWAITING_KV, kv_deadline=self.clock() + self.limits.kv_wait_s)
        return seq

    def reservation_of(self, seq: Sequence) -> Reservation:
        """The reservation of a decode task that holds its blocks (``await_kv`` gave it its secret)."""
        return Reservation(
            decode_worker=self.id,
            endpoint=self.endpoint,
            blocks=seq.blocks,
            prefill_worker=seq.task.peer,
            task_entry=seq.entry_id,
            secret=seq.kv_secret,
            handoff=seq.task.handoff,
        )

    def void(self, seq: Sequence) -> list[Effect]:
        """The reaper replaced a decode task's dispatch before it came here (its reservation was
        refused): nobody will send its KV."""
        log.info("task %s of %s is void (the request was dispatched again); dropped", seq.entry_id, seq.request_id)
        return self.retire(seq) if self.table.remove(seq) else []

    def fail_unheld(self, request_id: str, reason: str, *, reader: str) -> list[Effect]:
        """End a request whose task was dead-lettered with an error entry, so its client is not
        left waiting for its deadline; not one this worker still holds (that one answers)."""
        if self.table.get(request_id, *HELD) is not None:
            return []
        message = f"worker {self.id} could not handle this request's task: {reason}"
        return [Fail(request_id, reason.split(":", 1)[0], message, 500, reader, warn=False)]

    # ------------------------------------------------------------ the step

    def plan_prefill(self) -> list[Sequence]:
        """The next prefill batch, now PREFILLING, each with its blocks (taken as its prefill
        starts, with the prefix cache's blocks of its prompt as they are then): by priority,
        then the oldest queued first (``RequestTable.prefill_queue``), up to
        ``max_prefill_tokens``; a response's choices once they are all here, the first computing
        the prompt for all (``splitbus.worker.twins``). Empty with requests queued: no blocks for
        the first (a request of a lower priority does not pass it), or choices still gathering
        (``kv_blocked``: the loop looks again shortly)."""
        batch = self.table.start_prefill(
            self.limits.max_prefill_tokens, self.engine.first_to_compute, self.engine.reserve, self.forks()
        )
        self.kv_blocked = not batch and bool(self.table.count(Status.QUEUED))
        return batch

    def forks(self) -> Forks:
        """The twins of the next prefill plan: which wait for the others, how to fork the rest."""
        if self.fork is None:
            return NO_FORKS
        return Forks(self.gathering.waiting(self.table.of(Status.QUEUED), self.clock()), self.fork)

    def prefill_batch_size(self) -> tuple[int, int]:
        """The requests and tokens of the next prefill batch, as ``plan_prefill`` would take them
        now (a DP rank announces how long its prefill will take)."""
        return self.table.prefill_batch_size(self.limits.max_prefill_tokens, self.forks())

    def look_for_blocks_again(self) -> None:
        """The engine loop waited a little after a plan found no blocks (``kv_blocked``): a
        hand-off, a cancel or an import may have freed some, so the next plan looks again."""
        self.kv_blocked = False

    def abort_prefill(self) -> None:
        """The engine call did not end (Redis refused after it, or the worker stops): the batch
        is QUEUED again, first in line within its priority, its blocks kept."""
        self.table.abort_prefill()

    def end_prefill(self, results: list[tuple[Sequence, int]]) -> list[Effect]:
        """The prefill's tokens: each request still PREFILLING (not moved away meanwhile) gets its
        first token and goes on: RUNNING here (mixed), to its decode worker (prefill: a
        hand-off), or finished at its first token."""
        still = self.table.end_prefill()
        effects: list[Effect] = []
        for seq, token in results:
            if any(s is seq for s in still):
                self.count_prompt(seq)
                effects.append(self.emit(seq, token))
                effects += self.after_prefill(seq)
        return effects

    def count_prompt(self, seq: Sequence) -> None:
        """Before its first token: the prompt just prefilled, and what of it was not computed here
        (a prefix cache's hits; all of it for a twin, whose leader's forward computed it)."""
        prompt = len(seq.all_tokens)
        self.counters["prompt_tokens_done"] += prompt
        self.counters["prompt_tokens_cached"] += prompt if seq.fork_of is not None else min(seq.prompt_cached, prompt)

    def after_prefill(self, seq: Sequence) -> list[Effect]:
        self.counters["prefills_done"] += 1
        self.counters["prefills_shared"] += seq.fork_of is not None  # its leader's forward drew its token
        if seq.task.phase == Phase.MIXED and not seq.finished:
            self.table.add(seq, Status.RUNNING)
            return []
        if seq.finished:  # done at its first token: D has nothing to decode
            ended = self.finish(seq)
            return (
                ended + [CancelPeer(seq.request_id, "finished_on_prefill")]
                if seq.task.phase == Phase.PREFILL
                else ended
            )
        self.table.add(seq, Status.HANDING_OFF)
        return [ShipKv(seq)]

    def plan_decode(self) -> list[Sequence]:
        """The RUNNING requests, a token each (a snapshot: the table may change during the call)."""
        return self.table.of(Status.RUNNING)

    def end_decode(self, results: list[tuple[Sequence, int]]) -> list[Effect]:
        """The decode's tokens, for the requests still RUNNING (those that left during the engine
        call, cancelled or moved, get none); the finished ones leave."""
        effects: list[Effect] = [
            self.emit(seq, token) for seq, token in results if self.table.holds(seq, Status.RUNNING)
        ]
        for seq in [s for s in self.table.of(Status.RUNNING) if s.finished]:
            self.table.remove(seq)
            self.counters["decodes_done"] += 1
            effects += self.finish(seq)
        return effects

    def poison_letter(self, seq: Sequence, exc: BaseException) -> DeadLetter:
        """The engine failed on this request alone (its batch failed, then it failed run alone,
        ``EngineSteps.run_engine``): it is poison, and its task is dead-lettered, first."""
        return DeadLetter(seq.entry_id, seq.task, f"engine_error: {exc}")

    def poisoned(self, seq: Sequence, exc: BaseException) -> list[Effect]:
        """A poisoned request, its dead letter written (``poison_letter``): it ends with an
        error, unless it left during the engine call (cancelled, moved)."""
        if not self.table.remove(seq):
            return []
        return self.fail(seq, "engine_error", f"the engine failed on this request: {exc}", 500)

    def emit(self, seq: Sequence, token_id: int) -> Emit:
        text = seq.add_token(token_id, self.engine.eos_token_ids)
        logprobs, prompt, seq.logprobs, seq.prompt_logprobs = seq.logprobs, seq.prompt_logprobs, None, None
        return Emit(seq.request_id, (token_id,), text, logprobs, prompt)

    # ------------------------------------------------------------ how a request leaves

    def finish(self, seq: Sequence) -> list[Effect]:
        reason, cached = seq.finish_reason or "stop", min(seq.prompt_cached, seq.prompt_len)
        done = Finish(seq.request_id, reason, seq.prompt_len, len(seq.output_ids), seq.text.flush(), cached)
        return [done, *self.retire(seq)]

    def fail(self, seq: Sequence, code: str, message: str, status: int) -> list[Effect]:
        return [Fail(seq.request_id, code, message, status, seq.request.reader), *self.retire(seq)]

    def retire(self, seq: Sequence, ack: bool = True) -> list[Effect]:
        """The request leaves this worker: free its blocks, ack its task at the next publish
        (unless ``ack`` is False: ``moved_away``)."""
        return [Forget(seq.request_id), *self.let_go(seq, ack)]

    def let_go(self, seq: Sequence, ack: bool = True) -> list[Effect]:
        """A task leaves this worker: free its blocks, ack it (unless ``ack`` is False), drop its
        own reservation. Its request's writer is left alone: as is when a newer task of the
        request is held here and writes for it (``retire`` otherwise)."""
        self.engine.release(seq)
        effects: list[Effect] = [Ack(seq.entry_id)] if ack else []
        if seq.task.phase == Phase.DECODE:
            effects.append(DropReservation(seq.request_id, seq.entry_id))
        return [*effects, Left(seq)]

    def moved_away(self, seq: Sequence, reapers: bool = False) -> list[Effect]:
        """Forget a request the reaper moved: free its blocks, write nothing more for it. One
        being imported only leaves the table: the engine still writes its blocks, and the import
        lets the task go when it ends. One no longer held (the shell found it moved before an
        await: it left meanwhile, or a newer task of its request is held now) changes nothing:
        it was retired once already, and the newer task's writer is not its to drop.

        ``reapers``: the task's entry is a reaper's now (no longer pending to this worker), and
        so is its ack. A reaper that keeps a task for its DP group to re-form holds it pending
        to itself; an ack from here (XACK acks for the whole group, whoever holds the entry)
        took it from the reaper, and the request was lost."""
        importing = self.table.holds(seq, Status.IMPORTING)
        if not self.table.remove(seq):
            return []
        if importing:
            return [Wake()]
        return [Wake(), *self.retire(seq, ack=not reapers), Discard(seq.request_id)]

    def cancel(self, request_id: str) -> list[Effect]:
        """A cancel for the request (its API node, or the reaper): it leaves wherever it waits
        or runs here; a prefill, a hand-off or an import in flight finds out when it ends. A
        task of it that comes later is acked (``admit``)."""
        self.cancelled[request_id] = self.clock()
        while len(self.cancelled) > RECENT_CANCELS:
            self.cancelled.pop(next(iter(self.cancelled)))
        seq = self.table.take(request_id, *DROPPABLE)
        if seq is None:
            return []
        log.info("dropped cancelled request %s", request_id)
        return [*self.retire(seq), Wake()]

    def drop_task(self, entry_id: str) -> list[Effect]:
        """A cancel naming one of this worker's task entries (its request moved to other
        workers): that task, waiting for its KV, leaves."""
        effects: list[Effect] = []
        for seq in [s for s in self.table.of(Status.AWAITING_KV) if s.entry_id == entry_id]:
            self.table.remove(seq)
            effects += [*self.retire(seq), Wake()]
        return effects

    def deadlines_past(self) -> list[Effect]:
        """Past its deadline a request ends here with an error, freeing its blocks, whether or
        not its API node is still there to cancel it. Called before each step."""
        now_ms, effects = self.wall() * 1000, []
        for seq in [s for s in self.table.of(*DROPPABLE) if s.request.deadline_ms and now_ms > s.request.deadline_ms]:
            self.table.remove(seq)
            effects += self.fail(seq, "deadline", "the request's deadline passed before it finished", 504)
        return effects

    def group_broken(self, reason: str) -> list[Effect]:
        """A mixed rank's DP group broke (``DpStepper.leave``, once the rank's other loops are
        stopped): what it holds queued or running fails, and the rank leaves the registry."""
        effects: list[Effect] = []
        for seq in self.table.of(Status.QUEUED, Status.RUNNING):
            self.table.remove(seq)
            effects += self.fail(seq, "dp_group_broken", reason, 503)
        return effects

    def kv_waits_past(self) -> list[Sequence]:
        """The decode tasks whose KV did not come by the kv wait, out of the table: each is then
        failed, or let go if its request moved (``kv_wait_ended``, once the shell has looked)."""
        return self.table.kv_waits_past(self.clock())

    def kv_wait_ended(self, seq: Sequence, moved: bool) -> list[Effect]:
        if moved:
            return self.retire(seq)
        message = f"no KV cache arrived from {seq.task.peer} within {self.limits.kv_wait_s:.0f}s"
        return [*self.fail(seq, "kv_transfer_timeout", message, 503), Wake()]

    def hand_off_outcome(
        self, seq: Sequence, end: HandOffEnd, exc: BaseException | None, *, superseded: bool = False
    ) -> list[Effect]:
        """What a hand-off's end comes to, for a request still HANDING_OFF (one that moved away or
        was voided meanwhile was retired there). Shipped, or its decode worker gone: P lets go
        (a dead or hung D does not fail the request: the reaper gives it a new pair). Refused
        (``exc`` says why): the request fails and its decode side is cancelled, unless it was
        dispatched again (``superseded``: its error and cancel would end the newer dispatch),
        then P only lets go. A bug fails this request alone."""
        if not self.table.holds(seq, Status.HANDING_OFF):
            return []
        if end is HandOffEnd.PEER_GONE:
            log.warning("%s; leaving %s to the reaper", exc, seq.request_id)
        elif end is HandOffEnd.REFUSED and superseded:
            log.warning("hand-off of %s failed (%s), but it was dispatched again; leaving it", seq.request_id, exc)
        if end in (HandOffEnd.SHIPPED, HandOffEnd.PEER_GONE) or superseded:
            return self.retire(seq)
        if end is HandOffEnd.REFUSED:
            message = f"could not hand the KV cache to {seq.task.peer}: {exc}"
            return [
                *self.fail(seq, "kv_transfer_failed", message, 503),
                CancelPeer(seq.request_id, "kv_transfer_failed"),
            ]
        return self.fail(seq, "handler_failed", f"the KV hand-off failed: {type(exc).__name__}: {exc}", 500)

    def hand_off_ended(self, seq: Sequence) -> list[Effect]:
        """A hand-off is over (its effects applied): the request is out of the table."""
        if self.table.holds(seq, Status.HANDING_OFF):
            self.table.remove(seq)
        seq.kv = None
        return [Wake()]

    # ------------------------------------------------------------ KV arrivals (decode side)

    def admit_kv(self, sender: str, header: Header) -> tuple[str | None, list[Effect]]:
        """The check of a KV frame before its payload is read: (why it is refused or None, the
        effects). A frame not from the task's P, or without the proof of the reservation's
        secret, is refused and changes nothing: the reservation waits for the real P (a stranger
        must not be able to fail someone else's request). A proven frame that is larger than
        the reserved blocks or whose meta P could not have sent fails the request."""
        seq = self.table.get(header.ident, Status.AWAITING_KV)
        if seq is None:
            return f"decode worker {self.id} holds no reservation for {header.ident}", []
        if sender != seq.task.peer or not proof_matches(seq.kv_secret, sender, header):
            log.warning(
                "refused a KV frame for %s from %r: not from %s with the reservation's secret",
                header.ident,
                sender,
                seq.task.peer,
            )
            return f"{header.ident}: not from its prefill worker with the reservation's secret", []
        problem = self.kv_problem(seq, header)
        if problem is None:
            return None, []
        self.table.remove(seq)
        return problem, [
            *self.fail(seq, "kv_rejected", f"the KV frame from {sender} was refused: {problem}", 500),
            Wake(),
        ]

    def kv_problem(self, seq: Sequence, header: Header) -> str | None:
        capacity = self.engine.kv_capacity(seq)
        if header.size > capacity:
            return f"a KV payload of {header.size} bytes is more than the {capacity} bytes reserved"
        return meta_problem(seq.task, header.meta, self.engine.vocab_size)

    def start_import(self, request_id: str) -> Sequence:
        """A frame admitted just now (no await between): its task is IMPORTING while the engine
        takes the cache, held so that the request keeps one entry."""
        seq = self.table.get(request_id, Status.AWAITING_KV)
        assert seq is not None
        self.table.move(seq, Status.IMPORTING)
        return seq

    def end_import(self, seq: Sequence, meta: dict[str, Any], error: str | None) -> tuple[str | None, list[Effect]]:
        """The engine took the cache (or refused it, ``error``): the request RUNNING with the
        tokens P generated, its text replayed to the state P had; (why refused or None, effects)."""
        if not self.table.remove(seq):  # the request moved here again meanwhile: a newer task has it
            return f"{seq.request_id} moved: a newer task of it is held by decode worker {self.id}", self.let_go(seq)
        if error:
            return error, self.fail(seq, "kv_import_failed", error, 500)
        seq.output_ids = list(meta["output_token_ids"])
        problem = seq.follow_grammar()  # the tokens P generated, which P's grammar allowed
        if problem is not None:
            return problem, self.fail(seq, "invalid_grammar", problem, 400)
        seq.prompt_cached = meta.get("cached_tokens", 0)  # P's prefix cache: the usage reports it
        seq.text.push(seq.output_ids)
        self.table.add(seq, Status.RUNNING)
        return None, [Open(seq.request_id, seq.request.reader, meta["next_seq"]), Wake()]


def dispatched_again(seq: Sequence, current: bytes | str | None) -> str | None:
    """Why this task is void, given its request's current hand-off id: a reaper moved the
    request to another pair. (No id: a task from before hand-off ids, or a current id that
    outlived its TTL; nothing newer is known.)"""
    if isinstance(current, str):  # a client that decodes replies (these do not)
        current = current.encode()
    if seq.task.handoff and current is not None and current != seq.task.handoff.encode():
        return f"{seq.request_id} was dispatched again (the reaper moved it off {seq.task.peer} or this worker)"
    return None


def meta_problem(task: Task, meta: dict[str, Any], vocab_size: int) -> str | None:
    """Why ``meta`` cannot be the hand-off of ``task``'s request, or None: exactly what the
    prefill worker its task names could have sent. P prefills once and publishes one entry (its
    first token), so its frame carries the tokens the task already had plus the ones P made, and
    the ``seq`` D continues at: the task's ``first_seq`` plus one per new token. Anything else
    is not a frame P sent, and D would hang the stream (a ``seq`` gap), crash (a negative one)
    or decode nonsense if it took it."""
    tokens = meta.get("output_token_ids")
    problem = _tokens_problem(task, tokens, vocab_size)
    if problem is not None:
        return problem
    assert isinstance(tokens, list)
    expected = task.first_seq + len(tokens) - len(task.output_token_ids)
    next_seq = meta.get("next_seq")
    if type(next_seq) is not int or next_seq != expected:
        return f"next_seq must be {expected} (one entry per token after first_seq {task.first_seq}), got {next_seq!r}"
    cached, prompt = meta.get("cached_tokens", 0), len(task.request.prompt_token_ids)
    if type(cached) is not int or not 0 <= cached <= prompt:
        return f"cached_tokens must be an integer in [0, {prompt}], got {cached!r:.40}"
    return traceparent_problem(meta.get("traceparent", ""))  # P's kv_transfer span (docs/metrics.md, "Spans")


def _tokens_problem(task: Task, tokens: Any, vocab_size: int) -> str | None:
    before, max_tokens = task.output_token_ids, task.request.sampling.max_tokens
    if type(tokens) is not list or not tokens:
        return "output_token_ids must be a non-empty list of token ids"
    if not len(before) < len(tokens) < max_tokens:
        # P hands off only an unfinished request, so it sent fewer than max_tokens tokens.
        return f"output_token_ids holds {len(tokens)} tokens; expected {len(before) + 1} to {max_tokens - 1}"
    if any(type(t) is not int or not 0 <= t < vocab_size for t in tokens):
        return f"output_token_ids must hold integers in [0, {vocab_size})"
    if tokens[: len(before)] != before:
        return "output_token_ids must start with the task's own output_token_ids"
    return None


def first_priority(first: Sequence | None) -> int:
    """``WorkerLoad.first_queued_priority`` for the request first in the prefill queue: its
    priority; 0 with none queued; the earliest there is for one that holds KV blocks (it goes
    first whatever its priority: no request would head the queue before it)."""
    if first is None:
        return 0
    return PRIORITY_RANGE[0] if first.blocks > 0 else first.request.priority
