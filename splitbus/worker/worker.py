"""A worker process: the core (its requests and its engine, no I/O) in a thin asynchronous shell.

Roles: a ``prefill`` worker prefills, publishes the first token and hands the KV cache to the
decode worker named in its task; a ``decode`` worker reserves KV blocks, waits for that cache
and decodes; a ``mixed`` worker does both. Tasks are acked once their work is handed on: by P
when D has the cache, by D when the final entry is written.

``WorkerCore`` (``core``) holds every rule: what a task comes to, what a step runs, what its
tokens do, how a request leaves; each answer is a list of effects (``effects``). Around it the
shell does the I/O, each part a loop step under one ``Loops`` (a loop's bug stops the worker
with exit code 1): the task feed (``feed``), the engine loop (the stepper of ``steps``, or a DP
rank's of ``dp``), the publisher, the lease, the cancel listener, the KV transfer (``handoff``
on P, ``receiver`` on D) and the control commands. The core's effects go to the ``outbox``,
which buffers the writes and wakes the loop each concerns.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from functools import partial

from splitbus.bus.cancel import CancelListener, publish_cancel
from splitbus.bus.core.codec import NamedRequest
from splitbus.bus.core.connection import connect, transient_suppressed, until_done
from splitbus.bus.core.loops import Loops
from splitbus.bus.dispatch import CurrentDispatch
from splitbus.bus.kv_events import KvEventPublisher
from splitbus.bus.reaping import Reaping
from splitbus.bus.records import WorkerLoad
from splitbus.bus.registry import Registry, WorkerRecord
from splitbus.bus.reservations import Reservations
from splitbus.bus.results import ResultWriter
from splitbus.bus.tasks import task_consumer, unsettled_tasks
from splitbus.grammar.outcomes import GrammarError
from splitbus.grammar.tokenizer import grammar_tokenizer
from splitbus.tokenization import ModelTokenizer
from splitbus.worker import metrics
from splitbus.worker.cancellation import Cancellation
from splitbus.worker.config import WorkerConfig
from splitbus.worker.control import control_server
from splitbus.worker.core import Limits, WorkerCore
from splitbus.worker.drain import Drain
from splitbus.worker.effects import Effect
from splitbus.worker.engines.interface import Engine
from splitbus.worker.feed import TaskFeed
from splitbus.worker.handoff import HandOff
from splitbus.worker.lease import Lease
from splitbus.worker.links import PeerLinks
from splitbus.worker.outbox import NewRun, Outbox
from splitbus.worker.publisher import Publisher
from splitbus.worker.receiver import Receiver
from splitbus.worker.recovery import Recovery
from splitbus.worker.steps import EngineSteps, SoloStepper, StepParts, StepperFactory
from splitbus.worker.transfer import TransferClient, TransferServer

log = logging.getLogger(__name__)


class Worker:
    def __init__(
        self,
        config: WorkerConfig,
        tokenizer: ModelTokenizer,
        engine: Engine,
        stepper: StepperFactory = SoloStepper,
    ) -> None:
        self.config, self.id, self.tokenizer, self.engine = config, config.worker_id, tokenizer, engine
        self.redis = connect(config.bus, max_connections=16, name=self.id)
        self.keys = config.bus.keys
        self.registry = Registry(self.redis, config.bus)
        self.loops = Loops(f"worker {self.id}", part="the worker", on_fail=self._wake_all)
        self.stopping = self.loops.stopping
        limits = Limits(self.id, config.model_name, config.block_size, config.max_prefill_tokens, config.kv_wait_s)
        self.core = WorkerCore(limits, engine, tokenizer)
        self.requests = self.core.table
        self.started_ms = 0  # Redis server time of the first registration: the DP group's epoch
        self._build_shell(stepper)
        self.server = TransferServer(self.id, self.receiver.admit_kv, self.receiver.import_kv)
        self.control = control_server(self)
        self.stop_reporting_load = metrics.watch_load(self.load)
        self.draining = Drain(self.core, self.loops, self._show_draining, self._unsettled_tasks, self._unwritten)

    def _build_shell(self, stepper: StepperFactory) -> None:
        """Each part is built after the parts it calls, so that calls run one way: the worker
        into its parts, a part into the ones built before it and into the core. Three are
        handed to a part built before their owner, as the worker's: the lease's ``drop_moved``
        (the feed's; called by the lease's ``rejoin``, which the heartbeat, the publisher's
        ``before`` and the engine loop's ``settle`` run after a lapse) and its beat hooks (the
        recovery's, run by the heartbeat); the outbox's ``ship`` is set to the hand-off's once
        that exists (the hand-off applies its effects through the outbox). The recovery and the
        task feed share one ``NewRun`` flag."""
        config, redis, core = self.config, self.redis, self.core
        self.tasks = task_consumer(redis, config.bus, self.id, self.id, on_dead=self._fail_dead_lettered)
        self.writer = ResultWriter(redis, config.bus)
        self.reservations = Reservations(redis, self.keys)
        self.outbox = Outbox(self.writer, self.loops, partial(publish_cancel, redis, config.bus))
        self.publish_lock = asyncio.Lock()
        self.new_run = NewRun()
        self.lease = Lease(
            self.id,
            config.lease_ms,
            redis,
            self.keys,
            self.registry,
            self.record,
            self._drop_moved,
            self.publish_lock,
            before_beat=self._watch_runs,
            after_beat=self._recover,
        )
        apply = self.outbox.apply
        self.cancellation = Cancellation(CancelListener(redis, config.bus), core, apply)
        self.links = PeerLinks(redis, config.bus, self.id, TransferClient(self.id, config.transfer_timeout_s))
        self.receiver = Receiver(core, CurrentDispatch(redis, self.keys), Reaping(redis, self.keys), self.loops, apply)
        self.handoff = HandOff(core, redis, config.bus, self.links, self.writer, apply=apply, lapsed=self.lease.lapsed)
        self.outbox.ship = self.handoff.hand_off
        self.steps = EngineSteps(
            core,
            self.outbox,
            self.tasks,
            self.registry,
            self.loops,
            expire_waits=self.receiver.expire_waits,
            settle=self.lease.settle_if_lapsed,
        )
        parts = StepParts(config, redis, self.registry, self.steps, self.outbox, self._publish, self.loops)
        self.stepper = stepper(parts)
        self.feed = TaskFeed(
            core,
            redis,
            config.bus,
            self.tasks,
            self.registry,
            self.reservations,
            self.outbox,
            max_requests=config.max_requests,
            work_arrived=self.stepper.work_arrived,
            new_run=self.new_run,
        )
        kv = KvEventPublisher(redis, config.bus, self.id, config.dp_rank, total_kv_blocks=self.engine.total_blocks)
        self.publisher = Publisher(
            redis,
            kv,
            self.engine,
            self.outbox,
            self.tasks,
            self.reservations,
            lock=self.publish_lock,
            before=self.lease.rejoin,
            after_results=self.feed.give_back_reservations,
        )
        self.recovery = Recovery(
            core,
            redis,
            config.bus,
            self.tasks,
            self.writer,
            apply=apply,
            beat=self.lease.beat,
            take_lost=self.feed.take_lost,
            lock=self.publish_lock,
            new_run=self.new_run,
        )

    # ------------------------------------------------------------ the loop

    async def run(self) -> None:
        """The engine loop until stopped. Every loop here, this one and the background ones,
        runs under ``Loops``' one policy: Redis refusing (down, LOADING, OOM...) is waited out
        with nothing buffered dropped; an entry that cannot be handled fails its request alone;
        anything else is a bug, and the worker stops with exit code ``EXIT_FATAL``."""
        try:
            await self.start()
            await self.loops.run(self.stepper.step, name="engine loop")
        finally:
            await self.close()

    # ------------------------------------------------------------ life cycle

    @property
    def exit_code(self) -> int:
        return self.loops.exit_code

    @property
    def endpoint(self) -> str:
        return self.core.endpoint

    @property
    def wake(self) -> asyncio.Event:
        return self.outbox.wake

    def apply(self, effects: Iterable[Effect]) -> None:
        """Carry out the core's effects (``Outbox.apply``)."""
        self.outbox.apply(effects)

    async def start(self) -> None:
        await self.prepare_grammars()
        self.core.endpoint = await self.server.start(
            self.config.transfer_host, self.config.transfer_port, self.config.advertised_transfer_host
        )
        await until_done(self.join_bus, self.redis, lambda: self.loops.stopped, "start-up")
        self.loops.start(self.feed.feed_tasks)
        self.loops.start(self.lease.heartbeat, every_s=self.config.heartbeat_s)
        self.loops.start(self.cancellation.listen, name="listen_for_cancels")
        self.loops.start(self.feed.trim_tasks)
        self.loops.start(self.control.serve_once, name="answer_commands")
        self.loops.start(self.publisher.publish_when_asked, name="publisher")
        self.loops.start(self.feed.find_lost_tasks)
        log.info("worker %s (%s) ready, KV endpoint %s", self.id, self.config.role, self.endpoint)
        await self.stepper.start()

    def drain(self) -> None:
        """SIGTERM with ``--drain-timeout``: take no new task, finish what is held, leave
        (``splitbus.worker.drain``). Without a drain timeout, stop at once."""
        if self.config.drain_timeout_s <= 0:
            self.loops.stop()
        else:
            self.draining.begin(self.config.drain_timeout_s)

    def begin_drain(self, timeout_s: float) -> bool:
        """The ``drain`` control command's: drain for up to ``timeout_s``; False if a drain had begun."""
        return self.draining.begin(timeout_s)

    async def prepare_grammars(self) -> None:
        """llguidance's view of the vocabulary, built before any task (0.2-0.5 s for SmolLM2's 49k
        tokens) in a thread: the core builds a request's grammar on the event loop as it takes its
        task. A tokenizer llguidance cannot read only costs the model its structured output: each
        constrained request fails alone (``WorkerCore.constrain``)."""
        try:
            await asyncio.to_thread(grammar_tokenizer, self.tokenizer)
        except GrammarError as exc:
            log.warning("worker %s serves no structured output: %s", self.id, exc)

    async def join_bus(self) -> None:
        """The start-up steps on Redis; each is safe to repeat (retried while Redis loads)."""
        await self.tasks.ensure_group()
        await self.cancellation.listener.start()
        await self.control.start()
        self.started_ms = await self.registry.register(self.record(), self.config.lease_ms)
        await self.lease.beat()  # now with started_ms
        await self.recovery.watch()  # the run it joined (a restart from here on is a new run)
        await self.publisher.start_kv_events()  # its prefix cache, empty, on its KV event stream

    async def close(self) -> None:
        self.loops.stop()
        self.outbox.room.set()
        with transient_suppressed("the last publish"):
            await self.publisher.publish()  # what the last steps left
        await self.loops.close()
        self.stop_reporting_load()
        with transient_suppressed("leaving the registry"):
            if self.exit_code == 0 and not self.core.held() and not self.draining.unfinished:
                await self.registry.deregister(self.id)
            else:  # what it held or left (a task read, not taken) must move: no reaper looks at a deregistered one
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
        return self.core.load()

    # ------------------------------------------------------------ what the worker is called back for

    def _wake_all(self) -> None:
        """A loop failed: what the loops wait on wakes, so that they see the stop."""
        self.outbox.wake.set()
        self.outbox.room.set()

    def _fail_dead_lettered(self, named: NamedRequest, reason: str) -> None:
        self.feed.fail_request(named.request_id, reason, reader=named.reader)

    async def _drop_moved(self) -> None:
        await self.feed.drop_moved()

    async def _publish(self) -> None:
        await self.publisher.publish()

    async def _watch_runs(self) -> None:
        if await self.recovery.watch():
            self.publisher.kv_new_run = True  # a fresh KV snapshot at the next write

    async def _recover(self) -> None:
        await self.recovery.recover_if_owed()

    async def _show_draining(self) -> bool:
        return await self.registry.show_draining(self.id, self.load())

    async def _unsettled_tasks(self) -> int:
        return await unsettled_tasks(self.redis, self.keys, self.id)

    def _unwritten(self) -> int:
        """Writes the outbox holds: results, task acks, stale reservations."""
        return self.writer.pending + len(self.outbox.done_entries) + len(self.outbox.stale_reservations)
