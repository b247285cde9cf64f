"""A response's choices (splitbus/api/choices.py): how they are published, with stand-ins for
the API's state (pure logic; tests/e2e/test_choices.py runs them through a real system)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from splitbus.api import choices, metrics


class State:
    def __init__(self) -> None:
        self.written: list[list[str]] = []
        self.choices: list[Choice] = []
        self.subscribed_when_written: list[bool] = []

    async def submit_together(self, requests: Sequence[str]) -> None:
        self.subscribed_when_written = [c.subscribed for c in self.choices]
        self.written.append(list(requests))


class Choice:
    """Subscribes after ``delay_s`` (or fails to); its message is its name."""

    def __init__(self, name: str, state: State, fails: bool = False, delay_s: float = 0.0) -> None:
        self.name, self.state, self.fails, self.delay_s = name, state, fails, delay_s
        self.subscribed = False
        self.prompt_ids = [1, 2]
        self.queueing = SimpleNamespace(tenant="choices-test")

    async def subscribe(self) -> None:
        await asyncio.sleep(self.delay_s)
        if self.fails:
            raise ConnectionError("Redis went away")
        self.subscribed = True

    def message(self) -> str:
        return self.name

    async def submitted(self, submit: Awaitable[None]) -> None:
        await submit


async def test_the_choices_are_written_together_once_each_follows_its_stream() -> None:
    state = State()
    many: list[Any] = [Choice(f"c-{i}", state, delay_s=0.01 * (3 - i)) for i in range(3)]
    state.choices = many
    tenant_prompt = metrics.TENANT_PROMPT_TOKENS.labels("choices-test")
    before = tenant_prompt._value.get()
    await choices._publish(many)
    assert state.written == [["c-0", "c-1", "c-2"]]
    assert tenant_prompt._value.get() - before == 4  # the other choices' prompts (the first's: submitted)
    assert state.subscribed_when_written == [True] * 3  # no entry before its stream is followed


async def test_every_subscription_is_made_before_an_error_is_raised_and_nothing_is_written() -> None:
    """The caller then closes every choice that subscribed: none is left following a stream
    (a subscription still under way would have had nothing to close yet)."""
    state = State()
    many: list[Any] = [Choice("c-0", state, fails=True), Choice("c-1", state, delay_s=0.05)]
    with pytest.raises(ConnectionError):
        await choices._publish(many)
    assert [c.subscribed for c in many] == [False, True] and state.written == []
