"""The waiting queue's order as a pure function: priority, weighted fair share of prompt tokens
among tenants, arrival; and the decayed served tokens the scheduler keeps."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitbus.bus.core.streams import Delivery
from splitbus.bus.messages import GenerateRequest, SamplingParams
from splitbus.placement.decision import Waiting
from splitbus.placement.fairness import (
    FORGET_BELOW,
    MAX_TENANTS,
    ServedTokens,
    fair_order,
    queue_order,
    waiting_order,
)


@dataclass(frozen=True)
class Req:
    name: str
    tenant: str
    tokens: int = 100
    priority: int = 0


def _fair(
    items: list[Req], served: dict[str, float] | None = None, weights: dict[str, float] | None = None
) -> list[str]:
    ordered = fair_order(items, lambda r: r.tenant, lambda r: r.tokens, served or {}, weights or {})
    return [r.name for r in ordered]


def _queue(items: list[Req], served: dict[str, float] | None = None) -> list[str]:
    ordered = queue_order(items, lambda r: r.priority, lambda r: r.tenant, lambda r: r.tokens, served or {}, {})
    return [r.name for r in ordered]


def _serve(queue: list[Req], weights: dict[str, float], rounds: int) -> Counter[str]:
    """Take the first request of the fair order ``rounds`` times, charging its tenant each time
    (as the scheduler does when it dispatches): the prompt tokens each tenant got."""
    served: dict[str, float] = {}
    got: Counter[str] = Counter()
    for _ in range(rounds):
        first = fair_order(queue, lambda r: r.tenant, lambda r: r.tokens, served, weights)[0]
        queue.remove(first)
        served[first.tenant] = served.get(first.tenant, 0.0) + first.tokens
        got[first.tenant] += first.tokens
    return got


def test_a_deep_backlog_does_not_starve_a_trickle() -> None:
    """A floods 50 requests ahead of B's one: B's goes second, not 51st."""
    queue = [Req(f"a{i}", "A") for i in range(50)] + [Req("b0", "B")]
    assert _fair(queue)[:3] == ["a0", "b0", "a1"]
    # A has been served a lot already: B's request goes first.
    assert _fair(queue, served={"A": 10_000.0})[0] == "b0"


def test_a_trickle_keeps_being_served_while_the_backlog_waits() -> None:
    """B sends one request at a time behind A's backlog: each is taken within two picks."""
    queue = [Req(f"a{i}", "A") for i in range(100)]
    served: dict[str, float] = {}
    for round_ in range(20):
        queue.append(Req(f"b{round_}", "B"))
        picks = []
        for _ in range(2):
            first = fair_order(queue, lambda r: r.tenant, lambda r: r.tokens, served, {})[0]
            queue.remove(first)
            served[first.tenant] = served.get(first.tenant, 0.0) + first.tokens
            picks.append(first.name)
        assert f"b{round_}" in picks


@settings(max_examples=200, deadline=None)
@given(backlogs=st.lists(st.lists(st.integers(1, 1000), max_size=30), min_size=1, max_size=6))
def test_a_trickle_goes_before_every_backlog_but_one_request_of_each(backlogs: list[list[int]]) -> None:
    """Whatever the other tenants queued before it, a tenant served nothing lately has its request
    taken after at most one of each other tenant's (those that, served nothing either, arrived first)."""
    queue = [Req(f"t{t}-{i}", f"t{t}", tokens) for t, sizes in enumerate(backlogs) for i, tokens in enumerate(sizes)]
    order = _fair([*queue, Req("trickle", "T", 1000)])
    assert order.index("trickle") <= sum(1 for sizes in backlogs if sizes)


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(1, 1000), st.integers(1, 1000)), min_size=40, max_size=40),
    weights=st.tuples(st.sampled_from([0.5, 1.0, 2.0, 3.0]), st.sampled_from([0.5, 1.0, 2.0, 3.0])),
    rounds=st.integers(1, 40),  # neither backlog of 40 runs out before the last pick
)
def test_two_backlogs_are_served_in_proportion_to_their_weights_within_one_request_each(
    sizes: list[tuple[int, int]], weights: tuple[float, float], rounds: int
) -> None:
    """Start-time fair queueing's bound: while both have a backlog, the tenants' served tokens
    over their weights differ by at most one request's tokens over its weight, each."""
    queue = [Req(f"a{i}", "A", a) for i, (a, _) in enumerate(sizes)] + [
        Req(f"b{i}", "B", b) for i, (_, b) in enumerate(sizes)
    ]
    got = _serve(queue, {"A": weights[0], "B": weights[1]}, rounds)
    bound = 1000 / weights[0] + 1000 / weights[1]
    assert abs(got["A"] / weights[0] - got["B"] / weights[1]) <= bound


@pytest.mark.parametrize(("weights", "share"), [({"A": 2.0, "B": 1.0}, 2.0), ({}, 1.0), ({"B": 3.0}, 1 / 3)])
def test_weights_give_their_share_of_prompt_tokens(weights: dict[str, float], share: float) -> None:
    queue = [Req(f"a{i}", "A") for i in range(200)] + [Req(f"b{i}", "B") for i in range(200)]
    got = _serve(queue, weights, rounds=120)
    assert got["A"] / got["B"] == pytest.approx(share, rel=0.05)


