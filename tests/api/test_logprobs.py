"""How a choice shows its text and logprobs (``splitbus.api.logprobs``): OpenAI's completions and
chat forms, echo, vLLM's prompt_logprobs, and token labels for bytes that are part of a character."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from splitbus.api.logprobs import Choice, TokenLabels, merged
from splitbus.api.protocol import parse_chat, parse_completion
from splitbus.bus.messages import Finished, Logprobs, TokenDelta
from splitbus.tokenization import ModelTokenizer
from splitbus.tokenization.byte_level import write_byte_level_tokenizer


@pytest.fixture(scope="module")
def labels(tmp_path_factory: pytest.TempPathFactory) -> TokenLabels:
    folder = tmp_path_factory.mktemp("bytes")
    vocab = write_byte_level_tokenizer(folder)
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 64, "vocab_size": vocab}))
    return TokenLabels(ModelTokenizer.load(Path(folder)))


def _ids(labels: TokenLabels, text: str) -> list[int]:
    return labels._tokenizer.encode(text)


def test_a_token_that_is_part_of_a_character_is_labelled_by_its_bytes(labels: TokenLabels) -> None:
    a, first, second = _ids(labels, "aé")
    assert (labels(a).text, labels(a).raw) == ("a", b"a")
    assert (labels(first).text, labels(first).raw) == ("bytes:\\xc3", b"\xc3")
    assert (labels(second).text, labels(second).raw) == ("bytes:\\xa9", b"\xa9")


def test_completion_logprobs_are_four_parallel_lists_with_the_token_among_its_top(labels: TokenLabels) -> None:
    a, b = _ids(labels, "ab")
    params = parse_completion({"model": "m", "prompt": "x", "logprobs": 1})
    choice = Choice(params, [9], labels, "x")
    first = choice.piece(TokenDelta(0, [a], "a", Logprobs([-0.5], [[a]], [[-0.5]])))
    second = choice.piece(TokenDelta(1, [b], "b", Logprobs([-2.0], [[a]], [[-0.25]])))
    assert first.logprobs == {
        "tokens": ["a"],
        "token_logprobs": [-0.5],
        "top_logprobs": [{"a": -0.5}],
        "text_offset": [0],
    }
    assert second.logprobs == {
        "tokens": ["b"],
        "token_logprobs": [-2.0],
        "top_logprobs": [{"a": -0.25, "b": -2.0}],  # a sampled token outside the top comes too
        "text_offset": [1],
    }
    assert first.prompt_logprobs is None and second.text == "b"


def test_echo_puts_the_prompt_first_its_first_token_without_logprob(labels: TokenLabels) -> None:
    prompt, (c,) = _ids(labels, "xy"), _ids(labels, "c")
    params = parse_completion({"model": "m", "prompt": "xy", "logprobs": 0, "echo": True, "max_tokens": 0})
    choice = Choice(params, prompt, labels, "xy")
    whole = merged(
        [
            TokenDelta(0, [c], "c", Logprobs([-1.0], [[]], [[]]), Logprobs([-3.0], [[c]], [[-0.1]])),
            Finished(1, "length", 2, 1),
        ]
    )
    piece = choice.piece(whole)
    assert choice.echo_only and piece.text == "xy"  # max_tokens 0: the generated token is not shown
    assert piece.logprobs == {
        "tokens": ["x", "y"],
        "token_logprobs": [None, -3.0],
        "top_logprobs": [None, {"y": -3.0}],  # top 0: the token alone
        "text_offset": [0, 1],
    }


def test_chat_logprobs_are_content_items_with_bytes(labels: TokenLabels) -> None:
    a, b = _ids(labels, "ab")
    params = parse_chat(
        {"model": "m", "messages": [{"role": "user", "content": "q"}], "logprobs": True, "top_logprobs": 2}
    )
    piece = Choice(params, [1], labels, "").piece(TokenDelta(0, [a], "a", Logprobs([-0.5], [[a, b]], [[-0.5, -1.5]])))
    assert piece.logprobs == {
        "content": [
            {
                "token": "a",
                "logprob": -0.5,
                "bytes": [97],
                "top_logprobs": [
                    {"token": "a", "logprob": -0.5, "bytes": [97]},
                    {"token": "b", "logprob": -1.5, "bytes": [98]},
                ],
            }
        ],
        "refusal": None,
    }


def test_prompt_logprobs_are_vllms_rows_null_first(labels: TokenLabels) -> None:
    x, y, z = _ids(labels, "xyz")
    params = parse_completion({"model": "m", "prompt": "xyz", "prompt_logprobs": 1})
    assert params.prompt_top == 1 and params.logprobs is None
    prompt = Logprobs([-2.0, -0.5], [[x, z], [z, y]], [[-1.0, -1.5], [-0.5, -1.0]])
    piece = Choice(params, [x, y, z], labels, "").piece(TokenDelta(0, [x], "x", None, prompt))
    assert piece.logprobs is None and piece.prompt_logprobs == [
        None,
        {
            str(x): {"logprob": -1.0, "rank": 1, "decoded_token": "x"},
            str(y): {"logprob": -2.0, "rank": None, "decoded_token": "y"},
        },
        {str(z): {"logprob": -0.5, "rank": 1, "decoded_token": "z"}},
    ]


def test_many_results_merge_once_in_order_with_their_logprobs() -> None:
    deltas = [TokenDelta(i, [i], chr(97 + i % 26), Logprobs([-0.5], [[i]], [[-0.5]])) for i in range(3000)]
    whole = merged([*deltas, Finished(3000, "length", 1, 3000)])
    assert isinstance(whole, Finished) and whole.token_ids == list(range(3000)) and len(whole.text) == 3000
    assert whole.logprobs is not None and whole.logprobs.top_ids[2999] == [2999]
    one = TokenDelta(0, [1], "a", None, Logprobs([], [], []))  # a one-token prompt's: empty, not absent
    assert merged([one, Finished(1, "length", 1, 1)]).prompt_logprobs == Logprobs([], [], [])


def test_prompt_logprobs_that_do_not_score_this_prompt_are_left_out(labels: TokenLabels) -> None:
    params = parse_completion({"model": "m", "prompt": "xyz", "prompt_logprobs": 0, "echo": True, "logprobs": 0})
    piece = Choice(params, [1, 2, 3], labels, "xyz").piece(TokenDelta(0, [4], "w", None, Logprobs([-1.0], [[]], [[]])))
    assert piece.prompt_logprobs is None and piece.logprobs is not None
    assert piece.logprobs["token_logprobs"] == [None, None, None, None]  # echoed, unscored
