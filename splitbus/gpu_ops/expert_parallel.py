"""Expert parallelism over a DP group: each rank holds 1/N of every MoE layer's experts, and each
MoE layer sends the rank's tokens to the ranks holding their experts and brings the results back.

Built on ``paddle.distributed``'s collectives, one code path for gloo (CPU) and NCCL (GPU). Gloo
has no all-to-all (``alltoall`` raises NotImplementedError on CPU in Paddle 3.3), so dispatch and
combine are made of the two collectives both backends have:

- once per forward, ``begin`` all-gathers every rank's token count;
- **dispatch**: an all-gather of each rank's tokens (hidden state, top-k expert ids and weights
  packed in one float32 row), padded to the largest count (gloo aborts the process on unequal
  shapes); every rank then has the step's tokens of the whole group. float32 because the ids must
  stay exact (bf16 holds integers exactly only to 256) and a bf16 state and weights widen
  exactly, then come back in their own dtype: a bf16 model sends twice the bytes of its state
  for it (gloo carries bf16 itself, in all-gather and all-reduce, on Paddle 3.3's CPU build);
- each rank runs its own experts on the tokens routed to them (``moe.run_experts``): one output
  per (token, slot), zero for slots of experts it does not hold;
- **combine**: an all-reduce (sum) of those outputs; a slot has one holder, so the sum is exact,
  and each rank keeps its own tokens' rows.

An all-to-all sends each token only to its experts' ranks; these send every token to every rank
(N times the bytes). On a GPU an NCCL all-to-all would replace the two behind the same
``dispatch``/``combine`` interface; it has not been built or run here.

A rank with nothing to do in a step still runs a forward (one dummy token), so it joins every
layer's exchange: its idle forward. A rank that dies makes the others' collective raise at once;
one that hangs makes it wait: the worker bounds the forward (``--ep-timeout``), and gloo's own
run timeout (30 s) is the backstop.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import paddle
import paddle.distributed as dist

from splitbus.gpu_ops.moe import Routing

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def expert_shard(count: int, rank: int, size: int) -> range:
    """The experts rank ``rank`` of ``size`` holds: a contiguous share, the first ``count % size``
    ranks one more (8 experts over 3 ranks: 0-2, 3-5, 6-7)."""
    if not 0 <= rank < size <= count:
        raise ValueError(f"{size} expert-parallel ranks need at least as many experts (the model has {count})")
    base, extra = divmod(count, size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


@dataclass(frozen=True)
class Rendezvous:
    """Where the group's ranks meet to form their process group."""

    host: str
    port: int
    """Rank 0's store (``paddle.distributed``'s TCP store)."""
    rank: int
    size: int
    timeout_s: int
    """How long forming may take before it raises."""
    group_id: int = 1
    """Paddle's id of the group within the process (a process that forms again takes a new one)."""