def test_fair_share_counts_prompt_tokens_not_requests() -> None:
    """A's requests are 4x B's: B gets four requests for each of A's."""
    queue = [Req(f"a{i}", "A", tokens=400) for i in range(20)] + [Req(f"b{i}", "B", tokens=100) for i in range(40)]
    got = _serve(queue, {}, rounds=25)
    assert got["A"] == pytest.approx(got["B"], rel=0.1)


def test_one_tenant_keeps_its_arrival_order_and_ties_go_by_arrival() -> None:
    queue = [Req("a0", "A", 500), Req("a1", "A", 1), Req("b0", "B"), Req("c0", "C")]
    assert _fair(queue) == ["a0", "b0", "c0", "a1"]  # a0, b0, c0 all start at 0: arrival order


def test_a_bad_weight_counts_as_the_smallest_not_a_division_by_zero() -> None:
    queue = [Req("a0", "A"), Req("a1", "A"), Req("b0", "B")]
    assert _fair(queue, weights={"A": 0.0, "B": -1.0}) == ["a0", "b0", "a1"]
    assert _fair(queue, served={"A": 1.0, "B": 1.0}, weights={"A": 0.0, "B": 1.0}) == ["b0", "a0", "a1"]


def test_the_queue_is_ordered_by_priority_then_fair_share_then_arrival() -> None:
    queue = [
        Req("a0", "A", priority=5),
        Req("a1", "A", priority=0),
        Req("a2", "A", priority=0),
        Req("b0", "B", priority=0),
        Req("c0", "C", priority=-3),
        Req("b1", "B", priority=5),
    ]
    # -3 first; within 0: a1 and b0 start at 0 (arrival), a2 after A's 100; within 5 likewise.
    assert _queue(queue) == ["c0", "a1", "b0", "a2", "a0", "b1"]
    assert _queue(queue, served={"A": 1000.0}) == ["c0", "b0", "a1", "a2", "b1", "a0"]


def test_served_tokens_halve_every_half_life_and_are_forgotten_below_one_token() -> None:
    served = ServedTokens(half_life_s=10.0)
    served.charge("A", 1000, now=100.0)
    served.charge("B", 4, now=100.0)
    assert served.decayed(110.0) == {"A": pytest.approx(500.0), "B": pytest.approx(2.0)}
    assert served.decayed(105.0) == {"A": pytest.approx(500.0), "B": pytest.approx(2.0)}  # a clock that went back
    assert served.decayed(130.0) == {"A": pytest.approx(125.0)}  # B's 0.5 < FORGET_BELOW
    assert FORGET_BELOW == 1.0
    served.charge("A", 10, now=130.0)
    assert served.decayed(130.0) == {"A": pytest.approx(135.0)}
    served.charge("A", 10, now=130.05)  # within DECAY_EVERY_S: counted, not decayed yet
    assert served.decayed(130.05) == {"A": pytest.approx(145.0)}
    assert served.decayed(140.0) == {"A": pytest.approx(145.0 / 2)}


def test_served_tokens_keep_at_most_max_tenants() -> None:
    served = ServedTokens()
    for i in range(MAX_TENANTS):
        served.charge(f"t{i}", 10 + i, now=0.0)
    served.charge("new", 5, now=0.0)  # the least served other than the one charged is dropped
    assert len(served.tokens) == MAX_TENANTS
    assert "new" in served.tokens and "t0" not in served.tokens
    served.charge("big", 10**6, now=0.0)
    assert len(served.tokens) == MAX_TENANTS and "big" in served.tokens and "new" not in served.tokens


def test_a_tenant_that_comes_after_others_were_served_takes_its_share_from_now_on() -> None:
    """The virtual time: B, new after A was served alone for a while, alternates with A instead
    of taking everything until it has caught up with A's past (30 s of it, at a 30 s half-life)."""
    served = ServedTokens()
    for _ in range(100):
        served.charge("A", 100, now=0.0)
    assert served.floor == 99 * 100  # the start of A's last request
    queue = [_waiting(f"0-{i}", "A", tokens=100) for i in range(3)] + [
        _waiting(f"1-{i}", "B", tokens=100) for i in range(3)
    ]
    order = waiting_order(queue, served.decayed(0.0), {}, served.floor)
    assert [w.delivery.message.tenant for w in order] == ["B", "A", "B", "A", "B", "A"]
    assert [w.delivery.message.tenant for w in waiting_order(queue, served.decayed(0.0), {})][:4] == ["B"] * 3 + ["A"]
    served.decayed(30.0)
    assert served.floor == pytest.approx(99 * 100 / 2)  # decays with the served tokens


def _waiting(entry_id: str, tenant: str, priority: int = 0, tokens: int = 10) -> Waiting:
    request = GenerateRequest(entry_id, "m", [1] * tokens, SamplingParams(), "api", 0, priority=priority, tenant=tenant)
    return Waiting(Delivery("sb:requests:{c}", entry_id, request), 0.0)


def test_waiting_entries_arrive_in_entry_id_order_whatever_order_they_are_held_in() -> None:
    held = [_waiting("5-0", "A"), _waiting("2-1", "A"), _waiting("2-0", "B"), _waiting("9-0", "C", priority=-1)]
    not_a_request = Waiting(Delivery("sb:requests:{c}", "1-0", None), 0.0)
    ordered = waiting_order([*held, not_a_request], {}, {})
    assert [w.delivery.entry_id for w in ordered] == ["9-0", "1-0", "2-0", "2-1", "5-0"]
