"""Worker -> API node, on ``sb:out:{reader}:<request>``.

Every entry carries ``seq``: 0, 1, 2, ... per request, across workers (a migrated request
continues its numbering), so readers deliver in order and drop duplicates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from splitbus.bus.core.codec import message
from splitbus.bus.messages._check import MAX_SEQ, MAX_TOKENS, require_int, require_int_list, require_str

FINISH_REASONS = ("stop", "length", "abort")


@message
@dataclass
class TokenDelta:
    """Tokens generated in one engine step, and their text when the worker detokenizes."""

    TYPE: ClassVar[str] = "token"
    terminal: ClassVar[bool] = False
    seq: int
    token_ids: list[int]
    text: str = ""

    def __post_init__(self) -> None:
        require_int(self.seq, "seq", minimum=0, maximum=MAX_SEQ)
        require_int_list(self.token_ids, "token_ids")


@message
@dataclass
class Finished:
    """The last entry of a request that completed."""

    TYPE: ClassVar[str] = "final"
    terminal: ClassVar[bool] = True
    seq: int
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    text: str = ""
    """Text held back until now (e.g. a partial stop string that did not match)."""
    token_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    """Prompt tokens whose KV came from a prefix cache (OpenAI's ``prompt_tokens_details.
    cached_tokens``); 0 from a worker that predates it (readers ignore unknown fields)."""

    def __post_init__(self) -> None:
        require_int(self.seq, "seq", minimum=0, maximum=MAX_SEQ)
        require_str(self.finish_reason, "finish_reason")
        require_int(self.prompt_tokens, "prompt_tokens", minimum=0, maximum=MAX_TOKENS)
        require_int(self.completion_tokens, "completion_tokens", minimum=0, maximum=MAX_TOKENS)
        require_int(self.cached_tokens, "cached_tokens", minimum=0, maximum=self.prompt_tokens)
        require_int_list(self.token_ids, "token_ids")


@message
@dataclass
class Failed:
    """The last entry of a request that could not complete; the client gets this error."""

    TYPE: ClassVar[str] = "error"
    terminal: ClassVar[bool] = True
    seq: int
    code: str
    message: str
    status: int = 500
    """The HTTP status an API node answers with, if it has not started streaming."""

    def __post_init__(self) -> None:
        require_int(self.seq, "seq", minimum=0, maximum=MAX_SEQ)
        require_str(self.code, "code")
        require_int(self.status, "status", minimum=100, maximum=599)


Result = TokenDelta | Finished | Failed
