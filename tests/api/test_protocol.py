"""Request parsing, on hand-made bodies (no server needed)."""

from __future__ import annotations

import pytest

from splitbus.api.errors import BadRequest
from splitbus.api.protocol import parse_completion


def test_ignore_eos_is_taken_as_vllm_does() -> None:
    assert parse_completion({"model": "m", "prompt": "x", "ignore_eos": True}).ignore_eos
    assert not parse_completion({"model": "m", "prompt": "x"}).ignore_eos


def test_ignore_eos_must_be_a_boolean() -> None:
    with pytest.raises(BadRequest, match="'ignore_eos' must be a boolean"):
        parse_completion({"model": "m", "prompt": "x", "ignore_eos": "yes"})
