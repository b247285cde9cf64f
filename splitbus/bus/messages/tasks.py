"""Scheduler -> worker, on ``sb:tasks:{cell}:<worker>``."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import orjson

from splitbus.bus.core.codec import message
from splitbus.bus.messages._check import (
    MAX_CHOICES,
    MAX_KV_BLOCKS,
    MAX_SEQ,
    MAX_TOKENS,
    require,
    require_int,
    require_int_list,
    require_str,
    require_traceparent,
)
from splitbus.bus.messages.requests import GenerateRequest
from splitbus.bus.roles import PHASES, Phase

RESERVED_NAMES = ("prefill tokens", "requests", "KV blocks")
_RESERVED_LABELS = tuple(f"reserved {name}" for name in RESERVED_NAMES)
MAX_RANKS = 4096


@message
@dataclass
class Task:
    """One phase of one request for one worker.

    ``prefill``: compute the prompt's KV, publish the first token, ship the KV to ``peer`` (the
    decode worker). ``decode``: reserve KV blocks, wait for ``peer``'s transfer, then decode.
    ``mixed``: both on this worker. ``first_seq`` and ``output_token_ids`` let a request that
    already streamed tokens continue where it stopped.
    """

    TYPE: ClassVar[str] = "task"
    NESTED: ClassVar[dict[str, type]] = {"request": GenerateRequest}

    phase: str
    request: GenerateRequest
    peer: str = ""
    first_seq: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    batch_id: str = ""
    """dp mode with staggering: the release batch this task came in..."""
    batch_ranks: int = 0
    """...and how many ranks that batch went to, so the ranks can start its prefills together."""
    reserved: list[int] = field(default_factory=lambda: [0, 0, 0])
    """What the scheduler reserved on this worker for the task (prefill tokens, requests, KV
    blocks); the worker gives exactly this back when it takes the task."""
    handoff: str = ""
    """Random per dispatch, the same in its prefill and decode tasks: D writes it into its KV
    reservation and P sends only to the reservation of its own dispatch. A request moved to
    another pair (or the same pair again) has a new one, so a reservation left by an older
    dispatch is never taken for the new one."""
    twins: int = 1
    """A prefill task of a choice (``GenerateRequest.choices`` > 1): how many of its response's
    choices its scheduler sent to this worker together, this one included. P waits for that
    many (a short while at most) to prefill their prompt once (docs/api.md, "n"). 1: none."""
    traceparent: str = ""
    """The W3C ``traceparent`` of the span that placed the task (the scheduler's
    ``scheduler.place`` or the reaper's ``scheduler.move``): the parent of the worker's spans.
    Empty: not traced."""

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}")
        require(isinstance(self.request, GenerateRequest), "request must be an object")
        require_str(self.peer, "peer", nonempty=self.phase != Phase.MIXED)
        require_int(self.first_seq, "first_seq", minimum=0, maximum=MAX_SEQ)
        require_int_list(self.output_token_ids, "output_token_ids")
        require_str(self.batch_id, "batch_id", nonempty=False)
        require_int(self.batch_ranks, "batch_ranks", minimum=0, maximum=MAX_RANKS)
        require(type(self.reserved) is list and len(self.reserved) == 3, "reserved must hold 3 numbers")
        require_str(self.handoff, "handoff", nonempty=False, max_chars=64)
        require_int(self.twins, "twins", minimum=1, maximum=MAX_CHOICES)
        require_traceparent(self.traceparent)
        for value, name, most in zip(self.reserved, _RESERVED_LABELS, (MAX_TOKENS, 1, MAX_KV_BLOCKS), strict=True):
            require_int(value, name, minimum=0, maximum=most)


class RequestJson:
    """The JSON of the requests a dispatch's tasks carry, each encoded once however many tasks
    carry it (a decision's prefill and decode task carry one request: issue 40)."""

    def __init__(self) -> None:
        self._encoded: dict[int, tuple[GenerateRequest, orjson.Fragment]] = {}

    def of(self, request: GenerateRequest) -> orjson.Fragment:
        # keyed by identity, the request kept alongside so that its id is not reused meanwhile
        found = self._encoded.get(id(request))
        if found is None:
            found = self._encoded[id(request)] = (request, orjson.Fragment(orjson.dumps(request)))
        return found[1]


_TASK_FIELDS = tuple(f.name for f in fields(Task))


def task_json(task: Task, requests: RequestJson) -> bytes:
    """The task's entry ``data``, byte for byte as ``orjson.dumps(task)`` gives it (the fields in
    their order), its request's JSON from ``requests`` rather than encoded again."""
    data: dict[str, Any] = {name: getattr(task, name) for name in _TASK_FIELDS}
    data["request"] = requests.of(task.request)  # keeps its place among the keys
    return orjson.dumps(data)
