"""Typed views of what the worker tests write to and read from Redis: redis-py types commands'
arguments and replies loosely (a union of every form), so the tests say the shape they use."""

from __future__ import annotations

from typing import cast

import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT

from splitbus.bus.core import codec
from splitbus.bus.core.codec import Message

StreamEntries = list[tuple[bytes, dict[bytes, bytes]]]
"""XRANGE's reply on a client that does not decode: [(entry id, fields)]."""


def fields(message: Message) -> dict[FieldT, EncodableT]:
    """``message`` as the fields of a stream entry."""
    return dict(codec.encode(message).items())


async def add(redis: aioredis.Redis, stream: str, message: Message) -> str:
    """XADD ``message``; its entry id."""
    return cast(bytes, await redis.xadd(stream, fields(message))).decode()


async def entries(redis: aioredis.Redis, stream: str) -> StreamEntries:
    return cast(StreamEntries, await redis.xrange(stream))


async def decoded(redis: aioredis.Redis, stream: str) -> list[object]:
    """The messages of ``stream``, oldest first."""
    return [codec.decode(f) for _, f in await entries(redis, stream)]
