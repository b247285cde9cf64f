"""Twins: the choices of one response (``n`` > 1) queued on one prefill worker, which prefill
their prompt once.

The scheduler sends a response's choices to the same P and D (``splitbus.placement.siblings``),
and tells P in each task how many it sent there together (``Task.twins``). On P they are twins:
the same group, salt and tokens, each a request of its own. The first twin of a prefill batch
computes the prompt; each other one is forked from it (``WorkerCore.plan_prefill``,
``Engine.fork``): it shares its blocks and draws its first token from the same last logits with
its own seed, and the engine runs one forward for all. So that they are in one batch, a twin
waits in the queue until that many have come, for at most ``GATHER_S`` after the first of them
came (``Gathering``). Pure: no I/O.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Callable, Hashable, Iterable

from splitbus.bus.roles import Phase
from splitbus.worker.sequence import Sequence

GATHER_S = 0.2
"""The longest twins wait for the others their scheduler sent here with them: they are published
together, placed in one scheduler step and written at once, so they come within milliseconds;
past this (one written late, or not at all) the ones here prefill without the others."""
GROUPS_KEPT = 4096
"""Responses whose first twin's arrival a worker remembers (``Gathering``)."""


def twin_key(seq: Sequence) -> Hashable | None:
    """What twins have in common, or None for a sequence that has none: one that is not a
    prefill task of a choice, or that had generated tokens before (a moved choice). Prompt
    logprobs are part of it: a twin's first entry carries its leader's. The tokens themselves
    are compared where it matters (``same_prompt``): the group is the request's word."""
    request = seq.request
    if request.choices < 2 or seq.task.phase != Phase.PREFILL or seq.task.output_token_ids:
        return None
    return (request.choice_group, request.cache_salt, request.sampling.prompt_logprobs)


def same_prompt(leader: Sequence, twin: Sequence) -> bool:
    """Whether ``twin`` may share ``leader``'s prefill: the very same tokens."""
    return twin.all_tokens == leader.all_tokens


class Gathering:
    """When each response's first twin came to this worker (the core's, which notes each twin as
    it is queued): its twins wait no longer than ``GATHER_S`` after that, however late the
    others come (a late one does not start the wait again)."""

    def __init__(self, kept: int = GROUPS_KEPT) -> None:
        self.kept = kept
        self._first: OrderedDict[Hashable, float] = OrderedDict()

    def note(self, seq: Sequence, now: float) -> None:
        key = twin_key(seq)
        if key is not None and key not in self._first:
            self._first[key] = now
            while len(self._first) > self.kept:
                self._first.popitem(last=False)

    def waiting(self, queued: Iterable[Sequence], now: float) -> set[str]:
        """The request ids of the queued twins that still wait for the others: fewer of them
        are queued here than their tasks say were sent (``Task.twins``), and the first came less
        than ``GATHER_S`` ago."""
        groups: defaultdict[Hashable, list[Sequence]] = defaultdict(list)
        for seq in queued:
            key = twin_key(seq)
            if key is not None:
                groups[key].append(seq)
        waiting: set[str] = set()
        for key, twins in groups.items():
            sent = min(max(s.task.twins for s in twins), twins[0].request.choices)  # bus values: bounded here too
            first = self._first.get(key, min(s.queued_at for s in twins))
            if len(twins) < sent and now - first < GATHER_S:
                waiting.update(s.request_id for s in twins)
        return waiting


class Forks:
    """One prefill plan's twins (``RequestTable.prefill_batch_size``, ``start_prefill``): which
    wait, and which join the batch forked from an earlier twin (``share``: ``Engine.fork``)
    instead of computing. ``share`` None: the engine forks none (``NO_FORKS``)."""

    def __init__(self, waiting: set[str], share: Callable[[Sequence, Sequence], None] | None) -> None:
        self.waiting, self.share = waiting, share
        self._leaders: dict[Hashable, Sequence] = {}

    def waits(self, seq: Sequence) -> bool:
        return seq.request_id in self.waiting

    def fork(self, seq: Sequence) -> bool:
        """Whether ``seq`` joins the batch as a twin of one before it (forked from it now)."""
        seq.fork_of = None
        key, share = twin_key(seq), self.share
        leader = self._leaders.get(key) if key is not None else None
        if share is None or leader is None or not same_prompt(leader, seq):
            return False
        if seq.blocks == 0:
            share(leader, seq)
        elif seq.block_table != leader.block_table:  # blocks of its own: it computes in them
            return False
        # (else it holds the leader's already: their batch was aborted and is planned again)
        seq.fork_of = leader
        return True

    def lead(self, seq: Sequence) -> None:
        """``seq`` computes its prompt in this batch: the twins after it fork from it."""
        key = twin_key(seq)
        if key is not None:
            self._leaders.setdefault(key, seq)

    def cost(self, seq: Sequence, leaders: dict[Hashable, Sequence]) -> int:
        """The tokens ``seq`` adds to a prefill batch: none while it waits for its twins, none
        for a twin of one counted before it (``leaders``, which this adds to) with the same
        tokens and no blocks of its own, which shares its forward; else its uncached tokens."""
        if self.waits(seq):
            return 0
        key = twin_key(seq) if self.share is not None else None
        leader = leaders.setdefault(key, seq) if key is not None else seq
        if leader is not seq and seq.blocks == 0 and same_prompt(leader, seq):
            return 0
        return len(seq.all_tokens) - seq.cached


NO_FORKS = Forks(set(), None)
"""A plan without twins (an engine that forks none; ``start_prefill``'s default)."""


def computing(batch: list[Sequence]) -> tuple[list[Sequence], list[int]]:
    """An engine's view of a prefill batch: the sequences that compute (not forked from one
    before them in it), and for each sequence of the batch the index among those of the one
    whose last logits it draws from. A twin run without its leader (its batch failed and each
    runs alone) computes: it holds the leader's blocks, and writes what the leader wrote; it is
    no twin any more (its ``fork_of`` is cleared: it does not count as one that shared)."""
    rows: list[int] = []
    index: dict[int, int] = {}
    own: list[Sequence] = []
    for seq in batch:
        leader = seq.fork_of
        if leader is not None and id(leader) in index:
            rows.append(index[id(leader)])
            continue
        seq.fork_of = None
        index[id(seq)] = len(own)
        rows.append(len(own))
        own.append(seq)
    return own, rows
