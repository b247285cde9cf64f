"""Special tokens in generated text, as vLLM prints them: skip_special_tokens,
spaces_between_special_tokens, and the token that ends a request never printed."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from splitbus.bus.messages import GenerateRequest, SamplingParams, Task
from splitbus.tokenization import ModelTokenizer
from splitbus.tokenization.byte_level import byte_level_tokenizer
from splitbus.worker.sequence import Sequence
from splitbus.worker.text import TextStream

ENDOFTEXT, IM_START, IM_END = 256, 257, 258  # the byte-level tokenizer's specials


def _model(tokenizer: Tokenizer, eos: tuple[int, ...] = ()) -> ModelTokenizer:
    return ModelTokenizer("m", tokenizer, "", False, eos, None, None, 512)


@pytest.fixture
def byte_level() -> ModelTokenizer:
    tokenizer = byte_level_tokenizer()
    tokenizer.add_tokens(["<tool_call>"])  # added, not special: printed whatever skip_special_tokens says
    return _model(tokenizer, eos=(IM_END,))


@pytest.fixture
def spaced() -> ModelTokenizer:
    """Words, and a decoder (WordPiece's) that puts a space between tokens, added ones included."""
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.add_special_tokens(["<a>", "<b>"])
    return _model(tokenizer)


def _text(tok: ModelTokenizer, ids: list[int], **options: bool) -> str:
    stream = TextStream(tok, [], **options)
    return "".join(stream.push([t]) for t in ids) + stream.flush()


def test_a_special_token_mid_text_prints_nothing_by_default(byte_level: ModelTokenizer) -> None:
    ids = [*byte_level.encode("ab"), IM_START, *byte_level.encode("cé"), ENDOFTEXT]
    assert _text(byte_level, ids) == "abcé"
    assert _text(byte_level, ids, skip_special_tokens=False) == "ab<|im_start|>cé<|endoftext|>"


def test_a_non_special_added_token_always_prints(byte_level: ModelTokenizer) -> None:
    ids = byte_level.encode("x<tool_call>y")
    assert len(ids) == 3
    assert _text(byte_level, ids) == _text(byte_level, ids, skip_special_tokens=False) == "x<tool_call>y"


def test_spaces_between_special_tokens_as_vllm(spaced: ModelTokenizer) -> None:
    ids = spaced.tokenizer.encode("hello <a> <b> world <a>").ids
    assert _text(spaced, ids, skip_special_tokens=False) == "hello <a> <b> world <a>"  # the decoder's own text
    bare = {"skip_special_tokens": False, "spaces_between_special_tokens": False}
    assert _text(spaced, ids, **bare) == "hello <a><b> world <a>"  # only between two added tokens
    assert _text(spaced, ids, spaces_between_special_tokens=False) == "hello world"  # skipped: nothing to space


def test_bare_special_tokens_replay_to_the_same_state(spaced: ModelTokenizer) -> None:
    ids = spaced.tokenizer.encode("hello <a> <b> <a>").ids
    bare = {"skip_special_tokens": False, "spaces_between_special_tokens": False}
    one_by_one = TextStream(spaced, ["world"], **bare)
    sent = "".join(one_by_one.push([t]) for t in ids)
    replayed = TextStream(spaced, ["world"], **bare)
    assert replayed.push(ids) == sent == "hello <a><b><a>"
    world = spaced.tokenizer.token_to_id("world")
    assert one_by_one.push([world]) == replayed.push([world]) == " " and one_by_one.stopped and replayed.stopped


def test_for_request_takes_the_sampling_options(spaced: ModelTokenizer) -> None:
    sampling = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False, stop=["wor"])
    ids = spaced.tokenizer.encode("<a> <b> world").ids
    stream = TextStream.for_request(spaced, sampling)
    assert stream.push(ids) == "<a><b> " and stream.stopped


def _sequence(tok: ModelTokenizer, **sampling: object) -> Sequence:
    params = SamplingParams(**{"max_tokens": 50, **sampling})  # type: ignore[arg-type]  # the fields vary per test
    request = GenerateRequest("r1", "m", [1], params, "api", 0)
    return Sequence(Task("mixed", request), "0-0", TextStream.for_request(tok, params))


