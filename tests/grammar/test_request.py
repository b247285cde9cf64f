"""Structured-output fields -> one grammar: parsing, compiling, and the 400s that name the field
(pure logic; llguidance with the byte-level tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from llguidance import LLTokenizer
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from splitbus.bus.messages import SamplingParams
from splitbus.bus.messages._check import MAX_GRAMMAR_CHARS
from splitbus.env import load_env
from splitbus.grammar.outcomes import GrammarError
from splitbus.grammar.request import (
    MAX_GRAMMAR_SOURCE_CHARS,
    GrammarFormat,
    GrammarSpec,
    compile_grammar,
    grammar_spec,
    json_schema_spec,
)
from splitbus.grammar.tokenizer import grammar_tokenizer
from splitbus.model_files.fetch import SOURCES, fetched_path
from splitbus.model_files.gguf import open_reader
from splitbus.model_files.gguf.vocab import tokenizer_files
from splitbus.tokenization import ModelTokenizer

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def _spec(body: dict[str, Any]) -> GrammarSpec:
    spec = grammar_spec(body)
    assert spec is not None
    return spec


def _refused(body: dict[str, Any]) -> GrammarError:
    with pytest.raises(GrammarError) as info:
        spec = grammar_spec(body)
        assert spec is not None
        compile_grammar(spec)
    return info.value


def test_no_field_or_text_format_is_unconstrained() -> None:
    assert grammar_spec({}) is None
    assert grammar_spec({"response_format": {"type": "text"}, "guided_json": None}) is None


def test_json_object_is_any_json_object() -> None:
    spec = _spec({"response_format": {"type": "json_object"}})
    assert (spec.field, spec.format, json.loads(spec.source)) == (
        "response_format",
        GrammarFormat.JSON_SCHEMA,
        {"type": "object"},
    )


def test_json_schema_takes_its_schema() -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    spec = _spec({"response_format": rf})
    assert json.loads(spec.source) == PERSON
    assert '"json_schema"' in compile_grammar(spec)


@pytest.mark.parametrize(
    ("field", "value", "format"),
    [
        ("guided_json", PERSON, GrammarFormat.JSON_SCHEMA),
        ("guided_json", json.dumps(PERSON), GrammarFormat.JSON_SCHEMA),
        ("guided_regex", r"\d{3}-\d{4}", GrammarFormat.REGEX),
        ("guided_choice", ["yes", "no"], GrammarFormat.CHOICE),
        ("guided_grammar", 'start: "a" "b"+', GrammarFormat.GRAMMAR),
        ("guided_grammar", 'root ::= "a" "b"+', GrammarFormat.GRAMMAR),  # GBNF, as llama.cpp writes it
    ],
)
def test_vllm_guided_fields_compile(field: str, value: Any, format: GrammarFormat) -> None:
    spec = _spec({field: value})
    assert (spec.field, spec.format) == (field, format)
    assert compile_grammar(spec)


@pytest.mark.parametrize(
    ("body", "field", "says"),
    [
        ({"response_format": {"type": "xml"}}, "response_format", "'type'"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "'schema' object"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": []}}}, "response_format", "'schema'"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}},
            "response_format",
            "'strict'",
        ),
        ({"guided_json": "{not json"}, "guided_json", "JSON schema"),
        ({"guided_json": [1]}, "guided_json", "JSON schema object"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"guided_choice": ["a", 1]}, "guided_choice", "list of strings"),
        ({"guided_regex": 5}, "guided_regex", "non-empty string"),
        ({"guided_grammar": ""}, "guided_grammar", "non-empty string"),
        ({"guided_regex": "a(b"}, "guided_regex", "unclosed group"),
        ({"guided_grammar": "start: undefined_rule"}, "guided_grammar", "undefined_rule"),
        ({"guided_json": {"type": "object", "if": {"required": ["a"]}}}, "guided_json", "if"),
        ({"guided_json": {"type": "wat"}}, "guided_json", "wat"),
    ],
)
def test_a_malformed_or_unsupported_field_is_refused_by_name(body: dict[str, Any], field: str, says: str) -> None:
    error = _refused(body)
    assert error.field == field
    assert says in str(error)


def test_a_schema_nested_past_pythons_recursion_is_refused() -> None:
    """orjson takes a body nested 1024 deep; Python's JSON encoder and decoder stop before."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(1000):
        schema = {"type": "array", "items": schema}
    assert "nested too deeply" in str(_refused({"guided_json": schema}))
    assert "must be a JSON schema" in str(_refused({"guided_json": "[" * 5000}))


