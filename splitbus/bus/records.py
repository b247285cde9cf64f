"""The plain records the bus's protocols carry besides stream entries, with their arithmetic: a
worker's load (``WorkerLoad``, its registry record's load fields), what schedulers reserved of
it (``Reserved``, ``blocks_needed``), what a MoE worker's experts took (``ExpertLoad``, part of its
load) and a request's KV reservation (``Reservation``, the hash
``sb:kv:{cell}:<request>``). Pure: no Redis, no event loop; the worker's core builds and checks
them without I/O, and the protocols that write them (``registry``, ``dispatch``,
``reservations``) import them from here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from splitbus.bus.messages import GenerateRequest
from splitbus.bus.messages._check import MAX_KV_BLOCKS, MAX_NAME_CHARS, require_int, require_str

MAX_HANDOFF_CHARS = 64
"""A task's hand-off id is at most this long (messages/tasks.py)."""
MAX_SECRET_CHARS = 256
"""Secrets are 64 hex characters (``transfer.new_secret``); anything much longer is not one."""
_MAX_FIELD_BYTES = 4 * max(MAX_NAME_CHARS, MAX_SECRET_CHARS)
"""Longer than any valid field in UTF-8: a longer value is refused before it is decoded."""


MAX_EXPERTS = 1024
"""Experts per MoE layer a model may have (``splitbus.architectures.base.MAX_EXPERTS``): bounds an
expert load read back from Redis."""


@dataclass(frozen=True)
class ExpertLoad:
    """What a MoE engine's rank holds and what its experts took: the load an expert balancer
    needs. Experts are numbered as in the model; every MoE layer holds the same ones."""

    experts: int
    """Experts per MoE layer in the model."""
    held: tuple[int, int]
    """The experts this rank holds, ``[first, end)``: all of them without expert parallelism."""
    last_forward: tuple[int, ...]
    """Tokens each held expert took in the rank's last forward, every MoE layer's added (under
    expert parallelism, tokens of every rank of the group)."""
    total: tuple[int, ...]
    """The same, over every forward since the engine started."""
    weight_bytes: tuple[int, int] = (0, 0)
    """Bytes of the weights this rank holds: (attention, embeddings and dense layers; its experts)."""

    def to_json(self) -> dict[str, Any]:
        """As ``get_payload``'s ``experts`` and ``splitbus status --json`` show it (docs/protocol.md)."""
        dense, experts = self.weight_bytes
        return {
            "experts_per_layer": self.experts,
            "held": list(self.held),
            "last_forward_tokens": list(self.last_forward),
            "total_tokens": list(self.total),
            "weight_bytes": {"dense": dense, "experts": experts},
        }


@dataclass
class WorkerLoad:
    """What a worker reports about itself at each heartbeat, and as it takes tasks (DP ranks:
    every step)."""

    running: int = 0
    waiting: int = 0
    queued_prefill_tokens: int = 0
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    prefills_done: int = 0
    prefills_shared: int = 0
    """Of ``prefills_done``: the requests whose prefill shared a twin's forward (a response's
    choices, ``splitbus.worker.twins``); the prompts computed are the difference."""
    decodes_done: int = 0
    steps: int = 0
    idle_forwards: int = 0
    step_time_us: int = 0
    """DP ranks, cumulative: time in group steps (barrier wait included)."""
    idle_time_us: int = 0
    """DP ranks, cumulative: time in steps where this rank ran an idle forward."""
    busy_time_us: int = 0
    """DP ranks, cumulative: time computing this rank's own prefill or decode."""
    idle_forward_us: int = 0
    """DP ranks, cumulative: time inside its idle forwards (the forward itself, no barrier: under
    expert parallelism its exchanges, and its experts' compute for the other ranks' tokens)."""
    forward_ends_ms: int = 0
    """DP ranks: when the forward this rank is running should end (its wall clock, ms, from
    its own estimate; 0 before its first). Stagger windows close just before a group's end."""
    dp_epoch: int = 0
    """DP ranks: the epoch (ms) of the group this rank steps in, written as the group forms; 0
    while it forms. Schedulers place on a group only while all its ranks show one epoch: a rank
    restarted after a kill shows 0 until the survivors, who still show the old one, re-form with it."""
    first_queued_priority: int = 0
    """The priority of the request first in its prefill queue (the earliest, lower first; 0 when
    none is queued). A scheduler bounding prefill queues lets a request of an earlier priority
    past the bound: it would go to the queue's head (``PolicyOptions.max_queued_prefill_tokens``)."""
    prompt_tokens_done: int = 0
    """Cumulative: prompt tokens of the requests prefilled here (each whole prompt, its cached
    part included). With ``prefills_done`` it gives the mean prompt length (``splitbus.planner``)."""
    prompt_tokens_cached: int = 0
    """Cumulative: of ``prompt_tokens_done``, those not computed here: a prefix cache held them, or
    a twin's forward computed them (``prefills_shared``). The prefix hit ratio is its share."""
    prefill_busy_us: int = 0
    """Cumulative: time inside prefill engine calls. The tokens computed over it are what a prefill
    worker can do at the batch sizes it runs: a capacity, where a rate over wall time is the demand."""
    decode_tokens_done: int = 0
    """Cumulative: tokens decode steps emitted (a prefill's first token is not one)."""
    decode_steps: int = 0
    """Cumulative: decode engine calls. Tokens over steps is the mean decode batch."""
    decode_time_us: int = 0
    """Cumulative: each decode step's time to the next one's start (to its own end when none
    follows at once): what a request sees between tokens, prefills run in between included. Over
    ``decode_steps``, the mean inter-token latency at the mean batch."""
    draining: int = 0
    """1 while the worker drains: it takes no new task, finishes what it holds, then leaves."""
    experts: ExpertLoad | None = None
    """A MoE engine's expert placement and loads (``ExpertParallel.expert_load``); None for a dense
    model or an engine without experts. Kept last: the fields before it are the integer ones."""


