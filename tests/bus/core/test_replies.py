"""The reply helpers every protocol reads Redis's replies with: pure logic, no Redis needed."""

from __future__ import annotations

import pytest

from splitbus.bus.core.replies import pairs, text


def test_text_of_an_id_or_name() -> None:
    assert text(b"1796151463299-0") == "1796151463299-0"
    assert text("decode-0") == "decode-0"
    with pytest.raises(UnicodeDecodeError):
        text(b"\xff")


def test_pairs_of_a_flat_field_value_list() -> None:
    assert pairs([b"type", b"token", b"data", b"{}"]) == {b"type": b"token", b"data": b"{}"}
    assert pairs([]) == {}
    assert pairs([b"type", b"token", b"data"]) == {b"type": b"token"}  # a trailing field without a value
    with pytest.raises(ValueError):
        pairs([b"type", b"token", b"data"], strict=True)
