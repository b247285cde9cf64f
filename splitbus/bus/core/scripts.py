"""Every Lua script splitbus runs, declared with the keys it touches.

A script is declared once, at import, in the bus module that owns its keys (``declare``), and run
from there (``LuaScript.register``). The declaration names every key the script touches, in
KEYS order, as docs/bus.md names keys: a script builds no key name (every key it touches comes in
KEYS, built by ``splitbus.bus.core.keys``), which is what Redis Cluster needs to route it and what
lets a reader see from the declaration alone which hash slots it spans. docs/bus.md's script
table is checked against ``SCRIPTS`` (tests/bus/test_scripts.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript


@dataclass(frozen=True)
class LuaScript:
    """One script and what it touches."""

    name: str
    """Unique short name (the first column of docs/bus.md's script table)."""
    module: str
    """The module that owns the script's keys, and the only one that runs it (``__name__``)."""
    keys: tuple[str, ...]
    """KEYS, in order, named as in docs/bus.md (``sb:kv:{cell}:<request>``); ``a | b``: either key."""
    argv: str
    """What ARGV holds, in order."""
    returns: str
    """What the script returns."""
    source: str
    repeated: tuple[str, ...] = ()
    """KEYS after ``keys``, once per item: a script over many streams or workers."""

    def register(self, redis: aioredis.Redis) -> AsyncScript:
        """The script on one client (``EVALSHA``, loaded again if the server lost it)."""
        return redis.register_script(self.source)


_PLAIN_NAME = re.compile(r"\+?[a-z_]+")
"""What ``lua_string`` takes: field names and words, nothing a Lua string would escape."""


def lua_string(name: str) -> str:
    """A name Python defines (a field, a word an entry carries) as a Lua string literal: a script
    then writes what Python's writers write, from one definition, and its text is the one it had
    with the name spelled by hand (its SHA too)."""
    name = str(name)  # a str enum's member: its value
    if not _PLAIN_NAME.fullmatch(name):
        raise ValueError(f"not a plain field name: {name!r}")
    return f"'{name}'"


SCRIPTS: dict[str, LuaScript] = {}
"""Every declared script, by name; filled as the modules that own them are imported."""


def declare(script: LuaScript) -> LuaScript:
    """Add the script to ``SCRIPTS`` (once: a second script under its name is a bug)."""
    known = SCRIPTS.setdefault(script.name, script)
    if known != script:
        raise ValueError(f"two scripts named {script.name!r}: in {known.module} and {script.module}")
    return script
