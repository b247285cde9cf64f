"""A follower of many streams: entries after an explicit last id of each, in one ``XREAD``.

The one place a stream is followed without a consumer group, on a single Redis or a cluster
(``cluster.xread``: there sent to the primary of the streams' slot, which they must share). A
follower always names the id it read up to, never ``$``, so a read after a reconnect misses
nothing written meanwhile. Who follows what: a registry view its log, a cancel listener the
cancel stream, a DP rank its group's plans, a scheduler replica every worker's KV events, a
control call its reply, a result reader's shard its requests' result streams (``read_reply``:
the reply as its client's response callback makes it, which the shard's keeps as Redis sent
it, with no work per entry on the token path).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import redis.asyncio as aioredis

from splitbus.bus.core import cluster
from splitbus.bus.core.replies import EntryFields, XReadReply, text

Followed = tuple[str, str, EntryFields]
"""One entry read: its stream, its id, its fields."""


async def read_after(
    redis: aioredis.Redis, cursors: Mapping[str, str], count: int, block_ms: int | None
) -> list[Followed]:
    """The entries after each stream's id in ``cursors`` ("0": from the start), at most ``count``
    per stream, in stream order; ``block_ms``: wait that long for one (None: not at all; 0: 1 ms,
    never Redis's "forever")."""
    if not cursors:
        return []
    reply = cast(XReadReply, await cluster.xread(redis, cursors, count, block_ms) or [])
    return [(text(key), text(entry_id), fields) for key, entries in reply for entry_id, fields in entries]


async def read_reply(
    redis: aioredis.Redis, cursors: Mapping[str, str], count: int, block_ms: int | None
) -> Any:  # the shape is the client's XREAD response callback's (replies.XReadReply by default)
    """The read of ``read_after``, its reply as the client's response callback makes it (None:
    nothing read): for a reader that takes the entries apart itself, nothing done per entry here."""
    return await cluster.xread(redis, cursors, count, block_ms)
