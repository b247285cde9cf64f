"""The shapes of the Redis replies the bus reads, as its clients get them.

Clients come from ``connection.connect``: RESP2, bytes (no ``decode_responses``), redis-py's own
response callbacks. redis-py 8 types a reply as the union of every shape any client setting could
give (RESP3 maps, decoded strings); the bus's clients get one of them, named here, and each reply
is taken as its shape with ``typing.cast`` where it is read. The aliases document the shapes as
much as they type them: a wrong one shows as a test failure, not only as a type error.
"""

from __future__ import annotations

from typing import TypedDict, cast

from redis.typing import EncodableT, FieldT

EntryFields = dict[bytes, bytes]
"""A stream entry's fields (``type``, ``data``, ``ts``, see codec)."""
Entry = tuple[bytes, EntryFields]
"""One stream entry: its id and fields (XRANGE, XREVRANGE, a new entry of XREADGROUP)."""
MaybeEntry = tuple[bytes, EntryFields | None]
"""An entry re-read from a consumer's pending list, or claimed: Redis 6.2 gives no fields for one
that was trimmed while pending."""
XReadReply = list[tuple[bytes, list[Entry]]]
"""XREAD: (stream, entries) per stream that had entries; redis-py gives None when none had."""
XReadGroupReply = list[tuple[bytes, list[MaybeEntry]]]
"""XREADGROUP (one stream: one item); a history read (id ``0``) may hold trimmed entries."""
RawEntry = tuple[bytes, list[bytes]]
"""An entry as Redis sends it: its id and a flat field, value list (no redis-py callback)."""
RawXReadReply = list[tuple[bytes, list[RawEntry]]]
"""XREAD with redis-py's callback replaced by one that keeps Redis's own nesting (results.py)."""
ScriptEntries = list[RawEntry]
"""Entries a script returns (``claim_from``: what XCLAIM returned inside it)."""
SnapshotReply = tuple[
    list[bytes], list[tuple[bytes, int, list[bytes]]], tuple[bytes, bytes], list[tuple[bytes, list[bytes]]]
]
"""The ``registry_snapshot`` script's: every listed id, (id, lease PTTL, flat record) rows, the
server's TIME, and the registry log's last entry (none: empty)."""


class XPendingRow(TypedDict):
    """One row of XPENDING's extended form (``xpending_range``)."""

    message_id: bytes
    consumer: bytes
    time_since_delivered: int
    times_delivered: int


class XPendingSummary(TypedDict):
    """XPENDING's summary form: ``min`` and ``max`` are None when nothing is pending."""

    pending: int
    min: bytes | None
    max: bytes | None
    consumers: list[dict[str, bytes | int]]


class XInfoConsumer(TypedDict):
    """One row of XINFO CONSUMERS."""

    name: bytes
    pending: int
    idle: int


_XInfoGroupFields = TypedDict("_XInfoGroupFields", {"name": bytes, "pending": int, "last-delivered-id": bytes})


class XInfoGroup(_XInfoGroupFields, total=False):
    """One row of XINFO GROUPS; ``lag`` only from Redis 7.0 (None when Redis cannot tell)."""

    lag: int | None


XAddFields = dict[FieldT, EncodableT]
"""What redis-py's XADD takes. Its dict type is invariant, so a ``dict[bytes, bytes]`` (what
codec.encode returns) is not one to the type checker, though it is one to Redis."""


def for_xadd(fields: EntryFields) -> XAddFields:
    """``fields`` as XADD's argument type (the same dict)."""
    return cast(XAddFields, fields)


def text(value: bytes | str) -> str:
    """An id or a name in a reply, as text (bytes from the bus's clients; ``str`` where a caller
    passed its own)."""
    return value.decode() if isinstance(value, bytes) else value


def pairs(flat: list[bytes], strict: bool = False) -> EntryFields:
    """A field, value list as Redis sends it (a script's reply, a raw ``XREAD``) as redis-py's
    dict; ``strict``: ValueError for an odd-length list, else its last field is dropped."""
    return dict(zip(flat[::2], flat[1::2], strict=strict))


def autoclaim_parts(reply: list[object]) -> tuple[bytes, list[MaybeEntry], list[bytes]]:
    """XAUTOCLAIM's reply: the next cursor, the claimed entries, and (Redis 7.0+; none on 6.2)
    the ids of pending entries that no longer exist."""
    deleted = cast(list[bytes], reply[2]) if len(reply) > 2 else []
    return cast(bytes, reply[0]), cast(list[MaybeEntry], reply[1]), deleted
