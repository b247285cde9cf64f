"""A request's structured-output fields -> one grammar, compiled and checked before admission.

OpenAI's ``response_format`` (``json_object``, ``json_schema``) and vLLM's ``guided_json``,
``guided_regex``, ``guided_choice`` and ``guided_grammar`` all become one llguidance grammar:
its JSON form (what ``LLMatcher.grammar_from_*`` return), which the bus carries
(``SamplingParams.grammar``) and a worker builds its matcher from. The API compiles it with the
model's tokenizer first, so that a schema llguidance does not implement, a bad regex or Lark
grammar is the client's 400 naming the field, never a worker's error.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
from llguidance import LLMatcher, LLTokenizer, grammar_from

from splitbus.bus.messages._check import MAX_GRAMMAR_CHARS
from splitbus.grammar.constraint import LIMITS
from splitbus.grammar.outcomes import GrammarError

MAX_GRAMMAR_SOURCE_CHARS = 65536
"""The longest schema (as JSON), regex, choice list (as JSON) or grammar a request may give, in
characters: a Pydantic model's schema is a few KB; compiling and the bus entry stay small. The
compiled form (the source inside llguidance's JSON, escaped) must also fit the bus's
``MAX_GRAMMAR_CHARS``."""
MAX_ERROR_CHARS = 1000
"""llguidance's error text is cut to this in a 400 (it may quote the whole grammar)."""
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
"""vLLM's extensions, in the order their conflicts are reported."""
ANY_JSON_OBJECT = {"type": "object"}
"""``response_format: {"type": "json_object"}``: any JSON object, as OpenAI and vLLM mean it."""


class GrammarFormat(enum.Enum):
    """What a grammar's source text is, as llguidance's ``grammar_from`` names it."""

    JSON_SCHEMA = "json_schema"
    REGEX = "regex"
    CHOICE = "choice"
    """A JSON list of strings: the output is exactly one of them."""
    GRAMMAR = "grammar"
    """A Lark grammar (llguidance's dialect) or a GBNF one (llama.cpp's), as vLLM takes."""


@dataclass(frozen=True)
class GrammarSpec:
    """One request's structured-output constraint, parsed from its body but not compiled."""

    field: str
    """The request field it came from (``response_format``, ``guided_json``, ...)."""
    format: GrammarFormat
    source: str
    """The schema or the choice list as JSON text, the regex, or the grammar text."""

    def __post_init__(self) -> None:
        if len(self.source) > MAX_GRAMMAR_SOURCE_CHARS:
            raise GrammarError(
                self.field, f"'{self.field}' has {len(self.source)} characters, more than {MAX_GRAMMAR_SOURCE_CHARS}"
            )


def json_schema_spec(schema: dict[str, Any], field: str = "json_schema") -> GrammarSpec:
    """The spec that constrains the output to JSON valid under ``schema`` (a JSON object)."""
    if not isinstance(schema, dict):
        raise GrammarError(field, f"'{field}' must be a JSON schema object")
    try:
        text = json.dumps(schema, ensure_ascii=False)
    except RecursionError:  # a body may nest 1024 deep (orjson's bound), Python's encoder less
        raise GrammarError(field, f"'{field}' is nested too deeply") from None
    return GrammarSpec(field, GrammarFormat.JSON_SCHEMA, text)


def grammar_spec(body: dict[str, Any]) -> GrammarSpec | None:
    """The one structured-output constraint the body asks for, or None; GrammarError when a field
    is malformed or more than one is given (vLLM refuses that too)."""
    found = [spec for spec in (_response_format(body.get("response_format")), *_guided(body)) if spec is not None]
    if len(found) > 1:
        fields = ", ".join(spec.field for spec in found)
        raise GrammarError(found[1].field, f"only one structured-output field may be given, got {fields}")
    return found[0] if found else None


def _response_format(value: Any) -> GrammarSpec | None:
    field = "response_format"
    kind = value.get("type") if isinstance(value, dict) else None
    if value is None or kind == "text":
        return None
    if kind == "json_object":
        return json_schema_spec(ANY_JSON_OBJECT, field)
    if kind != "json_schema":
        raise GrammarError(field, "'response_format' must be {'type': 'text' | 'json_object' | 'json_schema', ...}")
    return json_schema_spec(_described_schema(value.get("json_schema")), field)


def _described_schema(described: Any) -> dict[str, Any]:
    """OpenAI's ``json_schema``: ``{"name", "schema", "strict", "description"}``. ``strict`` asks
    for output that always matches the schema, which every schema here gets."""
    field = "response_format"
    if not isinstance(described, dict) or not isinstance(described.get("schema"), dict):
        raise GrammarError(field, "'response_format.json_schema' must be an object with a 'schema' object")
    strict = described.get("strict")
    if not isinstance(described.get("name", ""), str) or not (strict is None or isinstance(strict, bool)):
        raise GrammarError(field, "'response_format.json_schema': 'name' must be a string and 'strict' a boolean")
    return described["schema"]


def _guided(body: dict[str, Any]) -> list[GrammarSpec | None]:
    return [_guided_field(name, body.get(name)) for name in GUIDED_FIELDS]


def _guided_field(name: str, value: Any) -> GrammarSpec | None:
    if value is None:
        return None
    if name == "guided_json":
        return json_schema_spec(_schema_value(name, value), name)
    if name == "guided_choice":
        return _choice(value)
    if not isinstance(value, str) or not value:
        raise GrammarError(name, f"'{name}' must be a non-empty string")
    return GrammarSpec(name, GrammarFormat.REGEX if name == "guided_regex" else GrammarFormat.GRAMMAR, value)


def _choice(value: Any) -> GrammarSpec:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise GrammarError("guided_choice", "'guided_choice' must be a non-empty list of strings")
    return GrammarSpec("guided_choice", GrammarFormat.CHOICE, json.dumps(value, ensure_ascii=False))


def _schema_value(name: str, value: Any) -> Any:
    """vLLM takes ``guided_json`` as a schema object or as its JSON text."""
    if not isinstance(value, str):
        return value
    if len(value) > MAX_GRAMMAR_SOURCE_CHARS:
        raise GrammarError(name, f"'{name}' has {len(value)} characters, more than {MAX_GRAMMAR_SOURCE_CHARS}")
    try:
        return json.loads(value)
    except (ValueError, RecursionError):  # not JSON, or nested past Python's recursion limit
        raise GrammarError(name, f"'{name}' must be a JSON schema (an object, or its JSON text)") from None


def compile_grammar(spec: GrammarSpec, tokenizer: LLTokenizer | None = None) -> str:
    """llguidance's grammar for ``spec``, checked with the model's ``tokenizer`` as a worker will
    run it (its matcher built and its first mask computed; without a tokenizer, validated only):
    GrammarError, naming the field and llguidance's reason, when a schema uses what llguidance
    does not implement, a regex or grammar does not parse, the first step runs into a limit, or the
    result is over the bus's bound. Runs for up to tens of milliseconds: off the event loop."""
    try:
        grammar = grammar_from(spec.format.value, spec.source)
    except ValueError as exc:  # a JSON schema that is not an object, a GBNF grammar that does not convert
        raise GrammarError(spec.field, _reason(spec, str(exc))) from None
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise GrammarError(spec.field, f"'{spec.field}' compiles to more than {MAX_GRAMMAR_CHARS} characters")
    error = _validation_error(grammar) if tokenizer is None else _trial_error(grammar, tokenizer)
    if error:
        raise GrammarError(spec.field, _reason(spec, error))
    return grammar


def _validation_error(grammar: str) -> str:
    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar, None, limits=LIMITS)
    return (messages[0] if messages else "invalid") if failed else ""


def _trial_error(grammar: str, tokenizer: LLTokenizer) -> str:
    """The first step a worker takes: its matcher built, its first mask, the first allowed token
    taken. Validation alone misses what only a step meets: a rule of more than 2,000 alternatives
    (a choice of as many strings), a regex past the lexer's fuel (``((a{100}){100}){100}``)."""
    matcher = LLMatcher(tokenizer, grammar, log_level=0, limits=LIMITS)
    if matcher.is_error():
        return matcher.get_error()
    allowed = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    if allowed.any():
        matcher.consume_token(int(np.argmax(allowed)))
    return matcher.get_error()


def _reason(spec: GrammarSpec, error: str) -> str:
    what = {GrammarFormat.JSON_SCHEMA: "JSON schema", GrammarFormat.CHOICE: "choice list"}.get(
        spec.format, spec.format.value
    )
    return f"'{spec.field}': llguidance cannot compile this {what}: {error.strip()[:MAX_ERROR_CHARS]}"
