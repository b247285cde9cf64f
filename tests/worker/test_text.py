"""Incremental text and stop strings (pure logic, the byte-level tokenizer)."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from splitbus.api.protocol import MAX_STOP_CHARS, MAX_STOP_SEQUENCES
from splitbus.tokenization import ModelTokenizer
from splitbus.worker.text import StopMatcher, TextStream


def _tokenizer(tiny_model: Path) -> ModelTokenizer:
    return ModelTokenizer.load(tiny_model)


def _run(tokenizer: ModelTokenizer, text: str, stop: list[str]) -> tuple[list[str], TextStream]:
    stream = TextStream(tokenizer, stop)
    return [stream.push([t]) for t in tokenizer.encode(text)], stream


def test_multibyte_characters_come_out_whole(tiny_model: Path) -> None:
    tok = _tokenizer(tiny_model)
    pieces, stream = _run(tok, "né 🙂!", [])
    assert "".join(pieces) == "né 🙂!"
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_is_cut_and_never_sent(tiny_model: Path) -> None:
    tok = _tokenizer(tiny_model)
    pieces, stream = _run(tok, "the quick brown fox jumps", ["fox", "zzz"])
    assert "".join(pieces) == "the quick brown "
    assert stream.stopped and stream.flush() == ""


def test_partial_stop_is_held_then_released(tiny_model: Path) -> None:
    tok = _tokenizer(tiny_model)
    pieces, stream = _run(tok, "a fo", ["fox"])
    assert "".join(pieces) == "a " and not stream.stopped
    assert stream.flush() == "fo"  # the request ended for another reason: send what was held
    pieces, _ = _run(tok, "a fog", ["fox"])
    assert "".join(pieces) == "a fog"


def test_replay_reaches_the_same_state(tiny_model: Path) -> None:
    tok = _tokenizer(tiny_model)
    ids = tok.encode("xx ab")
    first = TextStream(tok, ["abc"])
    sent = "".join(first.push([t]) for t in ids)
    second = TextStream(tok, ["abc"])
    second.push(ids)  # a decode worker that takes over replays the tokens
    assert sent == "xx " and first.push(tok.encode("c")) == second.push(tok.encode("c")) == ""
    assert first.stopped and second.stopped


def test_a_replay_that_ends_inside_a_character_sends_nothing_twice(tiny_model: Path) -> None:
    """Tokens pushed at once (a worker taking over a request replays those already sent) reach
    the state of the same tokens pushed one by one, wherever the replay ends: mid-character too.
    (Pushed at once they used to hold back all their text, and the next token sent it again.)"""
    tok = _tokenizer(tiny_model)
    ids = tok.encode("né 🙂 ok 🙂🙂 fin")
    reference = TextStream(tok, [])
    one_by_one = [reference.push([t]) for t in ids]
    for cut in range(1, len(ids)):
        replayed = TextStream(tok, [])
        assert replayed.push(ids[:cut]) == "".join(one_by_one[:cut])
        assert [replayed.push([t]) for t in ids[cut:]] == one_by_one[cut:], cut


def test_flush_sends_bytes_that_never_completed_a_character(tiny_model: Path) -> None:
    tok = _tokenizer(tiny_model)
    ids = tok.encode("ok 🙂")[:-1]  # the emoji's last byte never comes
    stream = TextStream(tok, [])
    sent = "".join(stream.push([t]) for t in ids)
    assert sent == "ok "
    assert stream.flush() == tok.decode(ids)[len("ok ") :]


# ---------------------------------------------------------------- stop strings: cost and correctness


class NaiveStops:
    """The stop check as it was (search held + new text for every stop, try every prefix of
    every stop): the reference the streaming matcher must agree with."""

    def __init__(self, stops: list[str]) -> None:
        self.stops, self.held, self.stopped = stops, "", False

    def feed(self, new: str) -> str:
        text = self.held + new
        hits = [text.index(s) for s in self.stops if s in text]
        if hits:
            self.stopped, self.held = True, ""
            return text[: min(hits)]
        keep = max((n for s in self.stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]


@settings(max_examples=400, deadline=None)
@given(
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=6), min_size=1, max_size=4),
    chunks=st.lists(st.text(alphabet="abcd", max_size=5), max_size=30),
)
def test_streaming_stop_check_agrees_with_the_naive_one(stops: list[str], chunks: list[str]) -> None:
    fast, naive = StopMatcher(stops), NaiveStops(stops)
    for chunk in chunks:
        sent, stopped = fast.feed(chunk)
        assert sent == naive.feed(chunk)
        assert stopped == naive.stopped
        if stopped:
            return
        assert "".join(fast.held) == naive.held
    assert fast.take_held() == naive.held


def test_sixteen_longest_stops_cost_linear_work_per_token(tiny_model: Path) -> None:
    """The CPU-burn attack: 16 stop strings of the longest allowed length, which the text keeps
    almost matching (so the held tail is as long as it can be). The comparisons the stop check
    makes stay within 2 per character per stop, and the held text under the longest stop."""
    tok = _tokenizer(tiny_model)
    stops = ["a" * (MAX_STOP_CHARS - 1) + chr(ord("b") + i) for i in range(MAX_STOP_SEQUENCES)]
    stream = TextStream(tok, stops)
    tokens = 3 * MAX_STOP_CHARS
    sent = [stream.push(tok.encode("a")) for _ in range(tokens)]
    assert not stream.stopped and stream.held == MAX_STOP_CHARS - 1
    assert "".join(sent) == "a" * (tokens - stream.held)
    assert stream.steps <= 2 * len(stops) * tokens
    assert stream.push(tok.encode("z")) == "a" * (MAX_STOP_CHARS - 1) + "z"  # a miss releases the whole tail
    assert stream.held == 0
    assert stream.push(tok.encode("a" * (MAX_STOP_CHARS - 1) + "q")) == ""  # "...aq" is the 16th stop
    assert stream.stopped and stream.steps <= 2 * len(stops) * (tokens + 1 + MAX_STOP_CHARS)
