"""Tools in chat completions: the request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``,
the tool fields of its messages, and the calls in the response.

The tools and messages reach the chat template as transformers' ``apply_chat_template(messages,
tools=...)`` passes them: ``tools`` a list of ``{"type": "function", "function": {...}}``, an
assistant message's ``tool_calls`` with each ``function.arguments`` decoded to an object (the
form templates expect, as vLLM passes them), a tool message's ``tool_call_id``.

The model writes its calls in its text. With ``tool_choice`` ``auto`` the API's
``--tool-call-parser`` (``tool_parsers``) reads them out; with ``required`` or a named function
the output is the JSON ``output_schema`` describes (``{"name", "arguments"}``, a list of them
when calls may be parallel), which the structured-output grammar holds the model to
(``constrained``), read by ``ForcedCallParser``. ``ToolCallStream`` turns what a parser
decides into OpenAI's response fields: ``message.tool_calls`` and streamed ``tool_calls`` deltas,
``finish_reason`` ``tool_calls``.
"""

from __future__ import annotations

import enum
import functools
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from splitbus.api import tool_parsers
from splitbus.api.errors import BadRequest
from splitbus.api.tool_parsers import Piece, ToolCall, ToolParser
from splitbus.grammar.outcomes import GrammarError
from splitbus.grammar.request import GrammarSpec, json_schema_spec

MAX_TOOLS = 128
"""Tools one request may declare (OpenAI's own bound)."""
MAX_TOOLS_CHARS = 512 * 1024
"""Characters of the tools' JSON (their names, descriptions and schemas) one request may send:
real tool sets are a few KB; the bound keeps the template's and the grammar's work small. The
same characters also count towards the prompt's bound (``--max-prompt-chars``)."""
MAX_SCHEMA_DEPTH = 32
"""Nesting (objects and lists) of a tool's ``function`` (its ``parameters`` schema, one level
down) or of a call's arguments beyond which it is refused: the template prints them, the grammar
compiles the schema and the API measures them as JSON, all recursively."""
MAX_NAME_CHARS = 64
"""The longest function name (OpenAI's bound; its letters, digits, ``_`` and ``-`` are not
enforced: vLLM takes any name, and tools named ``server.tool`` exist)."""
MAX_ID_CHARS = 256
"""The longest ``tool_calls[].id``, ``tool_call_id`` or message ``name`` a message may carry."""
MAX_CALLS_PER_MESSAGE = 128
"""Calls one assistant message may carry."""
CALL_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""llguidance's JSON options for forced calls (``x-guidance``): written as ``json.dumps`` and
chat templates' ``tojson`` print calls, ``{"name": "f", "arguments": {"a": 1}}``, the form models
learnt them in; and no free whitespace, which a model could otherwise go on writing until
``max_tokens``."""


class Choice(enum.Enum):
    """``tool_choice``: whether and how the model must call a tool."""

    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's validated tool fields."""

    tools: tuple[dict[str, Any], ...]
    """The tools as sent (``{"type": "function", "function": {...}}``), for the template."""
    choice: Choice
    named: str | None = None
    """With ``Choice.NAMED``: the function the model must call."""
    parallel: bool = True
    """``parallel_tool_calls``: whether a response may hold several calls."""
    chars: int = 0
    """Characters of the tools' JSON, counted in the prompt's bound."""

    def template_tools(self) -> list[dict[str, Any]] | None:
        """``tools`` as the chat template gets it (also with ``tool_choice: none``, as vLLM)."""
        return list(self.tools) or None


# ---------------------------------------------------------------- request


