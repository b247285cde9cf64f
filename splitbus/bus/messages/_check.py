"""Value checks for message ``__post_init__``: a decoded entry must not carry wrong types, and
every number and size is bounded, so no consumer does arithmetic, allocation or a tokenizer call
on a value it cannot handle (a token id of 2**32 made the tokenizer raise OverflowError; a
reservation of 10**12 drove a worker's counters to -10**12)."""

from __future__ import annotations

import math
import re
from typing import Any

MAX_TOKEN_ID = 2**31 - 1
"""Token ids are non-negative int32 (what tokenizers and engines index with); a worker checks
them against its own vocabulary as well when it takes a task."""
MAX_TOKENS = 2**22
"""Longest token list (prompt, generated tokens) and largest ``max_tokens``: above any context."""
MAX_KV_BLOCKS = 2 * MAX_TOKENS
"""Most KV blocks one request can reserve (prompt + max_tokens, blocks of at least 1 token)."""
MAX_SEQ = 2**31 - 1
"""Largest result sequence number."""
MAX_NAME_CHARS = 256
"""Longest id or name: request, worker, model, API node, batch."""
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 4096
"""Outer bound of one stop string on the bus; the API node's own bound must not exceed it."""
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 300
"""Most ``logit_bias`` entries in one request (OpenAI's limit)."""
LOGIT_BIAS_RANGE = (-100.0, 100.0)
"""A ``logit_bias`` value's range (OpenAI's): -100 bans a token in effect, 100 all but forces it."""
PENALTY_RANGE = (-2.0, 2.0)
"""``presence_penalty`` and ``frequency_penalty`` (OpenAI's range)."""
MAX_REPETITION_PENALTY = 2.0
"""``repetition_penalty`` is in (0, this]: 1 is off, above 1 discourages repeats (HF's and vLLM's
meaning; vLLM bounds it below only, past 2 a model's repeats are all but banned)."""
MAX_TEMPERATURE = 100.0
MAX_CHOICES = 128
"""Most choices of one response (``GenerateRequest.choices``); the API's own bound is lower."""
MAX_LOGPROBS = 20
"""Most alternatives per token in ``logprobs`` / ``prompt_logprobs`` (OpenAI's top_logprobs bound)."""
MIN_LOGPROB = -9999.0
"""The floor a log-probability is clamped to: JSON has no -inf (a masked token's), and vLLM's API
answers -9999.0 there too."""
MAX_GRAMMAR_CHARS = 2**18
"""Longest structured-output grammar (llguidance's JSON form, ``SamplingParams.grammar``): the
API's bound on a request's schema or grammar (64 Ki characters) once compiled and escaped."""
PRIORITY_RANGE = (-(2**31), 2**31 - 1)
"""A request's ``priority`` (vLLM's field: lower is handled earlier): an int32, as vLLM's is any int."""
MAX_DEADLINE_MS = 2**53
SEED_RANGE = (-(2**63), 2**64 - 1)
"""What JSON carries as an integer (orjson refuses anything wider)."""


def is_int(value: Any) -> bool:
    return type(value) is int  # bool is not an int here


def require(condition: bool, what: str) -> None:
    """``what`` is formatted before the call: the checks every decode passes (``require_number``,
    ``require_int_list``...) raise themselves instead, so that a valid value formats nothing
    (issue 40: ~20 messages a request, a few µs of each decode)."""
    if not condition:
        raise ValueError(what)


def require_int(value: Any, name: str, minimum: int | None = None, maximum: int | None = None) -> None:
    if type(value) is not int:
        raise ValueError(f"{name} must be an integer, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")


def require_str(value: Any, name: str, nonempty: bool = True, max_chars: int = MAX_NAME_CHARS) -> None:
    # Messages are formatted only on failure: every decoded entry and registry row passes here.
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {type(value).__name__}")
    if nonempty and not value:
        raise ValueError(f"{name} must not be empty")
    if len(value) > max_chars:
        raise ValueError(f"{name} must be at most {max_chars} characters, got {len(value)}")


