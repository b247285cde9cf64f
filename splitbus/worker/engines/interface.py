"""What the worker loop needs from an engine (``sim``, ``paddle``, any registered one), and the
log of KV events it reads from one with a prefix cache (``KvEventLog``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from splitbus.bus.records import ExpertLoad

__all__ = ["Engine", "ExpertLoad", "ExpertParallel", "ForksTwins", "KvEventLog", "SimulatedGroup"]

if TYPE_CHECKING:  # types only: the CLI imports the registry to build its parser, which stays fast
    from splitbus.bus.messages import Task
    from splitbus.bus.messages.kv_events import KvEvent
    from splitbus.worker.sequence import Sequence


class KvEventLog:
    """The KV events a cache's changes made, oldest first, until the worker has sent them.

    An event is never changed once recorded, and only the oldest are cleared: a writer reads
    :meth:`pending`, sends them (awaiting Redis while the cache goes on changing) and then calls
    :meth:`sent` with how many it sent; what was recorded meanwhile, and everything after a
    failed send, stays in order for the next one."""

    def __init__(self) -> None:
        self._events: list[KvEvent] = []

    def __len__(self) -> int:
        return len(self._events)

    def add(self, event: KvEvent) -> None:
        self._events.append(event)

    def pending(self) -> list[KvEvent]:
        """The events not sent yet, oldest first (a copy)."""
        return list(self._events)

    def sent(self, count: int) -> None:
        """The ``count`` oldest events were sent: forget them."""
        del self._events[:count]


class Engine(Protocol):
    eos_token_ids: tuple[int, ...]
    total_blocks: int
    vocab_size: int
    """Token ids the engine can emit are below this (a KV frame's tokens are checked against it)."""

    @property
    def free_blocks(self) -> int:
        """KV blocks not held by any request (reported at each heartbeat)."""

    @property
    def kv_events(self) -> KvEventLog | None:
        """What the engine's prefix cache stored and evicted, in order, not yet sent (its
        ``BlockPool.events``); None for an engine without prefix caching. Read by the worker's
        publisher at each of its writes, once the results of the engine's latest prefill or
        decode are written: it sends the pending events as one batch on the worker's KV event
        stream and then clears those it sent (``sent``), so a Redis error leaves them for the
        next write."""

    def reserve(self, seq: Sequence, tokens: int) -> bool:
        """Called when a task is accepted: hold blocks for ``tokens`` positions of ``seq``
        (prompt only on a prefill worker; prompt + max_tokens where it decodes). False when
        there is no room; the request is then failed."""

    def cached_prefix(self, task: Task) -> int:
        """Called as a prefill or mixed task is taken (its blocks are taken when its prefill
        starts): how many of its prompt tokens the prefix cache holds now, for the queued
        prefill tokens the worker reports; nothing is taken."""

    def can_reserve(self, task: Task, tokens: int) -> bool:
        """Called before a task is taken, while the worker holds other requests: whether
        ``reserve`` would find room for ``tokens`` positions of it now (nothing is taken). False
        leaves the task waiting until a request leaves."""

    def kv_capacity(self, seq: Sequence) -> int:
        """The most KV bytes the blocks reserved for ``seq`` hold: a decode worker refuses a
        larger frame before reading it."""

    def release(self, seq: Sequence) -> None:
        """Called when the request leaves this worker (finished, handed off, cancelled)."""

    def first_to_compute(self, seq: Sequence) -> int | None:
        """Called as a prefill batch is formed, for each queued sequence: the hash of the first
        full block its prefill would compute (None: no prefix cache, or no block it could share).
        Of the queued sequences with the same one, only the first joins the batch; the others
        wait a step, and their prefill then finds that block cached."""

    async def prefill(self, batch: list[Sequence]) -> list[int]:
        """Called with sequences whose prompt (and tokens already generated) have no KV here
        yet: compute it and return each sequence's next token. A sequence first takes the
        blocks of its prompt that a prefix cache stored since ``reserve`` (a sibling's prefill).
        With ``ForksTwins``, a twin forked from one in the batch (``Sequence.fork_of``,
        ``twins.computing``) is not computed: its next token is drawn from its leader's last
        logits, with its own seed."""

    async def decode(self, batch: list[Sequence]) -> list[int]:
        """Called once per step with the running sequences: feed each one's last token and
        return its next token."""

    async def export_kv(self, seq: Sequence) -> bytes:
        """Called on a prefill worker after prefill: the request's KV, to ship to its decode worker."""

    async def import_kv(self, seq: Sequence, payload: bytes) -> str | None:
        """Called on a decode worker when the KV arrives; returns why it is refused, or None.
        Blocks of it that the engine's cache holds already (another choice of its response)
        may be shared instead of written (``PagedBlocks.share_imported``)."""

    async def idle(self) -> None:
        """Called on a DP rank with nothing to do while its group steps: a dummy forward, as
        EP's collective all-to-all needs every rank."""


@runtime_checkable
class ForksTwins(Protocol):
    """An engine that prefills a response's choices once (``splitbus.worker.twins``): the sim and
    paddle engines (``PagedBlocks.fork``). Without it, each choice prefills on its own."""

    def fork(self, leader: Sequence, twin: Sequence) -> None:
        """Called as a prefill batch is formed, for a twin (a choice of the same response as
        ``leader``, before it in the batch, with the same tokens) that holds no blocks: ``twin``
        holds ``leader``'s blocks from now on, and the prefill that computes ``leader`` computes
        it too (``Engine.prefill``)."""


@runtime_checkable
class SimulatedGroup(Protocol):
    """An engine whose DP group steps are simulated (``Capabilities.simulated_group``, the sim
    engine): it says how long a group step lasts, EP's all-to-all included, and its ranks end
    each step then, together."""

    def group_step_s(self, forwards: Iterable[tuple[str, int]]) -> float:
        """The group step's duration, given each rank's forward: (``prefill``, prompt tokens),
        (``decode``, batch size), (``idle``, 0) or (``none``, 0)."""


@runtime_checkable
class ExpertParallel(Protocol):
    """An engine that can split a MoE model's experts over a DP group's ranks
    (``Capabilities.expert_parallel``): built holding its share (``EngineSetup.shard``), it joins
    the group's collectives once the group has formed."""

    async def form_expert_group(self, host: str, port: int, rank: int, size: int, timeout_s: float) -> None:
        """Called by each rank of a group with ``--ep`` once the group has formed, before its
        first step, with rank 0's store address (which rank 0 listens on): form the process
        group. From then on every forward (prefill, decode, idle) is a collective: every rank
        runs one per group step."""

    def expert_load(self) -> ExpertLoad | None:
        """Called with each load report: the experts held and the tokens they took; None for a
        dense model."""
