"""Twins (splitbus/worker/twins.py): a response's choices queued on one prefill worker prefill
their prompt once. Through the core and a sim engine, as tests/worker/test_core.py runs them."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitbus.bus.messages import GenerateRequest, SamplingParams, Task
from splitbus.tokenization import ModelTokenizer
from splitbus.worker.core import Limits, WorkerCore
from splitbus.worker.effects import Emit, ShipKv
from splitbus.worker.engines.sim import SimConfig, SimEngine, sim_text
from splitbus.worker.sequence import Sequence
from splitbus.worker.table import Status
from splitbus.worker.twins import GATHER_S, computing, twin_key

FREE = SimConfig(prefill_s_per_token=0, decode_step_s=0, decode_s_per_seq=0)
BLOCKS = 32
PROMPT = [97] * 40  # two full blocks of 16 and a partial one


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def core(tiny_model: Path) -> WorkerCore:
    tokenizer = ModelTokenizer.load(tiny_model, "tiny")
    core = WorkerCore(Limits("p1", "tiny", block_size=16), SimEngine(FREE, tokenizer, BLOCKS, 16), tokenizer)
    core.clock = Clock()
    return core


def choice(
    i: int,
    n: int = 3,
    *,
    group: str = "cmpl-1",
    prompt: list[int] = PROMPT,
    phase: str = "prefill",
    top: int | None = None,
    twins: int | None = None,
    priority: int = 0,
) -> Task:
    """Choice ``i`` of a response of ``n``, its task saying ``twins`` were sent here (all ``n``
    by default, as a scheduler that read them together says)."""
    sampling = SamplingParams(max_tokens=4, seed=1000 + i, prompt_logprobs=top)
    request = GenerateRequest(
        f"{group}-{i}",
        "tiny",
        list(prompt),
        sampling,
        "api",
        0,
        choices=n,
        choice_group=group if n > 1 else "",
        priority=priority,
    )
    return Task(phase, request, "d1" if phase == "prefill" else "p1", twins=n if twins is None else twins)


def admit(core: WorkerCore, *tasks: Task) -> None:
    for t in tasks:
        assert core.admit(f"{t.request.request_id}-entry", t).rejected is None


async def prefill(core: WorkerCore) -> tuple[list[Sequence], list[Emit]]:
    batch = core.plan_prefill()
    effects = core.end_prefill(list(zip(batch, await core.engine.prefill(batch), strict=True)))
    return batch, [e for e in effects if isinstance(e, Emit)]


async def test_a_responses_choices_prefill_once_sharing_blocks_each_drawing_its_own_token(core: WorkerCore) -> None:
    admit(core, *(choice(i) for i in range(3)))
    batch = core.plan_prefill()
    assert [s.request_id for s in batch] == ["cmpl-1-0", "cmpl-1-1", "cmpl-1-2"]
    leader, *others = batch
    assert leader.fork_of is None and all(s.fork_of is leader for s in others)
    assert all(s.block_table == leader.block_table for s in others)
    assert core.engine.free_blocks == BLOCKS - 3  # one prompt's blocks, held three times
    assert computing(batch) == ([leader], [0, 0, 0])
    tokens = await core.engine.prefill(batch)
    effects = core.end_prefill(list(zip(batch, tokens, strict=True)))
    # Each its own seed: the text each would have had prefilled alone.
    assert [e.text for e in effects if isinstance(e, Emit)] == [sim_text(1000 + i, 1) for i in range(3)]
    assert sum(isinstance(e, ShipKv) for e in effects) == 3
    assert core.counters["prefills_done"] == 3 and core.counters["prefills_shared"] == 2
    for seq in batch:  # each hands off; the blocks go back once the last lets go
        core.engine.release(seq)
    assert core.engine.free_blocks == BLOCKS


async def test_a_twin_waits_for_the_others_until_they_come(core: WorkerCore) -> None:
    admit(core, choice(0))
    assert core.plan_prefill() == [] and core.kv_blocked  # the loop looks again shortly
    core.clock.now += GATHER_S / 2  # type: ignore[attr-defined]
    admit(core, choice(1), choice(2))
    batch, emits = await prefill(core)
    assert len(batch) == 3 and core.counters["prefills_shared"] == 2 and len(emits) == 3


async def test_a_twin_waits_only_for_as_many_as_its_scheduler_sent_here(core: WorkerCore) -> None:
    admit(core, choice(0, twins=2), choice(1, twins=2))  # the third was read by another scheduler replica
    batch, _ = await prefill(core)
    assert len(batch) == 2 and core.counters["prefills_shared"] == 1
    admit(core, choice(2, twins=1))
    assert len(core.plan_prefill()) == 1  # nothing to wait for


async def test_a_late_twin_does_not_wait_again(core: WorkerCore) -> None:
    admit(core, choice(0), choice(1))
    core.clock.now += GATHER_S * 1.01  # type: ignore[attr-defined]
    await prefill(core)
    admit(core, choice(2))  # came late: the wait for it is over
    assert [s.request_id for s in core.plan_prefill()] == ["cmpl-1-2"]


async def test_waiting_twins_hold_up_no_other_request(core: WorkerCore) -> None:
    core.limits = Limits("p1", "tiny", block_size=16, max_prefill_tokens=60)
    admit(core, choice(0), choice(1))
    other = choice(0, n=1, group="other")
    admit(core, other)
    assert core.prefill_batch_size() == (3, len(PROMPT))  # the waiting ones count no tokens
    assert [s.request_id for s in core.plan_prefill()] == ["other-0"]


async def test_a_twin_waits_no_longer_than_the_gathering_time(core: WorkerCore) -> None:
    admit(core, choice(0), choice(1))  # the third went to another prefill worker
    assert core.plan_prefill() == []
    core.clock.now += GATHER_S * 1.01  # type: ignore[attr-defined]
    batch, _ = await prefill(core)
    assert len(batch) == 2 and core.counters["prefills_shared"] == 1


async def test_what_is_not_a_twin_computes_its_own(core: WorkerCore) -> None:
    other_prompt = choice(1, group="cmpl-1", prompt=[98] * 40)  # the group's word, not the same tokens
    other_top = choice(2, top=2)  # prompt logprobs asked: its key differs
    admit(core, choice(0), other_prompt, other_top)
    core.clock.now += GATHER_S * 1.01  # type: ignore[attr-defined]
    batch, _ = await prefill(core)
    assert [s.fork_of for s in batch] == [None, None, None] and core.counters["prefills_shared"] == 0


def test_only_a_prefill_task_of_a_choice_has_a_twin_key(core: WorkerCore) -> None:
    assert twin_key(Sequence(choice(0, n=1), "1-0", text=None)) is None  # type: ignore[arg-type]
    assert twin_key(Sequence(choice(0, phase="mixed"), "1-0", text=None)) is None  # type: ignore[arg-type]
    assert twin_key(Sequence(choice(0), "1-0", text=None)) is not None  # type: ignore[arg-type]
    moved = choice(0)
    moved.output_token_ids = [97]
    assert twin_key(Sequence(moved, "1-0", text=None)) is None  # type: ignore[arg-type]


async def test_twins_count_once_against_the_prefill_batchs_tokens(core: WorkerCore) -> None:
    admit(core, *(choice(i) for i in range(3)))
    assert core.prefill_batch_size() == (3, len(PROMPT))
    core.clock.now += GATHER_S * 1.01  # type: ignore[attr-defined]
    assert core.prefill_batch_size() == (3, len(PROMPT))


async def test_a_choice_whose_tokens_differ_counts_its_own(core: WorkerCore) -> None:
    core.limits = Limits("p1", "tiny", block_size=16, max_prefill_tokens=60)
    admit(core, choice(0), choice(1, prompt=[98] * 40), choice(2, prompt=[99] * 40))  # the group's word only
    core.clock.now += GATHER_S * 1.01  # type: ignore[attr-defined]
    assert core.prefill_batch_size() == (1, len(PROMPT))  # 120 tokens do not fit 60
    batch, _ = await prefill(core)
    assert len(batch) == 1 and core.counters["prefills_shared"] == 0


async def test_a_twin_run_without_its_leader_computes_in_the_blocks_it_holds(core: WorkerCore) -> None:
    admit(core, *(choice(i, n=2) for i in range(2)))
    batch = core.plan_prefill()
    alone = [batch[1]]  # its batch failed, and each runs alone (``EngineSteps.run_engine``)
    assert computing(alone) == (alone, [0])
    tokens = await core.engine.prefill(alone)
    assert core.tokenizer.decode(tokens) == sim_text(1001, 1) and alone[0].cached == len(PROMPT)
    assert alone[0].fork_of is None  # computed: it counts as no twin
    core.end_prefill([(batch[0], tokens[0]), (alone[0], tokens[0])])
    assert core.counters["prefills_shared"] == 0


async def test_a_batch_prefilled_again_after_an_abort_keeps_its_blocks(core: WorkerCore) -> None:
    admit(core, *(choice(i, n=2) for i in range(2)))
    first = core.plan_prefill()
    core.abort_prefill()
    again = core.plan_prefill()
    assert again == first and again[1].fork_of is again[0] and core.engine.free_blocks == BLOCKS - 3
    assert core.table.count(Status.PREFILLING) == 2
    core.end_prefill(list(zip(again, await core.engine.prefill(again), strict=True)))
    assert core.counters["prefills_shared"] == 1  # counted once the prefill ended, not per plan


async def test_choices_queued_among_other_priorities_still_prefill_once(core: WorkerCore) -> None:
    core.limits = Limits("p1", "tiny", block_size=16, max_prefill_tokens=80)
    late = choice(0, n=1, group="late", prompt=[98] * 40, priority=-1)  # a higher priority, come between
    low = choice(0, n=1, group="low", prompt=[99] * 40, priority=3)
    admit(core, low, choice(0, priority=1), late, choice(1, priority=1), choice(2, priority=1))
    assert core.prefill_batch_size() == (4, 80)  # the choices' prompt counted once
    batch, emits = await prefill(core)
    assert [s.request_id for s in batch] == ["late-0", "cmpl-1-0", "cmpl-1-1", "cmpl-1-2"]
    assert [s.fork_of for s in batch] == [None, None, batch[1], batch[1]] and len(emits) == 4
    assert core.counters["prefills_shared"] == 2 and core.table.of(Status.QUEUED)[0].request_id == "low-0"