def _generate(seq: Sequence, ids: list[int], eos: tuple[int, ...]) -> str:
    text = ""
    for token in ids:
        text += seq.add_token(token, eos)
        if seq.finished:
            break
    return text + seq.text.flush()


@pytest.mark.parametrize("skip", [True, False])
def test_eos_ends_the_request_and_never_prints(byte_level: ModelTokenizer, skip: bool) -> None:
    seq = _sequence(byte_level, skip_special_tokens=skip)
    assert _generate(seq, [*byte_level.encode("hi"), IM_END, *byte_level.encode("more")], (IM_END,)) == "hi"
    assert seq.finish_reason == "stop" and len(seq.output_ids) == 3


def test_a_stop_token_id_ends_the_request_unprinted_even_when_not_special(byte_level: ModelTokenizer) -> None:
    bang = byte_level.encode("!")[0]
    seq = _sequence(byte_level, stop_token_ids=[bang], skip_special_tokens=False, stop=["hi!"])
    assert _generate(seq, byte_level.encode("oh hi!!"), (IM_END,)) == "oh hi"  # held "hi" sent at the end
    assert seq.finish_reason == "stop" and seq.output_ids == byte_level.encode("oh hi!")


def test_with_ignore_eos_the_eos_token_is_text_like_any_other(byte_level: ModelTokenizer) -> None:
    ids = [*byte_level.encode("a"), IM_END, *byte_level.encode("b")]
    seq = _sequence(byte_level, ignore_eos=True, skip_special_tokens=False, max_tokens=3)
    assert _generate(seq, ids, (IM_END,)) == "a<|im_end|>b" and seq.finish_reason == "length"
    quiet = _sequence(byte_level, ignore_eos=True, max_tokens=3)
    assert _generate(quiet, ids, (IM_END,)) == "ab"


def test_stop_strings_behave_as_before_around_special_tokens(byte_level: ModelTokenizer) -> None:
    ids = [*byte_level.encode("a"), IM_START, *byte_level.encode("bc d")]
    seq = _sequence(byte_level, stop=["bc"])
    assert _generate(seq, ids, (IM_END,)) == "a" and seq.finish_reason == "stop"
    shown = _sequence(byte_level, stop=["<|im_start|>b"], skip_special_tokens=False)
    assert _generate(shown, ids, (IM_END,)) == "a" and shown.finish_reason == "stop"


def test_no_token_ends_the_request_before_min_tokens(byte_level: ModelTokenizer) -> None:
    # The paddle engine never draws one there; the sim engine, which draws without logits, may.
    bang = byte_level.encode("!")[0]
    seq = _sequence(byte_level, stop_token_ids=[bang], min_tokens=3)
    assert _generate(seq, byte_level.encode("!a!b!c"), (IM_END,)) == "!a!b"
    assert seq.finish_reason == "stop" and len(seq.output_ids) == 5
    eos = _sequence(byte_level, min_tokens=2)
    assert _generate(eos, [IM_END, *byte_level.encode("x"), IM_END, *byte_level.encode("y")], (IM_END,)) == "x"
    assert eos.finish_reason == "stop" and len(eos.output_ids) == 3


def test_a_stop_string_counts_only_once_it_ends_past_min_tokens(byte_level: ModelTokenizer) -> None:
    """vLLM's rule: no stop string ends the request within the first min_tokens tokens; one that
    begins there and ends after does. A replay (all tokens pushed at once) reaches the same state."""
    ids = byte_level.encode("abcab!abc")
    for stop, min_tokens, sent in ((["ab"], 0, ""), (["ab"], 2, "abc"), (["ab"], 5, "abcab!"), (["abc"], 2, "")):
        stream = TextStream(byte_level, stop, min_tokens=min_tokens)
        text = ""
        for token in ids:
            text += stream.push([token])
            if stream.stopped:
                break
        assert text == sent and stream.stopped
        replayed = TextStream(byte_level, stop, min_tokens=min_tokens)
        assert replayed.push(ids) == sent and replayed.stopped
    sampling = SamplingParams(max_tokens=16, stop=["ab"], min_tokens=2)
    assert TextStream.for_request(byte_level, sampling).push(ids) == "abc"
