"""A response's choices follow the first one placed to its P and D (splitbus/placement/siblings.py),
on hand-made snapshots (pure logic)."""

from __future__ import annotations

import random

from splitbus.bus.messages import GenerateRequest, SamplingParams
from splitbus.bus.records import Reserved
from splitbus.bus.roles import Phase
from splitbus.placement.decision import Placed, Placement
from splitbus.placement.ledger import Local
from splitbus.placement.policies.base import PolicyOptions
from splitbus.placement.policies.splitwise import SplitwisePolicy
from splitbus.placement.siblings import Siblings
from tests.placement.snapshot import worker

WORKERS = [worker("p0", "prefill"), worker("p1", "prefill"), worker("d0", "decode"), worker("d1", "decode")]
PAIR = Placed(
    (
        Placement(WORKERS[2], Phase.DECODE, "p0", Reserved(0, 1, 8)),
        Placement(WORKERS[0], Phase.PREFILL, "d0", Reserved(100)),
    )
)


def choice(i: int, n: int = 4, group: str = "cmpl-1", prompt: int = 100) -> GenerateRequest:
    sampling = SamplingParams(max_tokens=28, seed=i)
    return GenerateRequest(f"{group}-{i}", "m", [1] * prompt, sampling, "api", 0, choices=n, choice_group=group)


def pairs(decision: Placed | None) -> tuple[tuple[str, str, str], ...]:
    assert decision is not None
    return tuple((p.worker.record.worker_id, p.phase, p.peer) for p in decision.placements)


def decided(siblings: Siblings, request: GenerateRequest, policy: SplitwisePolicy) -> Placed:
    decision = siblings.decide(request, WORKERS, Local(), lambda: policy.place(request, WORKERS, Local()))
    assert isinstance(decision, Placed)
    return decision


def test_the_choices_after_the_first_go_to_its_p_and_d() -> None:
    siblings, policy = Siblings(), SplitwisePolicy(PolicyOptions(rng=random.Random(3)))
    siblings.expect([choice(i) for i in range(3)] + [GenerateRequest("r", "m", [1], SamplingParams(), "api", 0)])
    first = decided(siblings, choice(0), policy)
    follower = decided(siblings, choice(1), policy)
    assert pairs(follower) == pairs(first)
    decode, prefill = follower.placements
    assert decode.reserve == Reserved(reserved_requests=1, reserved_kv_blocks=8)  # (100 + 28) / 16
    assert prefill.reserve == Reserved()  # it shares the first one's prefill
    # P is told how many it gets together: the three this pass places (of four)
    assert [p.twins for p in first.placements] == [p.twins for p in follower.placements] == [1, 3]


def test_without_expect_a_first_choice_expects_all_its_choices() -> None:
    first = decided(Siblings(), choice(0, n=4), SplitwisePolicy(PolicyOptions(rng=random.Random(3))))
    assert [p.twins for p in first.placements] == [1, 4]


def test_a_request_that_is_no_choice_is_the_policys_alone() -> None:
    siblings, policy = Siblings(), SplitwisePolicy(PolicyOptions(rng=random.Random(3)))
    single = GenerateRequest("r", "m", [1] * 10, SamplingParams(), "api", 0)
    assert [p.twins for p in decided(siblings, single, policy).placements] == [1, 1]
    assert siblings.follow(single, WORKERS, Local()) is None


def test_a_response_is_known_by_its_id_and_its_salt() -> None:
    siblings, policy = Siblings(), SplitwisePolicy(PolicyOptions(rng=random.Random(3)))
    decided(siblings, choice(0), policy)
    salted = GenerateRequest(
        "cmpl-1-1", "m", [1] * 100, SamplingParams(), "api", 0, cache_salt="0" * 32, choices=4, choice_group="cmpl-1"
    )
    assert siblings.follow(salted, WORKERS, Local()) is None  # another tenant's word for the same id


def test_a_choice_is_placed_by_the_policy_when_its_pair_cannot_take_it() -> None:
    siblings = Siblings()
    siblings.decide(choice(0), WORKERS, Local(), lambda: PAIR)
    assert siblings.follow(choice(1), WORKERS, Local()) is not None
    full = Local({"d0": Reserved(reserved_kv_blocks=1000 - 7)})
    assert siblings.follow(choice(1), WORKERS, full) is None  # D has 7 free blocks, not 8
    dead_d = [WORKERS[0], worker("d0", "decode", alive=False)]
    assert siblings.follow(choice(1), dead_d, Local()) is None
    assert siblings.follow(choice(1, group="cmpl-2"), WORKERS, Local()) is None  # another response


def test_only_a_choices_splitwise_placement_is_followed() -> None:
    siblings = Siblings()
    mixed = Placed((Placement(worker("m0", "mixed"), Phase.MIXED, "", Reserved(100, 1, 8)),))
    siblings.decide(choice(0), WORKERS, Local(), lambda: mixed)
    assert siblings.follow(choice(1), [worker("m0", "mixed")], Local()) is None


def test_it_remembers_only_the_latest_responses() -> None:
    siblings = Siblings(kept=2)
    for group in ("a", "b", "c"):
        siblings.decide(choice(0, group=group), WORKERS, Local(), lambda: PAIR)
    assert siblings.follow(choice(1, group="a"), WORKERS, Local()) is None
    assert siblings.follow(choice(1, group="c"), WORKERS, Local()) is not None
