"""Worker -> API node, on ``sb:out:{reader}:<request>``.

Every entry carries ``seq``: 0, 1, 2, ... per request, across workers (a migrated request
continues its numbering), so readers deliver in order and drop duplicates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from splitbus.bus.core.codec import message
from splitbus.bus.messages._check import (
    MAX_LOGPROBS,
    MAX_SEQ,
    MAX_TOKENS,
    require,
    require_int,
    require_int_list,
    require_logprob_rows,
    require_str,
)

FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class Logprobs:
    """The log-probabilities of a run of tokens, column by column: each token's own (``token``)
    and the top ones of the distribution it came from (``top_ids``, most likely first, and their
    ``top``). Raw: the log softmax of the model's logits, before temperature, penalties and
    masks (vLLM's default), so a greedy token's is the first of its top. Floored at
    ``MIN_LOGPROB``."""

    token: list[float]
    top_ids: list[list[int]]
    top: list[list[float]]

    def __post_init__(self) -> None:
        require_logprob_rows([self.token], "logprobs.token", MAX_TOKENS)
        require(type(self.top_ids) is list and len(self.top_ids) == len(self.token), "logprobs.top_ids: one per token")
        for row in self.top_ids:
            require_int_list(row, "logprobs.top_ids", max_len=MAX_LOGPROBS)
        require_logprob_rows(self.top, "logprobs.top", MAX_LOGPROBS)
        require([len(r) for r in self.top] == [len(r) for r in self.top_ids], "logprobs.top: one per top id")

    def __len__(self) -> int:
        return len(self.token)

    def __add__(self, other: Logprobs) -> Logprobs:
        return Logprobs(self.token + other.token, self.top_ids + other.top_ids, self.top + other.top)


@message
@dataclass
class TokenDelta:
    """Tokens generated in one engine step, and their text when the worker detokenizes."""

    TYPE: ClassVar[str] = "token"
    NESTED: ClassVar[dict[str, type]] = {"logprobs": Logprobs, "prompt_logprobs": Logprobs}
    terminal: ClassVar[bool] = False
    seq: int
    token_ids: list[int]
    text: str = ""
    logprobs: Logprobs | None = None
    """The tokens' logprobs, one per token, when the request asked for them (``SamplingParams.
    logprobs``)."""
    prompt_logprobs: Logprobs | None = None
    """The prompt's logprobs from its second token on, when the request asked for them
    (``SamplingParams.prompt_logprobs``): on the request's first entry only, from its prefill."""

    def __post_init__(self) -> None:
        require_int(self.seq, "seq", minimum=0, maximum=MAX_SEQ)
        require_int_list(self.token_ids, "token_ids")
        _check_logprobs(self.logprobs, self.prompt_logprobs, len(self.token_ids))


def _check_logprobs(logprobs: Logprobs | None, prompt_logprobs: Logprobs | None, tokens: int) -> None:
    require(logprobs is None or isinstance(logprobs, Logprobs), "logprobs must be an object")
    require(prompt_logprobs is None or isinstance(prompt_logprobs, Logprobs), "prompt_logprobs must be an object")
    require(logprobs is None or len(logprobs) == tokens, "logprobs must hold one entry per token")


@message
@dataclass
class Finished:
    """The last entry of a request that completed."""

    TYPE: ClassVar[str] = "final"
    NESTED: ClassVar[dict[str, type]] = {"logprobs": Logprobs, "prompt_logprobs": Logprobs}
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
    logprobs: Logprobs | None = None
    """Of ``token_ids``, as ``TokenDelta``'s: a reader that merges deltas into the last entry
    sets these; a worker writes neither."""
    prompt_logprobs: Logprobs | None = None

    def __post_init__(self) -> None:
        require_int(self.seq, "seq", minimum=0, maximum=MAX_SEQ)
        require_str(self.finish_reason, "finish_reason")
        require_int(self.prompt_tokens, "prompt_tokens", minimum=0, maximum=MAX_TOKENS)
        require_int(self.completion_tokens, "completion_tokens", minimum=0, maximum=MAX_TOKENS)
        require_int(self.cached_tokens, "cached_tokens", minimum=0, maximum=self.prompt_tokens)
        require_int_list(self.token_ids, "token_ids")
        _check_logprobs(self.logprobs, self.prompt_logprobs, len(self.token_ids))


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