def counter_growth(before: Mapping[str, int], now: Mapping[str, int]) -> int:
    """How much a cumulative counter grew between two readings of it, by worker id: each worker
    in both counts its growth; one new since, or restarted (its counter went back), counts nothing
    (early refusal's prefill rate and the planner's rates read the registry's counters alike)."""
    return sum(max(count - before[worker], 0) for worker, count in now.items() if worker in before)


@dataclass(frozen=True)
class Reserved:
    """Load that schedulers assigned and the worker has not taken yet. Schedulers add to it
    when they write a task (``HINCRBY``); the worker subtracts when it reads the task. Heartbeats
    never write these fields, so they do not erase each other."""

    reserved_prefill_tokens: int = 0
    reserved_requests: int = 0
    reserved_kv_blocks: int = 0


def blocks_needed(request: GenerateRequest, block_size: int) -> int:
    """The KV blocks a dispatch reserves for ``request`` on a worker with ``block_size``: prompt +
    ``max_tokens``. The worker bounds a task's ``reserved`` by the same number."""
    return math.ceil((len(request.prompt_token_ids) + request.sampling.max_tokens) / max(block_size, 1))


@dataclass(frozen=True)
class Reservation:
    """What a decode worker writes in ``sb:kv:{cell}:<request>`` once it holds the request's blocks."""

    decode_worker: str
    """The decode worker that reserved (and waits for the KV)."""
    endpoint: str
    """The decode worker's transfer endpoint; P sends only if it is D's registered one."""
    blocks: int
    """KV blocks reserved."""
    prefill_worker: str
    """The prefill worker its task names: the only sender it takes the KV from."""
    task_entry: str
    """The decode task's entry id: a clean-up drops only the reservation its own task made."""
    secret: str = dataclasses.field(repr=False)
    """Random per reservation; P proves it in the KV frame. Never logged."""
    handoff: str = ""
    """The dispatch the reservation was made for ("" from a decode worker before hand-off ids)."""

    def __post_init__(self) -> None:
        for name in ("decode_worker", "prefill_worker", "task_entry"):
            require_str(getattr(self, name), name)
        require_str(self.endpoint, "endpoint", nonempty=False)
        require_str(self.secret, "secret", nonempty=False, max_chars=MAX_SECRET_CHARS)
        require_str(self.handoff, "handoff", nonempty=False, max_chars=MAX_HANDOFF_CHARS)
        require_int(self.blocks, "blocks", 0, MAX_KV_BLOCKS)

    def made_for(self, decode_worker: str, prefill_worker: str, handoff: str) -> bool:
        """Whether this is the reservation of that pair's dispatch ``handoff`` (not an older
        dispatch's, nor one another worker made)."""
        return (self.decode_worker, self.prefill_worker, self.handoff) == (decode_worker, prefill_worker, handoff)

    def to_hash(self) -> dict[str, str]:
        return {f.name: str(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_reply(cls, values: Sequence[bytes | None]) -> Reservation:
        """From ``HMGET`` of ``FIELDS``; raises ValueError for a missing or malformed field (an
        absent ``handoff`` is "": decode workers before hand-off ids write none)."""
        raw = dict(zip(FIELDS, values, strict=True))
        if raw["handoff"] is None:
            raw["handoff"] = b""
        missing = [name for name, value in raw.items() if value is None]
        if missing:
            raise ValueError(f"missing {', '.join(missing)}")
        text = {name: _text(value, name) for name, value in raw.items() if value is not None}
        blocks = text.pop("blocks")
        if not blocks.isdigit() or len(blocks) > 10:
            raise ValueError(f"blocks must be a small non-negative integer, got {blocks[:20]!r}")
        return cls(blocks=int(blocks), **text)


FIELDS = tuple(f.name for f in dataclasses.fields(Reservation))
"""The hash's fields (HMGET reads only these: a hash stuffed with others costs a reader nothing)."""


def _text(value: bytes, name: str) -> str:
    if len(value) > _MAX_FIELD_BYTES:  # before decoding: a forged hash may hold megabytes
        raise ValueError(f"{name} is {len(value)} bytes")
    try:
        return value.decode()
    except UnicodeDecodeError:
        raise ValueError(f"{name} is not UTF-8") from None
