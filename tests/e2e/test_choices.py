"""``n`` > 1 through `splitbus up` (sim engine, two P and two D) with the openai client: each choice
a request of its own, its draws from (seed, index), so the texts are known in advance and repeat
exactly; the choices go to one P, which prefills their prompt once."""

from __future__ import annotations

import time
from collections.abc import Iterator

import openai
import pytest

from splitbus.api.protocol import choice_seed
from splitbus.bus.core.keys import Keys
from splitbus.worker.engines.sim import sim_text
from tests.e2e.conftest import System, start_system, stop_system

N, TOKENS, SEED = 3, 12, 41


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    running = start_system(tmp_path_factory.mktemp("up"), "--prefill", "2", "--decode", "2")
    yield running
    assert stop_system(running) == []


def _client(system: System) -> openai.OpenAI:
    return openai.OpenAI(base_url=system.v1, api_key="x", max_retries=0, timeout=60)


def _expected() -> list[str]:
    return [sim_text(choice_seed(SEED, i), TOKENS) for i in range(N)]  # type: ignore[arg-type]


def test_n_choices_have_their_own_indexes_draws_and_usage(system: System) -> None:
    client = _client(system)
    reply = client.completions.create(model="tiny", prompt="Hi", max_tokens=TOKENS, seed=SEED, n=N)
    assert [c.index for c in reply.choices] == list(range(N))
    assert [c.text for c in reply.choices] == _expected() and len(set(_expected())) == N
    assert reply.choices[0].text == sim_text(SEED, TOKENS)  # the first choice is the n = 1 answer
    assert reply.usage is not None and reply.usage.completion_tokens == N * TOKENS
    assert (
        reply.usage.prompt_tokens
        == client.completions.create(model="tiny", prompt="Hi", max_tokens=1).usage.prompt_tokens
    )  # type: ignore[union-attr]
    again = client.completions.create(model="tiny", prompt="Hi", max_tokens=TOKENS, seed=SEED, n=N)
    assert [c.text for c in again.choices] == _expected()  # the same request repeats exactly


def test_streamed_choices_interleave_and_each_finishes_on_its_own(system: System) -> None:
    stream = _client(system).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=TOKENS,
        seed=SEED,
        n=N,
        stream=True,
        stream_options={"include_usage": True},
        logprobs=True,
        top_logprobs=1,
    )
    texts, finished, tokens = [""] * N, [0] * N, [0] * N
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finished[choice.index] += choice.finish_reason is not None
            tokens[choice.index] += len(choice.logprobs.content or []) if choice.logprobs else 0
    assert texts == _expected() and finished == [1] * N and tokens == [TOKENS] * N
    assert usage is not None and usage.completion_tokens == N * TOKENS


def _prefills(system: System) -> tuple[int, int]:
    """The prefill workers' (prefills_done, prefills_shared), summed, as their heartbeats report."""
    r, keys = system.redis(), Keys()
    rows = [r.hgetall(keys.worker(w)) for w in r.zrange(keys.workers, 0, -1)]
    prefill = [row for row in rows if row["role"] == "prefill"]
    return sum(int(row["prefills_done"]) for row in prefill), sum(int(row["prefills_shared"]) for row in prefill)


def _settled(system: System) -> tuple[int, int]:
    """The counters once every earlier prefill is reported: the same over two heartbeats."""
    last, now = None, _prefills(system)
    while now != last:
        time.sleep(0.6)  # a heartbeat comes every 0.5 s
        last, now = now, _prefills(system)
    return now


def test_n_choices_cost_one_prefill(system: System) -> None:
    """Issue 37's measure: n = 4 costs one prefill, not four (P's prefill count)."""
    _one_prefill_each(system)


def test_n_choices_placed_by_the_api_node_cost_one_prefill(tmp_path_factory: pytest.TempPathFactory) -> None:
    system = start_system(tmp_path_factory.mktemp("up"), "--prefill", "2", "--decode", "2", "--dispatch", "api")
    try:
        _one_prefill_each(system)
    finally:
        assert stop_system(system) == []


def _one_prefill_each(system: System) -> None:
    client, responses, n = _client(system), 5, 4
    before = _settled(system)
    for i in range(responses):
        reply = client.completions.create(model="tiny", prompt=f"a prompt of its own, {i}", max_tokens=4, n=n)
        assert len(reply.choices) == n
    want = (before[0] + responses * n, before[1] + responses * (n - 1))
    deadline = time.monotonic() + 10
    while _prefills(system) != want and time.monotonic() < deadline:  # heartbeats come every 0.5 s
        time.sleep(0.1)
    assert _prefills(system) == want  # each response's prompt computed once; its other choices shared it
