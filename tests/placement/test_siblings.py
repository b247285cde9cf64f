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
from splitbus.placement.siblings import Siblings, twins
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
    first = decided(siblings, choice(0), policy)
    follower = decided(siblings, choice(1), policy)
    assert pairs(follower) == pairs(first)
    decode, prefill = follower.placements
    assert decode.reserve == Reserved(reserved_requests=1, reserved_kv_blocks=8)  # (100 + 28) / 16
    assert prefill.reserve == Reserved()  # it shares the first one's prefill


def test_each_prefill_task_says_how_many_choices_the_pass_sends_to_its_worker() -> None:
    other = Placed(
        (
            Placement(WORKERS[3], Phase.DECODE, "p1", Reserved(0, 1, 8)),
            Placement(WORKERS[1], Phase.PREFILL, "d1", Reserved(100)),
        )
    )
    single = GenerateRequest("r", "m", [1] * 10, SamplingParams(), "api", 0)
    # Two followed the first to p0; D had no room for the last two, which the policy sent to p1.
    made = [(choice(0), PAIR), (choice(1), PAIR), (choice(2), other), (choice(3), other), (single, PAIR)]
    stamped = twins(made)
    assert [[p.twins for p in d.placements] for d in stamped] == [[1, 2], [1, 2], [1, 2], [1, 2], [1, 1]]
    assert stamped[4] is PAIR  # not a choice: as decided
    assert [[p.twins for p in d.placements] for d in twins([(choice(0), PAIR)])] == [[1, 1]]  # alone: none to wait for


def test_a_choice_that_cannot_follow_leaves_the_pair_to_the_others() -> None:
    siblings = Siblings()
    siblings.decide(choice(0), WORKERS, Local(), lambda: PAIR)
    full = Local({"d0": Reserved(reserved_kv_blocks=1000 - 7)})
    elsewhere = Placed((Placement(worker("d1", "decode"), Phase.DECODE, "p1", Reserved(0, 1, 8)),))
    siblings.decide(choice(1), WORKERS, full, lambda: elsewhere)  # placed by the policy
    assert pairs(siblings.follow(choice(2), WORKERS, Local())) == pairs(PAIR)  # still the first one's


def test_a_request_that_is_no_choice_is_the_policys_alone() -> None:
    siblings, policy = Siblings(), SplitwisePolicy(PolicyOptions(rng=random.Random(3)))
    single = GenerateRequest("r", "m", [1] * 10, SamplingParams(), "api", 0)
    decided(siblings, single, policy)
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
