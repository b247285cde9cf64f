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


def test_the_choices_after_the_first_go_to_its_p_and_d() -> None:
    siblings, policy = Siblings(), SplitwisePolicy(PolicyOptions(rng=random.Random(3)))
    first = policy.place(choice(0), WORKERS, Local())
    assert isinstance(first, Placed)
    siblings.placed(choice(0), first)
    follower = siblings.follow(choice(1), WORKERS, Local())
    assert pairs(follower) == pairs(first)
    assert follower is not None
    decode, prefill = follower.placements
    assert decode.reserve == Reserved(reserved_requests=1, reserved_kv_blocks=8)  # (100 + 28) / 16
    assert prefill.reserve == Reserved()  # it shares the first one's prefill


def test_a_choice_is_placed_by_the_policy_when_its_pair_cannot_take_it() -> None:
    siblings = Siblings()
    siblings.placed(choice(0), PAIR)
    assert siblings.follow(choice(1), WORKERS, Local()) is not None
    full = Local({"d0": Reserved(reserved_kv_blocks=1000 - 7)})
    assert siblings.follow(choice(1), WORKERS, full) is None  # D has 7 free blocks, not 8
    dead_d = [WORKERS[0], worker("d0", "decode", alive=False)]
    assert siblings.follow(choice(1), dead_d, Local()) is None
    assert siblings.follow(choice(1, group="cmpl-2"), WORKERS, Local()) is None  # another response


def test_only_a_choices_splitwise_placement_is_followed() -> None:
    siblings = Siblings()
    mixed = Placed((Placement(worker("m0", "mixed"), Phase.MIXED, "", Reserved(100, 1, 8)),))
    siblings.placed(choice(0), mixed)
    assert siblings.follow(choice(1), [worker("m0", "mixed")], Local()) is None
    single = GenerateRequest("r", "m", [1] * 10, SamplingParams(), "api", 0)
    siblings.placed(single, PAIR)
    assert siblings.follow(single, WORKERS, Local()) is None  # n = 1: nothing to follow


def test_it_remembers_only_the_latest_responses() -> None:
    siblings = Siblings(kept=2)
    for group in ("a", "b", "c"):
        siblings.placed(choice(0, group=group), PAIR)
    assert siblings.follow(choice(1, group="a"), WORKERS, Local()) is None
    assert siblings.follow(choice(1, group="c"), WORKERS, Local()) is not None
