"""Worker -> every scheduler replica, on ``sb:kv-events:{cell}:<worker>``: what the worker's prefix
cache stored and removed, one batch per engine step; and the worker's snapshot of its whole cache,
in ``sb:kv-snapshot:{cell}:<worker>``, for a scheduler that lost events (docs/routing.md, "KV events").

The event shapes are vLLM's (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``). A block is
named by an opaque hash, written as lowercase hex (at most 64 digits, 256 bits): splitbus's own
chained hash, the same in every engine, so a scheduler compares one worker's blocks with another's
without knowing how they were made. Every batch carries the worker's next event id (1, 2, 3, ...
within one ``instance``, the publisher's lifetime): a scheduler that sees an id jump knows it
missed one and resyncs from the snapshot.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from splitbus.bus.blocks import HEX_FORMAT
from splitbus.bus.core.codec import message
from splitbus.bus.messages._check import require, require_int, require_str

MAX_HASH_HEX = 64
"""Longest block hash, in hex digits (256 bits)."""
MAX_BATCH_EVENTS = 4096
"""Most events in one batch (one engine step's)."""
MAX_BATCH_HASHES = 2**17
"""Most block hashes in one batch, all its events together; a publisher splits a bigger step."""
MAX_SNAPSHOT_HASHES = 3 * 2**20
"""Most block hashes in one snapshot: ~110 MB of JSON at 32 digits a hash (splitbus's own), under
the codec's 128 MiB."""
MIN_BATCH_HASHES = 1024
"""The fewest hashes (and events) a publisher may put in one batch, however small its cache."""
MAX_BLOCK_SIZE = 2**16
"""Largest number of tokens per block."""
MAX_EVENT_ID = 2**53
MAX_DP_RANK = 2**16
_HEX = re.compile(r"[0-9a-f]{1,64}")
_HEX_LIST = re.compile(r"(?:[0-9a-f]{1,64}(?:,[0-9a-f]{1,64})*)?")
_STREAM_ID = re.compile(r"[0-9]{1,20}-[0-9]{1,20}|0")


_HASH_BYTES = MAX_HASH_HEX + 3
"""One hash in a batch's or snapshot's JSON: quoted, and a comma."""
_EVENT_BYTES = 160
"""One event's JSON besides its hashes: a 64-digit parent, the largest block size, the keys."""
_ENVELOPE_BYTES = 4096
"""A batch's or snapshot's JSON besides its events or hashes (ids of 256 characters, escaped)."""


def batch_hashes(total_kv_blocks: int) -> int:
    """The most hashes, and events, one batch of a worker with ``total_kv_blocks`` blocks holds:
    twice its blocks (what one step can evict, then store), at least ``MIN_BATCH_HASHES``, at most
    ``MAX_BATCH_HASHES`` (also for 0: none reported). Its publisher splits a bigger step."""
    if total_kv_blocks <= 0:
        return MAX_BATCH_HASHES
    return min(max(2 * total_kv_blocks, MIN_BATCH_HASHES), MAX_BATCH_HASHES)


def batch_bytes(total_kv_blocks: int) -> int:
    """The largest ``data`` a batch of ``batch_hashes(total_kv_blocks)`` hashes and events can
    have: a reader refuses a larger entry without decoding it."""
    hashes = batch_hashes(total_kv_blocks)
    return _ENVELOPE_BYTES + hashes * _HASH_BYTES + min(hashes, MAX_BATCH_EVENTS) * _EVENT_BYTES


def snapshot_bytes(max_hashes: int) -> int:
    """The largest ``data`` a snapshot of at most ``max_hashes`` hashes can have."""
    return _ENVELOPE_BYTES + max_hashes * _HASH_BYTES


def block_hash(value: int | bytes | str) -> str:
    """A block hash as the events carry it: lowercase hex, from an int (< 2**256), bytes (at most
    32) or a hex string; ValueError for anything else (the engine side's values go through here)."""
    if type(value) is int:
        require(0 <= value < 2 ** (4 * MAX_HASH_HEX), "a block hash must be a non-negative int under 2**256")
        return format(value, HEX_FORMAT)  # splitbus's own (16 bytes) are always 32 digits, as requests carry them
    if isinstance(value, bytes):
        require(0 < len(value) <= MAX_HASH_HEX // 2, "a block hash must be 1 to 32 bytes")
        return value.hex()
    require(isinstance(value, str) and _HEX.fullmatch(value) is not None, f"not a block hash: {value!r:.80}")
    return str(value)


def require_hashes(value: Any, name: str, max_items: int) -> None:
    """A list of at most ``max_items`` block hashes (lowercase hex, 1 to 64 digits): one regex
    over them all (a scheduler validates every batch it reads; one match per hash was 40 % of
    its ingest), the bad one named only when there is one."""
    require(type(value) is list, f"{name} must be a list of block hashes")
    require(len(value) <= max_items, f"{name} must hold at most {max_items} hashes, got {len(value)}")
    if all(type(h) is str for h in value) and _HEX_LIST.fullmatch(",".join(value)) is not None:
        return
    bad = next(h for h in value if not isinstance(h, str) or _HEX.fullmatch(h) is None)
    require(False, f"{name}: not a block hash: {bad!r:.80}")


@dataclass(frozen=True)
class BlockStored:
    """Full blocks the worker's cache now holds, in chain order: ``block_hashes[0]``'s parent is
    ``parent_block_hash``, each later block's parent the one before it."""

    block_hashes: list[str]
    parent_block_hash: str = ""
    """The block before the first one, "" when the first block starts a sequence."""
    block_size: int = 16
    """Tokens in each block (every block is full: only full blocks are hashed)."""
    kind: str = "stored"

    def __post_init__(self) -> None:
        require(self.kind == "stored", "a BlockStored has kind 'stored'")
        require_hashes(self.block_hashes, "block_hashes", MAX_BATCH_HASHES)
        if self.parent_block_hash:
            require_hashes([self.parent_block_hash], "parent_block_hash", 1)
        require_int(self.block_size, "block_size", 1, MAX_BLOCK_SIZE)


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks the worker's cache evicted (it no longer holds them)."""

    block_hashes: list[str]
    kind: str = "removed"

    def __post_init__(self) -> None:
        require(self.kind == "removed", "a BlockRemoved has kind 'removed'")
        require_hashes(self.block_hashes, "block_hashes", MAX_BATCH_HASHES)


@dataclass(frozen=True)
class AllBlocksCleared:
    """The worker's cache was emptied (a reset, or a fresh start)."""

    kind: str = "cleared"

    def __post_init__(self) -> None:
        require(self.kind == "cleared", "an AllBlocksCleared has kind 'cleared'")


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared
_KINDS: dict[str, type[BlockStored] | type[BlockRemoved] | type[AllBlocksCleared]] = {
    "stored": BlockStored,
    "removed": BlockRemoved,
    "cleared": AllBlocksCleared,
}


def _event(value: Any) -> KvEvent:
    """An event as given, or built from its decoded JSON object (by its ``kind``)."""
    if isinstance(value, (BlockStored, BlockRemoved, AllBlocksCleared)):
        return value
    require(isinstance(value, dict), "each event must be an object")
    kind = value.get("kind")
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"unknown event kind {kind!r:.40}")
    fields = {k: value[k] for k in ("block_hashes", "parent_block_hash", "block_size") if k in value}
    try:
        return cls(**fields)
    except TypeError as exc:  # a field missing, or one this kind has not
        raise ValueError(f"{value.get('kind')} event: {exc}") from exc


def hash_count(events: list[KvEvent]) -> int:
    return sum(len(e.block_hashes) for e in events if not isinstance(e, AllBlocksCleared))


@message
@dataclass
class KvEventBatch:
    """One engine step's events of one worker, applied in order."""

    TYPE: ClassVar[str] = "kv_events"
    worker: str
    instance: str
    """The publisher's lifetime (random at its start): event ids count from 1 within it."""
    event_id: int
    """1 for the instance's first batch, then one more per batch: a jump is a lost batch."""
    events: list[KvEvent] = field(default_factory=list)
    dp_rank: int = -1
    """The worker's DP rank, -1 outside a DP group."""

    def __post_init__(self) -> None:
        require_str(self.worker, "worker")
        require_str(self.instance, "instance")
        require_int(self.event_id, "event_id", 1, MAX_EVENT_ID)
        require_int(self.dp_rank, "dp_rank", -1, MAX_DP_RANK)
        require(type(self.events) is list, "events must be a list")
        require(len(self.events) <= MAX_BATCH_EVENTS, f"at most {MAX_BATCH_EVENTS} events, got {len(self.events)}")
        self.events = [_event(e) for e in self.events]
        total = hash_count(self.events)
        require(total <= MAX_BATCH_HASHES, f"at most {MAX_BATCH_HASHES} hashes in a batch, got {total}")


@message
@dataclass
class KvSnapshot:
    """A worker's whole cache after its batch ``event_id`` (0: before any), for a resync."""

    TYPE: ClassVar[str] = "kv_snapshot"
    worker: str
    instance: str
    event_id: int
    stream_id: str
    """The stream entry of batch ``event_id`` ("0" for none): a reader resumes after it."""
    block_hashes: list[str] = field(default_factory=list)
    dp_rank: int = -1

    def __post_init__(self) -> None:
        require_str(self.worker, "worker")
        require_str(self.instance, "instance")
        require_int(self.event_id, "event_id", 0, MAX_EVENT_ID)
        require(isinstance(self.stream_id, str) and _STREAM_ID.fullmatch(self.stream_id) is not None, "bad stream_id")
        require_int(self.dp_rank, "dp_rank", -1, MAX_DP_RANK)
        require_hashes(self.block_hashes, "block_hashes", MAX_SNAPSHOT_HASHES)
