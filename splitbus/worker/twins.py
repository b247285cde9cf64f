"""Twins: the choices of one response (``n`` > 1) queued on one prefill worker, which prefill
their prompt once.

The scheduler sends a response's choices to the same P and D (``splitbus.placement.siblings``).
On P they are twins: the same group, salt and tokens, each a request of its own. The first
twin of a prefill batch computes the prompt; each other one is forked from it
(``WorkerCore.plan_prefill``, ``Engine.fork``): it shares its blocks and draws its first token
from the same last logits with its own seed, and the engine runs one forward for all. So that
they are in one batch, a twin waits in the queue until all its response's choices have come
here, for at most ``GATHER_S`` (0.2 s) after the first came (a choice placed elsewhere is not waited
for longer). Pure: no I/O.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable

from splitbus.bus.roles import Phase
from splitbus.worker.sequence import Sequence

GATHER_S = 0.2
"""The longest a twin waits for its response's other choices: they are published together and
placed in one scheduler step, and arrive within milliseconds; past this (one placed elsewhere,
whose decode worker had no room) the ones here prefill without the others."""


def twin_key(seq: Sequence) -> Hashable | None:
    """What twins have in common, or None for a sequence that has none: one that is not a
    prefill task of a choice, or that had generated tokens before (a moved choice). Prompt
    logprobs are part of it: a twin's first entry carries its leader's. The tokens themselves
    are compared when a twin is forked (``same_prompt``): the group is the request's word."""
    request = seq.request
    if request.choices < 2 or seq.task.phase != Phase.PREFILL or seq.task.output_token_ids:
        return None
    return (request.choice_group, request.cache_salt, request.sampling.prompt_logprobs)


def same_prompt(leader: Sequence, twin: Sequence) -> bool:
    """Whether ``twin`` may share ``leader``'s prefill: the very same tokens."""
    return twin.all_tokens == leader.all_tokens


def gathering(queued: Iterable[Sequence], now: float) -> set[str]:
    """The request ids of the queued twins that still wait for their other choices: fewer of
    them are queued here than the response has, and the first came less than ``GATHER_S`` ago."""
    groups: defaultdict[Hashable, list[Sequence]] = defaultdict(list)
    for seq in queued:
        key = twin_key(seq)
        if key is not None:
            groups[key].append(seq)
    waiting: set[str] = set()
    for twins in groups.values():
        if len(twins) < twins[0].request.choices and now - min(s.queued_at for s in twins) < GATHER_S:
            waiting.update(s.request_id for s in twins)
    return waiting


class Forks:
    """One prefill plan's twins (``RequestTable.start_prefill``): which wait, and which join the
    batch forked from an earlier twin (``share``: ``Engine.fork``) instead of computing."""

    def __init__(self, waiting: set[str], share: Callable[[Sequence, Sequence], None]) -> None:
        self.waiting, self.share = waiting, share
        self._leaders: dict[Hashable, Sequence] = {}

    def waits(self, seq: Sequence) -> bool:
        return seq.request_id in self.waiting

    def fork(self, seq: Sequence) -> bool:
        """Whether ``seq`` joins the batch as a twin of one before it (forked from it now)."""
        key = twin_key(seq)
        leader = self._leaders.get(key) if key is not None else None
        seq.fork_of = None
        if leader is None or not same_prompt(leader, seq):
            return False
        if seq.blocks == 0:
            self.share(leader, seq)
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


NO_FORKS = Forks(set(), lambda _, __: None)
"""A plan without twins (what ``start_prefill`` does by default)."""


def batch_cost(seq: Sequence, seen: set[Hashable]) -> int:
    """The tokens ``seq`` adds to a prefill batch: none for a twin of one counted before it
    (``seen``, which this adds to), which shares its forward."""
    key = twin_key(seq)
    if key is not None and key in seen:
        return 0
    if key is not None:
        seen.add(key)
    return len(seq.all_tokens) - seq.cached


def computing(batch: list[Sequence]) -> tuple[list[Sequence], list[int]]:
    """An engine's view of a prefill batch: the sequences that compute (not forked from one
    before them in it), and for each sequence of the batch the index among those of the one
    whose last logits it draws from. A twin run without its leader (its batch failed and each
    runs alone) computes: it holds the leader's blocks, and writes what the leader wrote."""
    rows: list[int] = []
    index: dict[int, int] = {}
    own: list[Sequence] = []
    for seq in batch:
        leader = seq.fork_of
        if leader is not None and id(leader) in index:
            rows.append(index[id(leader)])
            continue
        index[id(seq)] = len(own)
        rows.append(len(own))
        own.append(seq)
    return own, rows
