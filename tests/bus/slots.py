"""Key names as docs/bus.md writes them, real key names for sample ids, and the hash slots of the
keys a Redis command touches: what the slot checks in test_scripts, test_keys and the suite-wide
``one_slot_per_command`` fixture (tests/conftest.py) share."""

from __future__ import annotations

import inspect
import re
from collections.abc import Sequence

import pytest
from redis.asyncio.connection import AbstractConnection
from redis.crc import key_slot

from splitbus.bus.core.keys import Keys

BUILDERS: dict[str, object] = {
    name: member
    for name, member in inspect.getmembers(Keys)
    if isinstance(member, property) or (inspect.isfunction(member) and not name.startswith("_") and name != "kind")
}
"""Every key builder of ``Keys``, by name (a property or a method)."""


def _params(builder: object) -> list[str]:
    return [] if not callable(builder) else list(inspect.signature(builder).parameters)[1:]


def build(name: str, keys: Keys, *ids: str) -> str:
    """The key ``keys.<name>(*ids)`` (or the property ``keys.<name>``)."""
    member = getattr(keys, name)
    return member if isinstance(member, str) else member(*ids)


def doc_name(name: str) -> str:
    """The name docs/bus.md gives builder ``name``'s key: the cell written ``{cell}``, each argument
    by its parameter, ``{reader}`` where it is a tag and ``<request>`` where it follows the tag
    (``out(reader, request)`` -> ``sb:out:{reader}:<request>``)."""
    built = build(name, Keys(cell="cell"), *[f"<{p}>" for p in _params(BUILDERS[name])])
    return re.sub(r"\{<(\w+)>\}", r"{\1}", built)


def key_names() -> dict[str, str]:
    """Every builder's name -> its key's name in docs/bus.md."""
    return {name: doc_name(name) for name in BUILDERS}


def sample(doc: str, keys: Keys, ids: dict[str, str]) -> str:
    """The real key docs/bus.md's name ``doc`` stands for, with ``ids[param]`` for each argument
    (the cell is ``keys``' own)."""
    (name,) = [n for n, named in key_names().items() if named == doc]
    return build(name, keys, *[ids[p] for p in _params(BUILDERS[name])])


def _bytes(value: object) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def keys_of(command: Sequence[object]) -> list[bytes] | None:
    """The keys of a command that must lie in one slot (a script's KEYS, the streams of an
    ``XREAD``/``XREADGROUP``); None for any other command."""
    name = _bytes(command[0]).upper() if command else b""
    if name in (b"EVAL", b"EVALSHA"):
        return [_bytes(k) for k in command[3 : 3 + int(_bytes(command[2]))]]
    if name in (b"XREAD", b"XREADGROUP"):
        args = [_bytes(a) for a in command]
        rest = args[[a.upper() for a in args].index(b"STREAMS") + 1 :]
        return rest[: len(rest) // 2]
    return None


def slots(keys: Sequence[bytes | str]) -> set[int]:
    """The hash slots of ``keys`` (Redis Cluster's CRC16 of each key's tag)."""
    return {key_slot(k if isinstance(k, bytes) else k.encode()) for k in keys}


PACK = AbstractConnection.pack_command
"""redis-py's own, taken before any test patches it."""


def watch_slots(monkeypatch: pytest.MonkeyPatch) -> list[list[bytes]]:
    """Record the keys of every command an asyncio client packs for the wire (in this process)
    whose keys span hash slots, in the list returned, from now to the test's end: what
    ``one_slot_per_command`` asserts empty. A second watch in a test replaces the first."""
    crossing: list[list[bytes]] = []

    def checked(self: AbstractConnection, *args: object) -> list[bytes]:
        keys = keys_of(args)
        if keys and len(slots(keys)) > 1:
            crossing.append(keys)
        return PACK(self, *args)  # type: ignore[arg-type]  # the args redis-py packs, passed on as they came

    monkeypatch.setattr(AbstractConnection, "pack_command", checked)
    return crossing