def parse_request(body: dict[str, Any]) -> ToolRequest | None:
    """The tool fields of a chat request (None: it declares no tools and asks for none)."""
    for old in ("functions", "function_call"):
        if body.get(old) is not None:
            raise BadRequest(f"'{old}' (deprecated by OpenAI) is not supported: send 'tools' and 'tool_choice'", old)
    tools = _tools(body.get("tools"))
    choice, named = _choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool) and parallel is not None:
        raise BadRequest("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if not tools and choice is Choice.NONE:
        return None
    chars = len(json.dumps(tools, ensure_ascii=False))
    if chars > MAX_TOOLS_CHARS:
        raise BadRequest(f"'tools' may have at most {MAX_TOOLS_CHARS} characters of JSON, got {chars}", "tools")
    return ToolRequest(tuple(tools), choice, named, parallel is not False, chars)


def _tools(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise BadRequest("'tools' must be a list", "tools")
    if len(value) > MAX_TOOLS:
        raise BadRequest(f"'tools' may hold at most {MAX_TOOLS} tools, got {len(value)}", "tools")
    tools = [_tool(tool, f"tools[{i}]") for i, tool in enumerate(value)]
    seen = [t["function"]["name"] for t in tools]
    if len(set(seen)) != len(seen):
        raise BadRequest("'tools' names a function twice", "tools")
    return tools


def _tool(tool: Any, param: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise BadRequest(f"{param} must be an object of type 'function' (the only tool type supported)", param)
    function = tool.get("function")
    if not isinstance(function, dict):
        raise BadRequest(f"{param}.function must be an object", f"{param}.function")
    check_name(function.get("name"), f"{param}.function.name")
    if not isinstance(function.get("description", ""), str):
        raise BadRequest(f"{param}.function.description must be a string", f"{param}.function.description")
    parameters = function.get("parameters")
    if (parameters is not None and not isinstance(parameters, dict)) or _depth(function) > MAX_SCHEMA_DEPTH:
        raise BadRequest(
            f"{param}.function.parameters must be a JSON schema object nested at most {MAX_SCHEMA_DEPTH - 1} deep",
            f"{param}.function.parameters",
        )
    return {"type": "function", "function": function}


def check_name(name: Any, param: str) -> str:
    """A function name: a string of 1 to ``MAX_NAME_CHARS`` characters."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
        raise BadRequest(f"{param} must be a string of 1 to {MAX_NAME_CHARS} characters", param)
    return name


def _depth(value: Any) -> int:
    """How deep objects and lists nest in ``value`` (iteratively: a deep value must not recurse)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        if children:
            deepest = max(deepest, depth)
            if depth > MAX_SCHEMA_DEPTH:
                return depth
            todo.extend((child, depth + 1) for child in children)
    return deepest


def _choice(value: Any, tools: list[dict[str, Any]]) -> tuple[Choice, str | None]:
    if value is None:
        return (Choice.AUTO if tools else Choice.NONE), None
    if value == "none":
        return Choice.NONE, None
    if value in ("auto", "required"):
        if not tools:
            raise BadRequest(f"'tool_choice' {value!r} needs 'tools'", "tool_choice")
        return Choice(value), None
    return Choice.NAMED, _named(value, tools)


def _named(value: Any, tools: list[dict[str, Any]]) -> str:
    """The function ``{"type": "function", "function": {"name": ...}}`` names, one of ``tools``."""
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(value.get("function"), dict):
        raise BadRequest(
            "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
            "tool_choice",
        )
    name = value["function"].get("name")
    if isinstance(name, str) and name in [t["function"]["name"] for t in tools]:
        return name
    shown = (
        repr(name[: MAX_NAME_CHARS + 1]) if isinstance(name, str) else "not a string"
    )  # a nested value's repr recurses
    raise BadRequest(f"'tool_choice' names a function that is not in 'tools': {shown}", "tool_choice")


def message_fields(message: dict[str, Any], param: str) -> dict[str, Any]:
    """A message's tool fields as the template gets them: an assistant's ``tool_calls``
    (arguments decoded), a tool message's ``tool_call_id``, any message's ``name``."""
    fields: dict[str, Any] = {}
    if message["role"] == "assistant" and message.get("tool_calls") is not None:
        fields["tool_calls"] = _calls(message["tool_calls"], f"{param}.tool_calls")
    if message["role"] == "tool" and message.get("tool_call_id") is not None:
        fields["tool_call_id"] = _short_text(message["tool_call_id"], f"{param}.tool_call_id")
    if message.get("name") is not None:
        fields["name"] = _short_text(message["name"], f"{param}.name")
    return fields


def _calls(value: Any, param: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or len(value) > MAX_CALLS_PER_MESSAGE:
        raise BadRequest(f"{param} must be a list of at most {MAX_CALLS_PER_MESSAGE} calls", param)
    return [_call(call, f"{param}[{i}]") for i, call in enumerate(value)]


def _call(call: Any, param: str) -> dict[str, Any]:
    if (
        not isinstance(call, dict)
        or call.get("type", "function") != "function"
        or not isinstance(call.get("function"), dict)
    ):
        raise BadRequest(f"{param} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}", param)
    name = check_name(call["function"].get("name"), f"{param}.function.name")
    arguments = call["function"].get("arguments", "{}")
    decoded = tool_parsers.loads(arguments) if isinstance(arguments, str) else arguments
    if not isinstance(decoded, dict) or _depth(decoded) > MAX_SCHEMA_DEPTH:
        raise BadRequest(
            f"{param}.function.arguments must be a JSON object (as text) nested at most {MAX_SCHEMA_DEPTH} deep",
            f"{param}.function.arguments",
        )
    found = {"type": "function", "function": {"name": name, "arguments": decoded}}
    return {"id": _short_text(call["id"], f"{param}.id"), **found} if call.get("id") is not None else found


def _short_text(value: Any, param: str) -> str:
    if not isinstance(value, str) or len(value) > MAX_ID_CHARS:
        raise BadRequest(f"{param} must be a string of at most {MAX_ID_CHARS} characters", param)
    return value


def extra_chars(messages: list[dict[str, Any]], request: ToolRequest | None) -> int:
    """Characters the tools and the messages' tool fields add to the prompt, beside the contents:
    the template prints them too, so the prompt's bound counts them."""
    fields = [{k: v for k, v in m.items() if k not in ("role", "content")} for m in messages]
    in_messages = sum(len(json.dumps(f, ensure_ascii=False)) for f in fields if f)
    return in_messages + (request.chars if request is not None else 0)


# ---------------------------------------------------------------- constrained calls


def output_schema(request: ToolRequest | None) -> dict[str, Any] | None:
    """The JSON schema of the output ``tool_choice`` ``required`` or a named function asks for
    (None for ``auto`` and ``none``): ``{"name": <a tool's name>, "arguments": <its parameters>}``,
    for ``required`` a list of at least one such call when ``parallel_tool_calls`` (the default)."""
    if request is None or request.choice in (Choice.NONE, Choice.AUTO):
        return None
    functions = [t["function"] for t in request.tools]
    if request.choice is Choice.NAMED:
        return _call_schema(next(f for f in functions if f["name"] == request.named))
    one = {"anyOf": [_call_schema(f) for f in functions]}
    return {"type": "array", "items": one, "minItems": 1} if request.parallel else one


def constrained(request: ToolRequest | None, grammar: GrammarSpec | None) -> GrammarSpec | None:
    """The request's structured-output grammar: for ``required`` and a named function,
    ``output_schema``'s, which holds the model to calls that parse and match their functions'
    schemas (compiled before admission like any: a schema llguidance cannot serve is a 400 naming
    ``tools``); else the request's own (``response_format``, ``guided_*``). Both at once: a 400."""
    schema = output_schema(request)
    if schema is None:
        return grammar
    if grammar is not None:
        raise BadRequest(
            f"'{grammar.field}' cannot be combined with 'tool_choice' 'required' or a named function: "
            "the output is the calls' JSON",
            grammar.field,
        )
    try:
        return json_schema_spec({**schema, "x-guidance": CALL_LAYOUT}, "tools")
    except GrammarError as exc:
        raise BadRequest(str(exc), "tools") from None


def _call_schema(function: dict[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"type": "string", "const": function["name"]}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


class ForcedCallParser(ToolParser):
    """The output of ``required`` or a named function: ``output_schema``'s JSON (the grammar
    holds the model to it), whole: the calls are sent when the output ends. An output that is not
    that JSON (``max_tokens`` cut it) goes to ``fallback`` (the API's parser), else it is content."""

    def __init__(self, fallback: ToolParser | None) -> None:
        self._text = ""
        self._fallback = fallback

    def feed(self, text: str) -> list[Piece]:
        self._text += text
        return []

    def finish(self) -> list[Piece]:
        value = tool_parsers.loads(self._text)
        found = [tool_parsers.call_from(v) for v in (value if isinstance(value, list) else [value])]
        calls = [c for c in found if c is not None]
        if calls and len(calls) == len(found):
            return list(calls)
        if self._fallback is not None:
            return self._fallback.feed(self._text) + self._fallback.finish()
        return [self._text] if self._text else []


def parser_for(request: ToolRequest | None, configured: str | None) -> Callable[[], ToolParser] | None:
    """What makes the parser of this request's output (None: its text is content): for
    ``required`` and a named function ``ForcedCallParser``, for ``auto`` the API's
    ``--tool-call-parser`` if it has one."""
    if request is None or request.choice is Choice.NONE:
        return None
    if request.choice is Choice.AUTO:
        return functools.partial(tool_parsers.create, configured) if configured else None
    return lambda: ForcedCallParser(tool_parsers.create(configured) if configured else None)


# ---------------------------------------------------------------- response


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallStream:
    """One response's tool calls: the SSE path hands it each piece of text (``deltas``) and the
    finish reason, the non-streamed path each whole choice (``fill``). ``make`` makes a parser
    (None: the text is content, as without tools)."""

    def __init__(self, make: Callable[[], ToolParser] | None) -> None:
        self.make = make
        self.parser = make() if make is not None else None
        self.calls = 0
        """Calls sent so far (streamed)."""

    def deltas(self, text: str, finish: str | None) -> list[tuple[dict[str, Any], str | None]]:
        """The chat chunks' (delta, finish_reason) for the next text, and the end when ``finish``
        is given: content as ``content`` deltas, each call as two ``tool_calls`` deltas (its id,
        type and name, then its arguments), the finish reason ``tool_calls`` when calls were made
        and the model stopped by itself."""
        if self.parser is None:
            return [({"content": text} if text else {}, finish)]
        pieces = self.parser.feed(text) + (self.parser.finish() if finish is not None else [])
        out: list[tuple[dict[str, Any], str | None]] = [(delta, None) for delta in self._deltas(pieces)]
        if finish is not None:
            last = out.pop()[0] if out else {}
            out.append((last, finish_reason(finish, self.calls)))
        return out

    def _deltas(self, pieces: list[Piece]) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for piece in _joined(pieces):
            if isinstance(piece, str):
                deltas.append({"content": piece})
                continue
            head = {"index": self.calls, "id": call_id(), "type": "function"}
            deltas.append({"tool_calls": [{**head, "function": {"name": piece.name, "arguments": ""}}]})
            deltas.append({"tool_calls": [{"index": self.calls, "function": {"arguments": piece.arguments}}]})
            self.calls += 1
        return deltas

    def fill(self, choice: dict[str, Any]) -> dict[str, Any]:
        """A non-streamed chat choice with its text read (by a parser of its own): its
        ``message.content`` (null when only calls were made), ``message.tool_calls``, the finish
        reason."""
        if self.make is None:
            return choice
        content, calls = tool_parsers.parse(self.make(), choice["message"]["content"])
        if not calls:
            return {**choice, "message": {**choice["message"], "content": content}}
        message = {**choice["message"], "content": content or None, "tool_calls": [_openai(c) for c in calls]}
        return {**choice, "message": message, "finish_reason": finish_reason(choice["finish_reason"], len(calls))}


def finish_reason(reason: str, calls: int) -> str:
    """``tool_calls`` when the model made calls and then stopped by itself (a ``length`` stays:
    the output was cut)."""
    return "tool_calls" if calls and reason == "stop" else reason


def _openai(call: ToolCall) -> dict[str, Any]:
    return {"id": call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _joined(pieces: list[Piece]) -> list[Piece]:
    """Adjacent content pieces as one."""
    out: list[Piece] = []
    for piece in pieces:
        if isinstance(piece, str) and out and isinstance(out[-1], str):
            out[-1] += piece
        elif piece != "":
            out.append(piece)
    return out
