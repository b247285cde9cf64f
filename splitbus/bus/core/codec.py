"""Stream entries <-> message dataclasses, as readable JSON (orjson); never pickle.

An entry has three fields, so ``redis-cli XRANGE`` shows what it carries::

    type  message type tag, e.g. "request", "token"
    data  the message as a JSON object
    ts    publish time, microseconds since the epoch (publish->read latency)
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol, TypeGuard, TypeVar

import orjson

from splitbus.bus.core.errors import DecodeError

Fields = dict[bytes, bytes]
MAX_DATA_BYTES = 128 * 1024 * 1024
"""Largest ``data`` field decoded: a task holding the longest prompt and output the messages
allow is well under it, and a bigger entry is dead-lettered unparsed."""


class Message(Protocol):
    """A dataclass with a ``TYPE`` tag, registered with :func:`message`."""

    TYPE: ClassVar[str]


M = TypeVar("M", bound=Message)
D = TypeVar("D")
"""A message, or a dataclass nested in one (``NESTED``)."""
_REGISTRY: dict[bytes, type[Message]] = {}
"""Every message type by its tag. Filled as the modules that define types are imported, which
``splitbus/bus/__init__.py`` does (the protocols' ``messages`` and the core's ``dead``): it runs
before any of the bus's modules, this one included, so a decode always finds every type."""


def message(cls: type[M]) -> type[M]:
    """Class decorator: register a message dataclass under its ``TYPE`` tag."""
    tag = cls.TYPE.encode()
    if tag in _REGISTRY and _REGISTRY[tag] is not cls:
        raise ValueError(f"message type {cls.TYPE!r} registered twice")
    _REGISTRY[tag] = cls
    return cls


def now_us() -> int:
    return time.time_ns() // 1000


def encode(msg: Message) -> Fields:
    """The stream fields for one message."""
    kind, data, ts = script_argv(msg)
    return {b"type": kind, b"data": data, b"ts": ts}


def script_argv(msg: Message) -> tuple[bytes, bytes, bytes]:
    """The values of one message's fields, in entry order (``type``, ``data``, ``ts``): the
    ARGV of a script that writes the entry itself (dispatch's tasks, a step's results)."""
    return msg.TYPE.encode(), orjson.dumps(msg), str(now_us()).encode()


def decode(fields: Mapping[bytes, bytes]) -> Message:
    """The message held by one entry's fields; :class:`DecodeError` says why not."""
    cls = _REGISTRY.get(fields.get(b"type", b""))
    if cls is None:
        raise DecodeError(f"unknown message type {fields.get(b'type')!r}")
    raw = fields.get(b"data", b"")
    if len(raw) > MAX_DATA_BYTES:
        raise DecodeError(f"{cls.TYPE}: data is {len(raw)} bytes, more than {MAX_DATA_BYTES}")
    try:
        data = orjson.loads(fields[b"data"])
    except (KeyError, orjson.JSONDecodeError) as exc:
        raise DecodeError(f"{cls.TYPE}: data is not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise DecodeError(f"{cls.TYPE}: data must be a JSON object")
    return from_dict(cls, data)


def from_dict(cls: type[D], data: Mapping[str, Any]) -> D:
    """Build a message from decoded JSON, checking that required fields are there.

    Unknown keys are ignored so that newer producers can add fields. Messages validate their
    own values in ``__post_init__`` (raising ValueError or TypeError).
    """
    names, nested = _shape(cls)
    kwargs = {name: data[name] for name in names if name in data}
    try:
        for name, sub in nested:
            if isinstance(kwargs.get(name), dict):
                kwargs[name] = from_dict(sub, kwargs[name])
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise DecodeError(f"{getattr(cls, 'TYPE', cls.__name__)}: {exc}") from exc


_Shape = tuple[tuple[str, ...], tuple[tuple[str, type], ...]]
_SHAPES: dict[type, _Shape] = {}


def _shape(cls: type) -> _Shape:
    """Field names and nested message fields of a class, computed once (decode is hot)."""
    shape = _SHAPES.get(cls)
    if shape is None:
        names = tuple(f.name for f in dataclasses.fields(cls))
        shape = _SHAPES[cls] = names, tuple(getattr(cls, "NESTED", {}).items())
    return shape


@dataclasses.dataclass(frozen=True)
class NamedRequest:
    """A request an undecodable entry names plainly: whom to tell it failed."""

    request_id: str
    reader: str
    """The reader shard of its result stream (``reader``, else ``api_node``: its tag)."""


def undecoded(fields: Mapping[bytes, bytes]) -> dict[str, Any] | None:
    """The JSON object in the ``data`` of an entry that failed to decode, if it holds one (and
    within ``MAX_DATA_BYTES``): what can still be made out of it, such as whom to tell."""
    raw = fields.get(b"data", b"")
    try:
        data = orjson.loads(raw) if len(raw) <= MAX_DATA_BYTES else None
    except orjson.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


def data_size(fields: Mapping[bytes, bytes]) -> int:
    """The bytes of an entry's ``data``: a reader with a tighter bound than ``MAX_DATA_BYTES``
    checks it before it decodes."""
    return len(fields.get(b"data", b""))


def as_text(fields: Mapping[bytes, bytes]) -> tuple[str, str]:
    """An entry's ``type`` and ``data`` as text, undecoded (what a dead letter keeps of it)."""
    return fields.get(b"type", b"").decode(errors="replace"), fields.get(b"data", b"").decode(errors="replace")


def flat(fields: Mapping[str, str | int | bytes]) -> Fields:
    """A flat entry: one field per value (an integer in decimal), not a message. The registry
    log, a DP group's plans and a result reader's wake-ups are flat: their readers take them
    field by field (``flat_text``) or only need them to be there."""
    return {name.encode(): value if isinstance(value, bytes) else str(value).encode() for name, value in fields.items()}


def flat_text(fields: Mapping[bytes, bytes]) -> dict[str, str]:
    """A flat entry's fields as text (UnicodeDecodeError, a ValueError, for one not UTF-8)."""
    return {name.decode(): value.decode() for name, value in fields.items()}


def request_named_by(fields: Mapping[bytes, bytes]) -> NamedRequest | None:
    """The request an entry that failed to decode names (``request_id``, or ``request.request_id``
    for a task, with its ``reader`` or ``api_node``), if it names one plainly: its client is then
    told, instead of waiting for its deadline. None when there is no such id to trust."""
    data = undecoded(fields)
    if isinstance(data, dict) and isinstance(data.get("request"), dict):
        data = data["request"]
    if not isinstance(data, dict):
        return None
    request_id, reader = data.get("request_id"), data.get("reader") or data.get("api_node")
    if _plain(request_id) and _plain(reader) and ":" not in reader:
        return NamedRequest(request_id, reader)
    return None


def _plain(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and _PLAIN_ID.fullmatch(value) is not None


_PLAIN_ID = re.compile(r"[A-Za-z0-9._:-]{1,256}")
"""Ids this module trusts to name a result stream: no braces (they would move the key's hash
tag), no spaces or control characters (and no colon in a reader: it is a tag)."""


def published_us(fields: Mapping[bytes, bytes]) -> int | None:
    """The entry's publish time, or None if absent or malformed."""
    try:
        return int(fields[b"ts"])
    except (KeyError, ValueError):
        return None