class ExpertGroup:
    """A formed group: the collectives of one rank's MoE layers. Called from the engine's one
    thread, in the same order on every rank (the DP stepper runs one forward per rank per step)."""

    def __init__(self, group: dist.collective.Group, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size
        self.counts: list[int] = []
        """Every rank's tokens in the current forward (``begin``)."""
        self.counted = np.zeros(0, dtype=bool)
        """Which of the forward's gathered tokens count in the experts' loads: not an idle
        forward's dummy token (a balancer would see load that is not there)."""
        self.exchange_s = 0.0
        """Seconds spent in this group's collectives so far: the exchanges' cost, and the waits for
        ranks that reach them later (what the EP benchmark calibrates the sim's model from)."""

    @classmethod
    def form(cls, meet: Rendezvous) -> ExpertGroup:
        """Form the process group (every rank calls it; rank 0's store listens on ``meet.port``)."""
        from paddle.base import core

        os.environ["PADDLE_TRAINER_ID"] = str(meet.rank)  # Paddle reads a group's global rank from it
        if meet.host in LOOPBACK:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # else gloo binds the host name's address
        store = core.TCPStore(meet.host, meet.port, meet.rank == 0, meet.size, meet.timeout_s)
        pg = _process_group(store, meet)
        group = dist.collective.Group(
            meet.rank, meet.group_id, list(range(meet.size)), pg=pg, name=f"ep{meet.group_id}"
        )
        group.store = store  # type: ignore[attr-defined]  # the store must outlive the group
        return cls(group, meet.rank, meet.size)

    def begin(self, tokens: int, counted: bool = True) -> None:
        """Called at the start of each forward: learn every rank's token count, and whether its
        tokens count in the experts' loads (``counted``: False for an idle forward)."""
        started, gathered = time.perf_counter(), list[paddle.Tensor]()
        dist.all_gather(gathered, paddle.to_tensor([tokens, int(counted)], dtype="int64"), group=self.group)
        pairs = [(int(n), bool(flag)) for n, flag in (t.numpy() for t in gathered)]
        self.counts = [n for n, _ in pairs]
        self.counted = np.concatenate([np.full(n, flag) for n, flag in pairs])
        self.exchange_s += time.perf_counter() - started

    def dispatch(self, h: paddle.Tensor, routing: Routing, experts: int) -> tuple[paddle.Tensor, Routing]:
        """Every rank's tokens and their routing (ranks in order), from this rank's, in the dtypes
        of ``h`` and ``routing.weights`` (exchanged in float32: see the module's docstring)."""
        k = routing.experts.shape[1]
        ids = paddle.to_tensor(routing.experts.astype(np.float32))  # exact below 2**24
        packed = paddle.concat([_as(h, paddle.float32), ids, _as(routing.weights, paddle.float32)], axis=1)
        rows = max(self.counts)
        if rows > packed.shape[0]:  # every rank sends the same shape
            packed = paddle.concat([packed, paddle.zeros([rows - packed.shape[0], packed.shape[1]], packed.dtype)])
        started, gathered = time.perf_counter(), list[paddle.Tensor]()
        dist.all_gather(gathered, packed, group=self.group)
        every = paddle.concat([part[:count] for part, count in zip(gathered, self.counts, strict=True)])
        self.exchange_s += time.perf_counter() - started
        hidden = h.shape[1]
        expert_ids = every[:, hidden : hidden + k].numpy().astype(np.int64)
        if expert_ids.size and not (0 <= expert_ids.min() and expert_ids.max() < experts):
            raise RuntimeError(f"an expert exchange carried expert ids outside 0..{experts - 1}")
        weights = _as(every[:, hidden + k :], routing.weights.dtype)
        return _as(every[:, :hidden], h.dtype), Routing(expert_ids, weights)

    def combine(self, outputs: paddle.Tensor) -> paddle.Tensor:
        """This rank's tokens' rows of the group's summed ``run_experts`` outputs."""
        started = time.perf_counter()
        dist.all_reduce(outputs, op=dist.ReduceOp.SUM, group=self.group)
        self.exchange_s += time.perf_counter() - started
        start = sum(self.counts[: self.rank])
        return outputs[start : start + self.counts[self.rank]]


def _as(values: paddle.Tensor, dtype: Any) -> paddle.Tensor:
    """``values`` in ``dtype``: cast only when it differs."""
    return values if values.dtype == dtype else values.astype(dtype)


def _process_group(store: Any, meet: Rendezvous) -> Any:
    """Gloo on the CPU; NCCL where Paddle runs on a GPU (``device.select_device`` chose it). The
    NCCL branch goes through Paddle's own group factory (its arguments differ between versions)
    and has not run here: no GPU build of Paddle was available."""
    from paddle.base import core

    if paddle.get_device().startswith("gpu"):
        from paddle.distributed.collective import _new_process_group_impl

        return _new_process_group_impl("nccl", store, meet.rank, meet.size, f"ep{meet.group_id}", None, meet.group_id)
    return core.ProcessGroupGloo.create(store, meet.rank, meet.size, meet.group_id)
