"""Tool-call parsers, by model family: the table ``--tool-call-parser`` takes its choices from.

A model asked to call tools writes the calls into its text in its family's own format (Qwen2.5's
``<tool_call>{json}</tool_call>``, Llama 3's bare JSON). A parser reads that text as it streams
and splits it into content and ``ToolCall``s. ``feed`` takes each new piece of text, ``finish``
the end of the output; both return what is decided so far, in order: content strings and calls.
The same parser reads a whole text (``parse``: one ``feed`` and ``finish``), so a non-streamed
response and the deltas of a streamed one always agree, however the text was split.

A parser holds back only what is still undecided: a suffix that may begin a tag, whitespace that
may precede one, a call not yet complete. A call is sent once its JSON is complete and valid;
text that looked like a call but does not parse is content, verbatim.

``register(name)`` puts a parser class in the table, ``names()`` lists it, ``create(name)``
makes one (a parser keeps the state of one output).
"""

from __future__ import annotations

import enum
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the function's name and its arguments as JSON text (OpenAI's
    ``function.arguments``: a string, not an object)."""

    name: str
    arguments: str


Piece = str | ToolCall
"""What a parser decides: content text, or a call."""


class ToolParser(ABC):
    """The state of one output's parse."""

    name: ClassVar[str] = ""

    @abstractmethod
    def feed(self, text: str) -> list[Piece]:
        """The pieces ``text`` (the next part of the output) decides, in order."""

    @abstractmethod
    def finish(self) -> list[Piece]:
        """The pieces still held back, decided now that the output has ended."""


P = TypeVar("P", bound=type[ToolParser])
PARSERS: dict[str, type[ToolParser]] = {}
"""Parser classes by name."""


class UnknownParser(ValueError):
    """A name no parser is registered under."""


def register(name: str) -> Callable[[P], P]:
    """Class decorator: the parser is known as ``name`` from now on."""

    def add(cls: P) -> P:
        if PARSERS.get(name, cls) is not cls:
            raise ValueError(
                f"two tool-call parsers are named {name!r}: {PARSERS[name].__qualname__}, {cls.__qualname__}"
            )
        cls.name = name
        PARSERS[name] = cls
        return cls

    return add


def names() -> list[str]:
    """Every parser's name, sorted (``--tool-call-parser``'s choices)."""
    return sorted(PARSERS)


def create(name: str) -> ToolParser:
    """A new parser of the class registered as ``name``."""
    if name not in PARSERS:
        raise UnknownParser(f"no tool-call parser is named {name!r} (there are: {', '.join(names())})")
    return PARSERS[name]()


def parse(parser: ToolParser, text: str) -> tuple[str, list[ToolCall]]:
    """A whole output's content and calls (as its deltas would add up to)."""
    pieces = parser.feed(text) + parser.finish()
    content = "".join(p for p in pieces if isinstance(p, str))
    return content, [p for p in pieces if isinstance(p, ToolCall)]


