"""Prefix caching: a pool of KV block ids with reference counts and an LRU of cached free blocks.

Every engine with a prefix cache holds its blocks in a ``BlockPool`` through ``PagedBlocks``,
the ``Engine`` methods that reserve, share and release them (the sim engine's blocks are ids
only). A full block whose KV is computed is registered under its hash (``splitbus.bus.blocks``);
when no sequence holds it any more it stays cached in an LRU of free blocks, and is evicted (its
hash forgotten) only when an allocation finds no plain free block. A new sequence takes the
cached blocks of its prompt's leading full blocks (shared, ref-counted) and computes only the
rest; at least its last prompt token is always computed, for its logits. What the cache stores
and evicts is recorded, in order, as KV events (``BlockStored``, ``BlockRemoved``) in the pool's
:class:`KvEventLog` (``interface.py``), which the worker publishes (docs/routing.md, "KV
events"). A sequence's chain starts at its request's salt (``GenerateRequest.cache_salt``, the
``root`` the pool's methods take): the API's salt, so one tenant's prompt never finds another's
blocks. Pure: no paddle, no Redis.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitbus.bus.blocks import ROOT, block_hashes, root_of
from splitbus.bus.messages.kv_events import BlockRemoved, BlockStored, block_hash
from splitbus.bus.roles import Phase
from splitbus.worker.engines.interface import KvEventLog
from splitbus.worker.sequence import scores_prompt

if TYPE_CHECKING:
    from splitbus.bus.messages import GenerateRequest, Task
    from splitbus.worker.sequence import Sequence as SequenceState


@dataclass(frozen=True)
class Allocation:
    """What ``BlockPool.allocate`` gave a sequence."""

    table: list[int]
    """Its block table: the cached blocks first, then new ones."""
    cached_tokens: int
    """Leading positions whose KV was already cached (a multiple of the block size)."""


class BlockPool:
    def __init__(self, block_ids: Sequence[int], block_size: int, extra: str = "") -> None:
        self.block_size, self.extra = block_size, extra
        self.total = len(block_ids)
        self._plain = list(reversed(block_ids))  # free, holding nothing; popped from the end
        self._lru: OrderedDict[int, None] = OrderedDict()  # free but cached, oldest first
        self._refs: dict[int, int] = {}
        self._by_hash: dict[int, int] = {}
        self._hash_of: dict[int, int] = {}
        self.events = KvEventLog()
        """What the cache stored and evicted, for the worker to publish: one ``BlockRemoved`` per
        allocation that evicted, one ``BlockStored`` per contiguous run a ``store`` registered."""

    @property
    def free(self) -> int:
        """Blocks an allocation may take: plain free ones and cached ones no sequence holds."""
        return len(self._plain) + len(self._lru)

    @property
    def cached_blocks(self) -> int:
        return len(self._by_hash)

    def match(self, tokens: Sequence[int], root: int = ROOT) -> list[int]:
        """Cached blocks of the leading full blocks of ``tokens`` (its chain salted by ``root``),
        leaving its last token uncached."""
        usable = max(len(tokens) - 1, 0)
        found: list[int] = []
        for h in block_hashes(tokens[:usable], self.block_size, self.extra, root):
            block = self._by_hash.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def fits(self, count: int, prompt: Sequence[int] = (), root: int = ROOT) -> bool:
        """Whether ``allocate(count, prompt, root)`` would succeed now (nothing is taken)."""
        hits = self.match(prompt, root)[:count]
        return self._room(count - len(hits), hits)

    def _room(self, fresh: int, hits: list[int]) -> bool:
        """Whether ``fresh`` blocks can be taken besides ``hits``: plain free ones, and cached free
        ones that are not among the hits."""
        in_lru = sum(1 for b in set(hits) if b in self._lru)  # O(hits): the LRU can hold thousands
        return fresh <= len(self._plain) + len(self._lru) - in_lru

    def allocate(self, count: int, prompt: Sequence[int] = (), root: int = ROOT) -> Allocation | None:
        """``count`` blocks for a sequence, the first ones cached blocks of ``prompt`` (salted by
        ``root``) where they match; None (nothing taken) when there is no room."""
        hits = self.match(prompt, root)[:count]
        fresh = count - len(hits)
        if not self._room(fresh, hits):
            return None
        for block in hits:
            self._hold(block)
        evicted: list[int] = []
        table = hits + [self._take(evicted) for _ in range(fresh)]
        for block in table[len(hits) :]:
            self._refs[block] = 1
        if evicted:
            self.events.add(BlockRemoved([block_hash(h) for h in evicted]))
        return Allocation(table, len(hits) * self.block_size)

    def rematch(self, table: list[int], tokens: Sequence[int], cached: int, root: int = ROOT) -> int:
        """Before a sequence's prefill: its leading blocks past the ``cached`` positions that are
        cached now (stored since it reserved: a sibling with the same prefix prefilled first)
        replace its own fresh ones in ``table``, which go back to the free blocks. Returns the
        positions cached now (a multiple of the block size, at least ``cached``)."""
        hits = self.match(tokens, root)
        start = cached // self.block_size
        for i in range(start, min(len(hits), len(table))):
            if table[i] != hits[i]:
                self._hold(hits[i])
                self.release([table[i]])
                table[i] = hits[i]
        return max(cached, min(len(hits), len(table)) * self.block_size)

    def first_to_compute(self, tokens: Sequence[int], cached: int, root: int = ROOT) -> int | None:
        """The hash of the first full block a prefill of ``tokens`` with ``cached`` positions
        cached computes (None: it computes no full block other sequences could share). Two
        sequences in one prefill batch with the same one would both compute it: the second is
        better off a step later, when the first has stored it."""
        end = (cached // self.block_size + 1) * self.block_size
        if end > len(tokens) - 1:
            return None
        return block_hashes(tokens[:end], self.block_size, self.extra, root)[-1]

    def store(self, table: Sequence[int], tokens: Sequence[int], root: int = ROOT) -> list[int]:
        """Register the full blocks of ``tokens`` (positions whose KV is computed, under
        ``table``) by hash, the chain salted by ``root``; returns the hashes newly stored. A block
        whose hash another block already holds stays unregistered (it is freed plain). Each
        contiguous run of newly stored blocks is recorded as one ``BlockStored``, its parent the
        chain's block before it ("" at the sequence's start, salted or not)."""
        stored: list[int] = []
        run: list[int] = []
        parent: int | None = None  # the chain's hash before the current block (None: its start)
        run_parent: int | None = None
        for block, h in zip(table, block_hashes(tokens, self.block_size, self.extra, root), strict=False):
            if h in self._by_hash or block in self._hash_of:
                self._record_stored(run, run_parent)
                run = []
            else:
                self._by_hash[h], self._hash_of[block] = block, h
                stored.append(h)
                run_parent = parent if not run else run_parent
                run.append(h)
            parent = h
        self._record_stored(run, run_parent)
        return stored

    def _record_stored(self, run: list[int], parent: int | None) -> None:
        if run:
            first = "" if parent is None else block_hash(parent)
            self.events.add(BlockStored([block_hash(h) for h in run], first, self.block_size))

    def release(self, table: Sequence[int]) -> None:
        """A sequence lets go of its blocks; cached ones join the LRU (the last block freed is
        the newest, so a prefix's later blocks go before its first)."""
        for block in reversed(table):
            self._refs[block] -= 1
            if self._refs[block] > 0:
                continue
            del self._refs[block]
            if block in self._hash_of:
                self._lru[block] = None
            else:
                self._plain.append(block)

    def share(self, table: Sequence[int]) -> None:
        """Another sequence holds these blocks too (a twin forked from the one holding them)."""
        for block in table:
            self._hold(block)

    def _hold(self, block: int) -> None:
        self._lru.pop(block, None)
        self._refs[block] = self._refs.get(block, 0) + 1

    def _take(self, evicted: list[int]) -> int:
        """A free block: a plain one, else the least recently freed cached one, whose hash is
        forgotten (appended to ``evicted``)."""
        if self._plain:
            return self._plain.pop()
        block, _ = self._lru.popitem(last=False)
        h = self._hash_of.pop(block)
        del self._by_hash[h]
        evicted.append(h)
        return block


def chain_root(request: GenerateRequest) -> int:
    """The parent of the first block of ``request``'s chain: its salt's (``root_of``)."""
    return root_of(request.cache_salt)


def reuses_prefix(seq: SequenceState) -> bool:
    """Whether a sequence may take cached blocks (``_reuses``)."""
    return _reuses(seq.task)


def _reuses(task: Task) -> bool:
    """Not a decode task, whose KV comes whole from its prefill worker and is written over its
    blocks; nor one whose prefill computes its prompt's logprobs (``Sequence.prompt_top``), which
    need the logits of every prompt position: that prefill computes the whole prompt (and
    stores its blocks for others, as any prefill does). A moved request that had generated
    tokens computes none, and reuses what is cached."""
    return task.phase != Phase.DECODE and not scores_prompt(task)


def _prompt(task: Task) -> list[int]:
    """The tokens whose KV a task's prefill may find cached (none where it may take none)."""
    return task.request.prompt_token_ids + task.output_token_ids if _reuses(task) else []


def _kv_tokens(seq: SequenceState, length: int) -> list[int]:
    """The tokens of the first ``length`` positions a decode task's KV frame holds: its prompt,
    then what it generated before it moved here (``Task.output_token_ids``)."""
    return (seq.request.prompt_token_ids + seq.task.output_token_ids)[:length]


class PagedBlocks:
    """The KV blocks of an engine with a prefix cache: the ``Engine`` methods that reserve, share
    and release them, over one ``BlockPool``. Every such engine (sim, paddle) subclasses it and
    adds its forwards; it calls ``take_new_hits`` before a prefill reads the block tables and
    ``store_computed`` after, on the thread that calls the other methods (the pool has one)."""

    def __init__(self, block_ids: Sequence[int], block_size: int) -> None:
        self.pool = BlockPool(block_ids, block_size)
        self.block_size = block_size
        self.total_blocks = len(block_ids)
        self.kv_events = self.pool.events

    @property
    def free_blocks(self) -> int:
        return self.pool.free

    def reserve(self, seq: SequenceState, tokens: int) -> bool:
        prompt = seq.all_tokens if reuses_prefix(seq) else []
        got = self.pool.allocate(-(-tokens // self.block_size), prompt, chain_root(seq.request))
        if got is None:
            return False
        seq.block_table, seq.blocks = got.table, len(got.table)
        seq.cached = seq.prompt_cached = got.cached_tokens
        return True

    def can_reserve(self, task: Task, tokens: int) -> bool:
        return self.pool.fits(-(-tokens // self.block_size), _prompt(task), chain_root(task.request))

    def cached_prefix(self, task: Task) -> int:
        return len(self.pool.match(_prompt(task), chain_root(task.request))) * self.block_size

    def release(self, seq: SequenceState) -> None:
        self.pool.store(seq.block_table, seq.all_tokens[: seq.cached], chain_root(seq.request))
        self.pool.release(seq.block_table)
        seq.block_table, seq.blocks = [], 0

    def fork(self, leader: SequenceState, twin: SequenceState) -> None:
        """``twin`` holds ``leader``'s blocks as they are (each counted once more) and its cached
        positions: it is prefilled by ``leader``'s forward (``splitbus.worker.twins``). On a
        prefill worker nothing writes to them after that forward: the twin hands them off."""
        self.pool.share(leader.block_table)
        twin.block_table, twin.blocks = list(leader.block_table), leader.blocks
        twin.cached, twin.prompt_cached = leader.cached, leader.prompt_cached

    def share_imported(self, seq: SequenceState, length: int) -> int:
        """Before a decode task's KV is written: the full blocks of its first ``length``
        positions that this worker's cache holds (an earlier choice of its response, or any
        request of its salt with that prefix) replace its own, which go back to the pool. Returns
        the positions it shares, whose KV the import does not write: full blocks it never writes
        to either (its next position is past them; ``BlockPool.match`` leaves the last one out)."""
        return self.pool.rematch(seq.block_table, _kv_tokens(seq, length), 0, chain_root(seq.request))

    def store_imported(self, seq: SequenceState, length: int) -> None:
        """After a decode task's KV is written: its full blocks, for the next to share."""
        self.pool.store(seq.block_table, _kv_tokens(seq, length), chain_root(seq.request))

    def first_to_compute(self, seq: SequenceState) -> int | None:
        """A sequence that holds no blocks yet would take the cached blocks of its prompt as
        they are now."""
        if not reuses_prefix(seq):
            return None
        salt = chain_root(seq.request)
        cached = seq.cached if seq.blocks else len(self.pool.match(seq.all_tokens, salt)) * self.block_size
        return self.pool.first_to_compute(seq.all_tokens, cached, salt)

    def take_new_hits(self, batch: list[SequenceState]) -> None:
        """Before a prefill: the blocks of each prompt stored since it reserved (``rematch``)
        become its own; they count as cached prompt tokens in its usage."""
        for seq in batch:
            if reuses_prefix(seq):
                seq.cached = self.pool.rematch(seq.block_table, seq.all_tokens, seq.cached, chain_root(seq.request))
                seq.prompt_cached = max(seq.prompt_cached, min(seq.cached, seq.prompt_len))

    def store_computed(self, batch: list[SequenceState]) -> None:
        """After a prefill: register the full blocks it computed, for later prompts to share."""
        for seq in batch:
            self.pool.store(seq.block_table, seq.all_tokens, chain_root(seq.request))
