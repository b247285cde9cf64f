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
on P, ``receiver`` on D) and the control commands. ``apply`` hands the core's effects to the
part that carries each out.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from splitbus.bus.cancel import CancelListener, publish_cancel
from splitbus.bus.core.codec import NamedRequest
from splitbus.bus.core.connection import connect, transient_suppressed, until_done
from splitbus.bus.core.loops import Loops
from splitbus.bus.dispatch import CurrentDispatch
from splitbus.bus.kv_events import KvEventPublisher
from splitbus.bus.reaping import Reaping
from splitbus.bus.registry import Registry, WorkerLoad, WorkerRecord
from splitbus.bus.reservations import Reservations
from splitbus.bus.results import ResultWriter
from splitbus.bus.tasks import task_consumer
from splitbus.tokenization import ModelTokenizer
from splitbus.worker import metrics
from splitbus.worker.cancellation import Cancellation
from splitbus.worker.config import WorkerConfig
from splitbus.worker.control import control_server
from splitbus.worker.core import Limits, WorkerCore
from splitbus.worker.effects import CancelPeer, Effect, Fail, Left, ShipKv, Wake
from splitbus.worker.engines.interface import Engine
from splitbus.worker.feed import TaskFeed
from splitbus.worker.handoff import HandOff
from splitbus.worker.lease import Lease
from splitbus.worker.links import PeerLinks
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

    def _build_shell(self, stepper: StepperFactory) -> None:
        config, redis, core, apply = self.config, self.redis, self.core, self.apply
        self.tasks = task_consumer(redis, config.bus, self.id, self.id, on_dead=self._fail_dead_lettered)
        self.writer = ResultWriter(redis, config.bus)
        self.reservations = Reservations(redis, self.keys)
        kv = KvEventPublisher(redis, config.bus, self.id, config.dp_rank, total_kv_blocks=self.engine.total_blocks)
        self.publisher = Publisher(
            redis,
            kv,
            self.engine,
            self.writer,
            self.tasks,
            self.reservations,
            before=self._rejoin,
            after_results=self._give_back,
        )
        self.cancellation = Cancellation(CancelListener(redis, config.bus), core, apply)
        self.links = PeerLinks(redis, config.bus, self.id, TransferClient(self.id, config.transfer_timeout_s))
        self.receiver = Receiver(core, CurrentDispatch(redis, self.keys), Reaping(redis, self.keys), self.loops, apply)
        self.handoff = HandOff(core, redis, config.bus, self.links, self.writer, apply=apply, lapsed=self._lapsed)
        self.steps = EngineSteps(
            core, self.tasks, self.registry, self.loops, apply=apply, expire=self._expire, settle=self._settle
        )
        self.stepper = stepper(StepParts(config, redis, self.registry, self.steps, self.publisher, self.loops))
        self.feed = TaskFeed(
            core,
            redis,
            config.bus,
            self.tasks,
            self.registry,
            self.reservations,
            max_requests=config.max_requests,
            apply=apply,
            done_entries=self.publisher.done_entries,
            work_arrived=self.stepper.work_arrived,
        )
        self.lease = Lease(
            self.id,
            config.lease_ms,
            redis,
            self.keys,
            self.registry,
            self.record,
            self.feed.drop_moved,
            self.publisher.lock,
            before_beat=self._watch_runs,
            after_beat=self._recover,
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
            lock=self.publisher.lock,
        )

    # ------------------------------------------------------------ the core's effects

    def apply(self, effects: Iterable[Effect]) -> None:
        """Carry out the core's effects, in order: writes are buffered for the publisher; a
        hand-off and a cancel to the decode side start as one-shot work; a request that left
        lets the task feed read again and asks for a write; ``Wake`` wakes the engine loop."""
        for effect in effects:
            self.publisher.buffer(effect)
            match effect:
                case ShipKv(seq):
                    self.loops.spawn(self.handoff.hand_off(seq))
                case CancelPeer(request_id, reason):
                    self.loops.spawn(publish_cancel(self.redis, self.config.bus, request_id, reason))
                case Left():
                    self.feed.room.set()
                    self.publisher.soon()
                case Fail(warn=False):
                    self.publisher.soon()
                case Wake():
                    self.steps.wake.set()

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
        return self.steps.wake

    async def start(self) -> None:
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

    async def join_bus(self) -> None:
        """The start-up steps on Redis; each is safe to repeat (retried while Redis loads)."""
        await self.tasks.ensure_group()
        await self.cancellation.listener.start()
        await self.control.start()
        self.started_ms = await self.registry.register(self.record(), self.config.lease_ms)
        await self.lease.beat()  # now with started_ms
        if await self.recovery.watch():  # the run it joined (a restart from here on is a new run)
            self.feed.after_new_run = True
        await self.publisher.start_kv_events()  # its prefix cache, empty, on its KV event stream

    async def close(self) -> None:
        self.loops.stop()
        self.feed.room.set()
        with transient_suppressed("the last publish"):
            await self.publisher.publish()  # what the last steps left
        await self.loops.close()
        self.stop_reporting_load()
        with transient_suppressed("leaving the registry"):
            if self.exit_code == 0 and not self.core.held():
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
        return self.core.load()

    # ------------------------------------------------------------ the hooks between the shell's parts

    def _wake_all(self) -> None:
        """A loop failed: what the loops wait on wakes, so that they see the stop."""
        self.steps.wake.set()
        self.feed.room.set()

    def _fail_dead_lettered(self, named: NamedRequest, reason: str) -> None:
        self.feed.fail_request(named.request_id, reason, reader=named.reader)

    async def _rejoin(self) -> None:
        await self.lease.rejoin()

    async def _watch_runs(self) -> None:
        if await self.recovery.watch():
            self.feed.after_new_run = True
            self.publisher.kv_new_run = True  # a fresh KV snapshot at the next write

    async def _recover(self) -> None:
        await self.recovery.recover_if_owed()
        self.feed.after_new_run = self.recovery.owed

    async def _give_back(self) -> None:
        await self.feed.give_back_reservations()

    async def _settle(self) -> None:
        await self.lease.settle_if_lapsed()

    def _lapsed(self) -> bool:
        return self.lease.lapsed()

    def _expire(self) -> None:
        self.apply(self.core.deadlines_past())
        self.receiver.expire_waits()
