"""What compiling or following a grammar comes to; imports nothing (the worker's core reads it)."""

from __future__ import annotations

import enum


class GrammarError(ValueError):
    """A grammar that cannot be served, or tokens that break it; ``field`` names the request
    field it came from (a 400's param), or ``grammar`` (the bus field) on a worker."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class Advance(enum.Enum):
    """What a generated token did to the grammar."""

    GOING = "going"
    """The grammar takes more tokens."""
    COMPLETE = "complete"
    """The grammar is complete and takes nothing more (only an end-of-sequence token): the
    request stops, ``finish_reason`` "stop"."""
    REFUSED = "refused"
    """The token breaks the grammar (a masked engine never draws one): the request stops."""
