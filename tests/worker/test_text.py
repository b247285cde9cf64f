"""Incremental text and stop strings (pure logic, the byte-level tokenizer)."""

from __future__ import annotations

from pathlib import Path

from splitbus.tokenization import ModelTokenizer
from splitbus.worker.text import TextStream


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


def test_flush_sends_bytes_that_never_completed_a_character(tiny_model: Path) -> None:
    tok = _tokenizer(tiny_model)
    ids = tok.encode("ok 🙂")[:-1]  # the emoji's last byte never comes
    stream = TextStream(tok, [])
    sent = "".join(stream.push([t]) for t in ids)
    assert sent == "ok "
    assert stream.flush() == tok.decode(ids)[len("ok ") :]