def test_only_one_constraint_at_a_time() -> None:
    error = _refused({"response_format": {"type": "json_object"}, "guided_regex": "a"})
    assert error.field == "guided_regex" and "only one" in str(error)


def test_sources_are_bounded() -> None:
    long = "a" * (MAX_GRAMMAR_SOURCE_CHARS + 1)
    for body in ({"guided_regex": long}, {"guided_json": json.dumps({"description": long})}, {"guided_choice": [long]}):
        assert "more than" in str(_refused(body))
    longest = GrammarSpec("guided_regex", GrammarFormat.REGEX, "ab" * (MAX_GRAMMAR_SOURCE_CHARS // 2))
    assert len(compile_grammar(longest)) <= MAX_GRAMMAR_CHARS  # what the API admits fits the bus
    escaped = GrammarSpec("guided_regex", GrammarFormat.REGEX, "\x01" * MAX_GRAMMAR_SOURCE_CHARS)  # \u0001 each
    with pytest.raises(GrammarError, match=f"compiles to more than {MAX_GRAMMAR_CHARS}"):
        compile_grammar(escaped)


def test_the_bus_bounds_the_grammar() -> None:
    assert SamplingParams(grammar=compile_grammar(json_schema_spec(PERSON))).grammar
    with pytest.raises(ValueError, match="grammar must be at most"):
        SamplingParams(grammar="x" * (MAX_GRAMMAR_CHARS + 1))
    with pytest.raises(ValueError, match="grammar must be a string"):
        SamplingParams(grammar=["x"])  # type: ignore[arg-type]


def test_compiling_with_the_model_vocabulary(tiny_model: Path) -> None:
    tokenizer = ModelTokenizer.load(tiny_model)
    llg = grammar_tokenizer(tokenizer)
    assert grammar_tokenizer(tokenizer) is llg  # built once per model
    assert llg.vocab_size == tokenizer.vocab_size and llg.eos_tokens == list(tokenizer.eos_token_ids)
    assert compile_grammar(_spec({"guided_grammar": 'start: "a" <|im_end|>'}), llg)  # a special token by name
    with pytest.raises(GrammarError, match="nope"):
        compile_grammar(_spec({"guided_grammar": 'start: "a" <|nope|>'}), llg)


def test_a_schema_for_other_callers() -> None:
    spec = json_schema_spec({"type": "array"}, "tool_choice")
    assert (spec.field, spec.format) == ("tool_choice", GrammarFormat.JSON_SCHEMA)
    with pytest.raises(GrammarError, match="tool_choice"):
        json_schema_spec("not a schema", "tool_choice")  # type: ignore[arg-type]


GGUF = fetched_path(SOURCES["smollm2"], load_env().data_dir / "models")


@pytest.fixture(scope="module")
def smollm2_vocabulary() -> LLTokenizer:
    """llguidance's view of SmolLM2's 49,152 tokens, from its GGUF file's metadata (the weights
    are not converted). What follows needs a real vocabulary: the byte-level test tokenizer's
    first masks meet no limit."""
    if not GGUF.is_file():
        pytest.skip(f"{GGUF} is absent: `splitbus fetch-model smollm2` puts it there")
    files = tokenizer_files(open_reader(GGUF))
    eos = Tokenizer.from_str(files["tokenizer.json"]).token_to_id("<|im_end|>")
    return LLTokenizer(files["tokenizer.json"], eos_token=eos)


def test_what_only_the_first_mask_meets_is_refused_before_admission(smollm2_vocabulary: LLTokenizer) -> None:
    """Validation alone passes these; the API's trial of the worker's first step does not."""
    many = _spec({"guided_choice": [f"option number {i}" for i in range(2001)]})
    compile_grammar(many)  # validated only: no tokenizer, no mask
    with pytest.raises(GrammarError, match="max is 2000"):
        compile_grammar(many, smollm2_vocabulary)
    with pytest.raises(GrammarError, match="too many expressions"):
        compile_grammar(_spec({"guided_regex": "((a{100}){100}){100}"}), smollm2_vocabulary)
    assert compile_grammar(_spec({"guided_choice": [f"option number {i}" for i in range(1000)]}), smollm2_vocabulary)


def test_a_tokenizer_llguidance_cannot_read_is_a_grammar_error(tiny_model: Path) -> None:
    """The model then serves no structured output: its constrained requests fail alone (a 400 in
    the API, ``invalid_grammar`` on a worker), nothing else does."""
    word_level = ModelTokenizer.load(tiny_model)
    word_level.tokenizer = Tokenizer(WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))  # no decoder
    with pytest.raises(GrammarError, match="cannot read the tokenizer"):
        grammar_tokenizer(word_level)