def call_from(value: Any, arguments_key: str = "arguments") -> ToolCall | None:
    """A call from a decoded ``{"name": ..., "<arguments_key>": {...}}``; None when it is not one.
    Arguments written as a JSON string holding an object are taken too (some models quote them)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get(arguments_key, {})
    if isinstance(arguments, str):
        arguments = loads(arguments)
    if not isinstance(arguments, dict):
        return None
    try:
        return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))
    except RecursionError:  # nested past the encoder's depth: text, not a call
        return None


def loads(text: str) -> Any:
    """The JSON value of ``text``; None when it is not JSON (or nests past the decoder's depth)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` may begin ``tag`` (held back until known)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


@register("hermes")
class HermesParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, as Qwen2.5, Qwen3 and
    Hermes 2/3 write calls, any number of them, with text around. Whitespace between the text
    and a call, or between calls, is dropped (the model's layout, not content); a call left open
    when the output ends is taken if its JSON is complete."""

    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    def __init__(self) -> None:
        self._pending = ""
        self._in_call = False
        self._gap = ""
        """Whitespace that preceded the open tag: content again if the call does not parse."""
        self._after_call = False
        """A call just ended: whitespace that follows it is layout."""
        self._scanned = 0
        """Where the search for the close tag goes on (a long call is not searched again whole)."""

    def feed(self, text: str) -> list[Piece]:
        self._pending += text
        pieces: list[Piece] = []
        while self._step(pieces):
            pass
        return [p for p in pieces if p != ""]

    def finish(self) -> list[Piece]:
        pending, self._pending = self._pending, ""
        if self._in_call:
            self._in_call = False
            return [self._call_or_text(pending, closed=False)]
        return [pending] if pending else []

    def _step(self, pieces: list[Piece]) -> bool:
        """Decide what the pending text allows; True when more may follow from it."""
        if self._after_call:
            self._pending = self._pending.lstrip()
            if not self._pending:
                return False
            self._after_call = False
        if self._in_call:
            return self._close(pieces)
        return self._open(pieces)

    def _open(self, pieces: list[Piece]) -> bool:
        at = self._pending.find(self.OPEN)
        if at < 0:
            undecided = len(self._pending) - _partial_tag(self._pending, self.OPEN)
            sure = len(self._pending[:undecided].rstrip())  # trailing whitespace may precede a tag
            pieces.append(self._pending[:sure])
            self._pending = self._pending[sure:]
            return False
        before = self._pending[:at]
        text = before.rstrip()
        pieces.append(text)
        self._gap = before[len(text) :]
        self._pending = self._pending[at + len(self.OPEN) :]
        self._in_call = True
        return True

    def _close(self, pieces: list[Piece]) -> bool:
        at = self._pending.find(self.CLOSE, self._scanned)
        if at < 0:
            self._scanned = max(0, len(self._pending) - len(self.CLOSE) + 1)
            return False
        self._scanned = 0
        body = self._pending[:at]
        self._pending = self._pending[at + len(self.CLOSE) :]
        self._in_call = False
        pieces.append(self._call_or_text(body, closed=True))
        return True

    def _call_or_text(self, body: str, closed: bool) -> Piece:
        call = call_from(loads(body))
        if call is not None:
            self._after_call = True
            return call
        return self._gap + self.OPEN + body + (self.CLOSE if closed else "")


class Output(enum.Enum):
    """What a Llama 3 output turned out to be, once its start decides it."""

    UNDECIDED = "undecided"
    CONTENT = "content"
    CALLS = "calls"


@register("llama3_json")
class Llama3JsonParser(ToolParser):
    """Llama 3.1-3.3's JSON calls: an output that starts (after whitespace) with
    ``<|python_tag|>`` or ``{`` is calls, ``{"name": ..., "parameters": {...}}`` (or
    ``"arguments"``), several separated by ``;``; any other output is content. What follows the
    calls and does not parse as one is content. ``<|python_tag|>`` is a special token: it is in
    the text only with ``skip_special_tokens: false``."""

    TAG = "<|python_tag|>"
    _SEPARATORS = re.compile(r"[\s;]*")

    def __init__(self) -> None:
        self._pending = ""
        self._mode = Output.UNDECIDED
        self._decoder = json.JSONDecoder()

    def feed(self, text: str) -> list[Piece]:
        self._pending += text
        if self._mode is Output.UNDECIDED:
            self._decide()
        # A call can only have completed in a piece that closed an object: a long call is
        # decoded once per '}', not once per token.
        pieces = self._calls(decode="}" in text) if self._mode is Output.CALLS else []
        return pieces + (self._all_content() if self._mode is Output.CONTENT else [])

    def finish(self) -> list[Piece]:
        pieces = self._calls(decode=True) if self._mode is Output.CALLS else []
        return [*pieces, *self._all_content()]

    def _decide(self) -> None:
        start = self._pending.lstrip()
        if start.startswith(self.TAG) or start.startswith("{"):
            self._mode = Output.CALLS
            self._pending = start.removeprefix(self.TAG)
        elif start and not self.TAG.startswith(start):
            self._mode = Output.CONTENT

    def _all_content(self) -> list[Piece]:
        pending, self._pending = self._pending, ""
        return [pending] if pending else []

    def _calls(self, decode: bool) -> list[Piece]:
        pieces: list[Piece] = []
        while self._mode is Output.CALLS:
            call = self._next_call(decode)
            if call is None:
                break
            pieces.append(call)
        return pieces

    def _next_call(self, decode: bool) -> ToolCall | None:
        """The next complete call, consumed; None when it is not complete yet (or not a call:
        then the rest is content)."""
        start = self._SEPARATORS.match(self._pending)
        rest = self._pending[start.end() if start else 0 :]
        if not rest:
            return None
        if not rest.startswith("{"):
            self._pending, self._mode = rest, Output.CONTENT
            return None
        if not decode:
            return None
        try:
            value, end = self._decoder.raw_decode(rest)
        except (ValueError, RecursionError):
            return None  # not complete yet (or nested past the decoder's depth); at the end, content
        call = call_from(value, "parameters" if isinstance(value, dict) and "parameters" in value else "arguments")
        if call is None:
            self._pending, self._mode = rest, Output.CONTENT
            return None
        self._pending = rest[end:]
        return call
