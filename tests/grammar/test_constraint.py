"""A request's grammar on a worker: the mask, advancing token by token, and the same state rebuilt
from the tokens alone (pure logic; llguidance with the byte-level tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from splitbus.grammar.constraint import Constraint, choose, mask_logits
from splitbus.grammar.outcomes import Advance, GrammarError
from splitbus.grammar.request import compile_grammar, grammar_spec, json_schema_spec
from splitbus.grammar.tokenizer import grammar_tokenizer
from splitbus.tokenization import ModelTokenizer

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> ModelTokenizer:
    return ModelTokenizer.load(tiny_model)


def _constraint(tokenizer: ModelTokenizer, body: dict[str, Any]) -> Constraint:
    spec = grammar_spec(body)
    assert spec is not None
    return Constraint.build(grammar_tokenizer(tokenizer), compile_grammar(spec))


def _texts(tokenizer: ModelTokenizer, ids: np.ndarray) -> set[str]:
    return {tokenizer.decode([int(i)], skip_special_tokens=False) for i in ids}


def test_no_grammar_no_mask() -> None:
    row = np.arange(4, dtype=np.float32)
    assert mask_logits(None, row) is row


def test_the_mask_allows_what_the_grammar_allows_next(tokenizer: ModelTokenizer) -> None:
    constraint = _constraint(tokenizer, {"guided_choice": ["yes", "no"]})
    assert _texts(tokenizer, constraint.allowed_ids()) == {"y", "n"}
    assert constraint.advance(tokenizer.encode("n")[0]) is Advance.GOING
    assert _texts(tokenizer, constraint.allowed_ids()) == {"o"}
    assert constraint.advance(tokenizer.encode("o")[0]) is Advance.COMPLETE  # nothing may follow "no"
    assert constraint.taken == 2


def test_masked_logits_refuse_all_but_the_allowed(tokenizer: ModelTokenizer) -> None:
    constraint = _constraint(tokenizer, {"guided_regex": "[0-9]+"})
    logits = np.zeros(tokenizer.vocab_size + 5, dtype=np.float32)  # a model's padded rows are no token
    masked = mask_logits(constraint, logits)
    assert masked.dtype == np.float32 and masked.shape == logits.shape
    allowed = np.flatnonzero(np.isfinite(masked))
    assert _texts(tokenizer, allowed) == set("0123456789")
    assert np.all(logits == 0)  # the engine's row is left as it was (the lead's logprobs read it)


def test_an_accepting_grammar_allows_the_end_of_sequence(tokenizer: ModelTokenizer) -> None:
    constraint = _constraint(tokenizer, {"guided_regex": "[0-9]+"})
    assert not constraint.accepting
    constraint.advance(tokenizer.encode("7")[0])
    eos = tokenizer.eos_token_ids[0]
    assert constraint.accepting and eos in constraint.allowed_ids()
    assert constraint.advance(eos) is Advance.COMPLETE


def test_a_refused_token_stops_the_grammar(tokenizer: ModelTokenizer) -> None:
    constraint = _constraint(tokenizer, {"guided_regex": "[0-9]+"})
    assert constraint.advance(tokenizer.encode("x")[0]) is Advance.REFUSED


def test_rebuilt_from_the_tokens_it_is_in_the_same_state(tokenizer: ModelTokenizer) -> None:
    body = {"guided_json": SCHEMA}
    text = '{"ok": true, "n": 4'
    tokens = tokenizer.encode(text)
    running = _constraint(tokenizer, body)
    masks = [running.allowed().copy()]
    for token in tokens:
        assert running.advance(token) is Advance.GOING
        masks.append(running.allowed().copy())
    for cut in (0, 1, len(tokens) // 2, len(tokens)):  # P -> D after `cut` tokens, or a migration
        moved = _constraint(tokenizer, body)
        moved.follow(tokens[:cut])
        assert moved.taken == cut
        assert np.array_equal(moved.allowed(), masks[cut])
        moved.follow(tokens)  # then only the tokens it has not taken
        assert np.array_equal(moved.allowed(), masks[-1])
    assert _texts(tokenizer, running.allowed_ids()) >= {"}", "0"}


def test_tokens_that_break_the_grammar_fail_the_rebuild(tokenizer: ModelTokenizer) -> None:
    constraint = _constraint(tokenizer, {"guided_json": SCHEMA})
    with pytest.raises(GrammarError, match="break the grammar"):
        constraint.follow(tokenizer.encode('{"nope"'))


def test_a_grammar_from_the_bus_that_does_not_build_fails_its_request(tokenizer: ModelTokenizer) -> None:
    for grammar in ("not json", '{"grammars": [{"lark_grammar": "start: nope"}]}', json.dumps({"x": 1})):
        with pytest.raises(GrammarError, match="does not build"):
            Constraint.build(grammar_tokenizer(tokenizer), grammar)


def test_choose_keeps_an_allowed_own_token(tokenizer: ModelTokenizer) -> None:
    assert choose(None, 5, (), 0.0) == 5
    constraint = _constraint(tokenizer, {"guided_regex": "[a-z]+"})
    a = tokenizer.encode("a")[0]
    assert choose(constraint, a, (), 0.9) == a
    digit = tokenizer.encode("1")[0]
    assert choose(constraint, digit, (), 0.5) == min(constraint.allowed_ids())  # not allowed: the lowest allowed
    assert tokenizer.decode([choose(constraint, digit, (), 0.5)]) == "a"


def test_choose_prefers_an_ending_sometimes(tokenizer: ModelTokenizer) -> None:
    constraint = _constraint(tokenizer, {"response_format": {"type": "json_object"}})
    for token in tokenizer.encode('{"k": "v'):
        constraint.advance(token)
    quote, brace = tokenizer.encode('"')[0], tokenizer.encode("}")[0]
    v = tokenizer.encode("v")[0]
    assert choose(constraint, v, (quote, brace), 0.1) == quote  # closes the string
    assert choose(constraint, v, (quote, brace), 0.9) == v
    regex = _constraint(tokenizer, {"guided_regex": "[a-z]+"})
    regex.advance(v)
    assert choose(regex, v, (quote,), 0.1) == tokenizer.eos_token_ids[0]  # complete: the end comes first


def test_a_json_schema_output_built_by_choose_parses(tokenizer: ModelTokenizer) -> None:
    """What the sim engine does: the output under a schema ends, and parses, for any seed."""
    spec = json_schema_spec({"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]})
    grammar = compile_grammar(spec, grammar_tokenizer(tokenizer))
    closers = tuple(tokenizer.encode(c)[0] for c in '"}]')
    rng = np.random.default_rng(7)
    for _ in range(20):
        constraint = Constraint.build(grammar_tokenizer(tokenizer), grammar)
        tokens: list[int] = []
        while len(tokens) < 400:
            tokens.append(choose(constraint, int(rng.integers(tokenizer.vocab_size)), closers, float(rng.random())))
            if constraint.advance(tokens[-1]) is not Advance.GOING:
                break
        assert isinstance(json.loads(tokenizer.decode(tokens))["s"], str)


def test_a_matcher_in_error_allows_only_the_end(tokenizer: ModelTokenizer) -> None:
    """A matcher that fails (a limit met in a state the API's trial did not reach, a refused token):
    the request ends on its next token, it neither hangs nor draws from an all -inf row."""
    constraint = _constraint(tokenizer, {"guided_regex": "[0-9]+"})
    assert constraint.error == ""
    assert constraint.advance(tokenizer.encode("x")[0]) is Advance.REFUSED
    assert constraint.error and list(constraint.allowed_ids()) == list(tokenizer.eos_token_ids)
