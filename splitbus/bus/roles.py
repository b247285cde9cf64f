"""The bus's two small vocabularies: what a worker is (``Role``) and what a task asks of it
(``Phase``). Both are ``str`` enums: their values are what the bus carries (a registry record's
``role``, a task's ``phase``), so a member compares equal to the string read from Redis, and code
that compares names a member, never a literal."""

from __future__ import annotations

from enum import Enum


class Word(str, Enum):
    """A ``str`` enum that prints as its value on every Python this runs on (3.10's ``str``
    mixin would print ``Role.PREFILL``, and an f-string would carry that to Redis)."""

    def __str__(self) -> str:
        return str(self.value)


class Role(Word):
    """What a worker does; the ``role`` of its registry record and of ``splitbus worker --role``."""

    PREFILL = "prefill"
    """Prefills, publishes the first token and hands the KV cache to a decode worker."""
    DECODE = "decode"
    """Reserves KV blocks, imports the cache a prefill worker sends, and decodes."""
    MIXED = "mixed"
    """Does both, with no KV transfer."""


class Phase(Word):
    """What a task asks of the worker it is sent to; the ``phase`` of a task entry."""

    PREFILL = "prefill"
    """Prefill the prompt, publish the first token, ship the KV cache to the task's ``peer``."""
    DECODE = "decode"
    """Reserve blocks, wait for the KV cache from the prefill worker, decode to the end."""
    MIXED = "mixed"
    """Prefill and decode on one worker."""


ROLES: tuple[str, ...] = tuple(role.value for role in Role)
"""The roles' values, for checks and messages: a tuple of members prints as their reprs
("(<Role.PREFILL: 'prefill'>, ...)") in "role must be one of ..."."""
PHASES: tuple[str, ...] = tuple(phase.value for phase in Phase)
"""The phases' values, as ``ROLES``."""