def require_int_list(value: Any, name: str, maximum: int = MAX_TOKEN_ID, max_len: int = MAX_TOKENS) -> None:
    """A list of at most ``max_len`` integers in [0, ``maximum``]."""
    if type(value) is not list:
        raise ValueError(f"{name} must be a list of integers")
    if len(value) > max_len:
        raise ValueError(f"{name} must hold at most {max_len} items, got {len(value)}")
    for v in value:
        if type(v) is not int or not 0 <= v <= maximum:
            raise ValueError(f"{name} must hold integers in [0, {maximum}], got {_short(v)}")


def require_number(value: Any, name: str, minimum: float, maximum: float = math.inf) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite")
    if not minimum <= value <= maximum:
        raise ValueError(f"{name} must be in [{minimum}, {maximum}], got {value}")


def require_logprob_rows(value: Any, name: str, width: int) -> None:
    """A list of rows, each at most ``width`` log-probabilities in [MIN_LOGPROB, 0] (a float's
    rounding may put a certain token a hair above 0)."""
    require(type(value) is list, f"{name} must be a list")
    for row in value:
        require(type(row) is list and len(row) <= width, f"{name}: each row must be a list of at most {width}")
        for v in row:
            if type(v) is not float or not MIN_LOGPROB <= v <= 1e-3:
                raise ValueError(f"{name} must hold log-probabilities in [{MIN_LOGPROB}, 0], got {_short(v)}")


_DECIMAL = re.compile(r"0|[1-9][0-9]{0,9}")
"""A non-negative integer in canonical decimal, at most 10 digits (``MAX_TOKEN_ID`` has 10)."""


def require_bias_map(value: Any, name: str, max_items: int, bounds: tuple[float, float]) -> None:
    """An object of at most ``max_items`` token ids in decimal (``"0"``, ``"17"``: JSON's object
    keys are strings; one spelling each, so no id appears twice) to numbers within ``bounds``."""
    require(type(value) is dict, f"{name} must be an object")
    require(len(value) <= max_items, f"{name} must hold at most {max_items} entries, got {len(value)}")
    for key, number in value.items():
        if not (isinstance(key, str) and _DECIMAL.fullmatch(key) and int(key) <= MAX_TOKEN_ID):
            raise ValueError(f"{name} keys must be token ids in [0, {MAX_TOKEN_ID}] in decimal, got {_short(key)}")
        require_number(number, f"{name}[{key}]", *bounds)


def require_str_list(value: Any, name: str, max_items: int, max_chars: int) -> None:
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise ValueError(f"{name} must be a list of strings")
    if len(value) > max_items:
        raise ValueError(f"{name} must hold at most {max_items} strings, got {len(value)}")
    longest = max(map(len, value), default=0)
    if longest > max_chars:
        raise ValueError(f"{name}: each must be at most {max_chars} characters, got {longest}")


TRACEPARENT = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")
"""W3C Trace Context's ``traceparent``, version 00, exactly: 55 characters, lowercase hex, ids not
all zero. Nothing longer or looser is carried (a trace id is an id, never a place for data)."""


def is_traceparent(value: Any) -> bool:
    """Whether ``value`` is a ``traceparent`` in exactly the form ``TRACEPARENT`` gives."""
    return isinstance(value, str) and TRACEPARENT.fullmatch(value) is not None


def traceparent_problem(value: Any, name: str = "traceparent") -> str | None:
    """Why ``value`` cannot be a carried ``traceparent``, or None: ``""`` (not traced) or
    exactly a W3C one (``is_traceparent``)."""
    if value == "" or is_traceparent(value):
        return None
    return f"{name} must be empty or a W3C traceparent (00-<32 hex>-<16 hex>-<2 hex>), got {_short(value)}"


def require_traceparent(value: Any, name: str = "traceparent") -> None:
    problem = traceparent_problem(value, name)
    if problem is not None:
        raise ValueError(problem)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
