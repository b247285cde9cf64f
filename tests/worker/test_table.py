"""The request table on its own (no Redis): one status per request, one entry per request."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from splitbus.bus.messages import GenerateRequest, SamplingParams, Task
from splitbus.tokenization import ModelTokenizer
from splitbus.worker.sequence import Sequence
from splitbus.worker.table import DROPPABLE, HELD, RequestTable, Status
from splitbus.worker.text import TextStream

Make = Callable[..., Sequence]


@pytest.fixture
def make(tiny_model: Path) -> Make:
    tokenizer = ModelTokenizer.load(tiny_model, "tiny")

    def make(request_id: str, tokens: int = 1, entry: str = "1-0", priority: int = 0) -> Sequence:
        sampling = SamplingParams(max_tokens=4)
        request = GenerateRequest(request_id, "tiny", [97] * tokens, sampling, "api", 0, priority=priority)
        return Sequence(Task("mixed", request), entry, TextStream(tokenizer, []))

    return make


def test_a_request_has_one_entry_and_a_newer_task_of_it_is_not_the_older(make: Make) -> None:
    table, older, newer = RequestTable(), make("r1", entry="1-0"), make("r1", entry="2-0")
    table.add(older, Status.QUEUED)
    with pytest.raises(ValueError, match="held already"):
        table.add(newer, Status.QUEUED)  # the older task must leave first
    assert table.status(newer) is None and not table.remove(newer)  # a task not held changes nothing
    assert table.remove(older) and len(table) == 0
    table.add(newer, Status.AWAITING_KV)
    assert table.status(older) is None and table.get("r1") is newer


def test_each_status_keeps_the_order_its_requests_reached_it_in(make: Make) -> None:
    table = RequestTable()
    a, b, c = make("a"), make("b"), make("c")
    for seq in (a, b, c):
        table.add(seq, Status.QUEUED)
    table.move(b, Status.RUNNING)
    table.move(a, Status.RUNNING)
    assert table.of(Status.RUNNING) == [b, a] and table.of(Status.QUEUED) == [c]
    assert table.of() == [c, b, a] and table.count(Status.QUEUED, Status.RUNNING) == 3
    with pytest.raises(KeyError):
        table.move(make("a"), Status.HANDING_OFF)  # another task of a: not this table's


def test_a_prefill_batch_takes_the_oldest_that_fit_and_counts_as_held_no_more(make: Make) -> None:
    table = RequestTable()
    big, small, late = make("big", tokens=300), make("small", tokens=100), make("late", tokens=10)
    for seq in (big, small, late):
        table.add(seq, Status.QUEUED)
    assert table.prefill_batch_size(350) == (1, 300)  # small does not fit after big; late waits its turn
    assert table.prefill_batch_size(200) == (1, 300)  # one at least, however long
    assert table.start_prefill(400) == [big, small]
    assert table.of(Status.PREFILLING) == [big, small] and table.count(*HELD) == 1
    table.remove(small)  # moved away during the step
    assert table.end_prefill() == [big] and table.of() == [late]


def test_a_cancel_takes_only_what_is_not_in_flight(make: Make) -> None:
    table = RequestTable()
    shipping, prefilling, waiting = make("ship"), make("pre"), make("wait")
    table.add(shipping, Status.HANDING_OFF)
    table.add(prefilling, Status.PREFILLING)
    table.add(waiting, Status.AWAITING_KV, kv_deadline=5.0)
    assert table.take("ship", *DROPPABLE) is None and table.take("pre", *DROPPABLE) is None
    assert table.take("wait", *DROPPABLE) is waiting and table.of() == [shipping, prefilling]
    assert table.take("unknown") is None


def test_kv_waits_past_their_deadline_leave_the_table(make: Make) -> None:
    table = RequestTable()
    soon, later, running = make("soon"), make("later"), make("run")
    table.add(soon, Status.AWAITING_KV, kv_deadline=10.0)
    table.add(later, Status.AWAITING_KV, kv_deadline=20.0)
    table.add(running, Status.RUNNING, kv_deadline=1.0)  # a deadline means nothing once running
    assert table.kv_deadline(later) == 20.0 and table.kv_deadline(running) == 0.0
    assert table.kv_waits_past(10.0) == []  # not past yet
    assert table.kv_waits_past(15.0) == [soon] and table.of() == [later, running]
    assert table.count(Status.AWAITING_KV) == 1


def test_an_aborted_prefill_queues_its_batch_again_first_in_line(make: Make) -> None:
    table = RequestTable()
    a, b, c, d = make("a", tokens=4), make("b", tokens=4), make("c", tokens=4), make("d")
    for seq in (a, b, c):
        table.add(seq, Status.QUEUED)
    assert table.start_prefill(max_tokens=8) == [a, b]
    table.add(d, Status.QUEUED)  # taken while the batch ran
    table.remove(b)  # left during the prefill (moved away): not queued again
    assert table.abort_prefill() == [a]
    assert table.of(Status.QUEUED) == [a, c, d] and table.count(Status.PREFILLING) == 0


def test_an_import_in_flight_is_held_but_not_dropped_by_a_cancel(make: Make) -> None:
    table, importing = RequestTable(), make("imp")
    table.add(importing, Status.AWAITING_KV, kv_deadline=5.0)
    table.move(importing, Status.IMPORTING)  # its KV frame came: the engine writes its blocks
    assert table.take("imp", *DROPPABLE) is None and table.count(*HELD) == 1
    assert table.kv_waits_past(10.0) == [] and table.status(importing) is Status.IMPORTING


def test_of_siblings_computing_the_same_block_only_the_first_joins_a_prefill_batch(make: Make) -> None:
    table = RequestTable()
    seqs = [make(f"r{i}", tokens=40, entry=f"{i}-0") for i in range(4)]
    for seq in seqs:
        table.add(seq, Status.QUEUED)
    shared = {"r0": 1, "r1": 2, "r2": 1, "r3": None}  # r2 would compute what r0 computes
    batch = table.start_prefill(4096, lambda seq: shared[seq.request_id])
    assert [s.request_id for s in batch] == ["r0", "r1", "r3"]
    assert [s.request_id for s in table.of(Status.QUEUED)] == ["r2"]  # next step, finding r0's blocks cached


def ids(seqs: list[Sequence]) -> list[str]:
    return [s.request_id for s in seqs]


def queued(table: RequestTable, make: Make, *requests: tuple[str, int, int]) -> None:
    """Queue (request id, prompt tokens, priority) in this order."""
    for request_id, tokens, priority in requests:
        table.add(make(request_id, tokens=tokens, priority=priority), Status.QUEUED)


def test_a_later_request_of_a_higher_priority_is_prefilled_before_earlier_ones(make: Make) -> None:
    table = RequestTable()
    queued(table, make, ("low1", 4, 5), ("low2", 4, 5), ("mid", 4, 0), ("high", 4, -3), ("low3", 4, 5))
    assert ids(table.prefill_queue()) == ["high", "mid", "low1", "low2", "low3"]  # lower first; FIFO within
    assert ids(table.of(Status.QUEUED)) == ["low1", "low2", "mid", "high", "low3"]  # the table's own order stays
    next_prefill = table.next_prefill()
    assert next_prefill is not None and next_prefill.request_id == "high"
    assert ids(table.start_prefill(max_tokens=8)) == ["high", "mid"]
    assert ids(table.start_prefill(max_tokens=8)) == ["low1", "low2"]


def test_requests_of_one_priority_are_prefilled_in_the_order_they_were_queued(make: Make) -> None:
    table = RequestTable()
    queued(table, make, ("a", 4, 2), ("b", 4, 2), ("c", 4, 2))
    assert ids(table.prefill_queue()) == ["a", "b", "c"] and ids(table.start_prefill(max_tokens=8)) == ["a", "b"]
    assert RequestTable().next_prefill() is None and RequestTable().prefill_queue() == []


def test_an_aborted_prefill_is_first_again_within_its_priority_only(make: Make) -> None:
    table = RequestTable()
    queued(table, make, ("b1", 4, 1), ("b2", 4, 1), ("same", 4, 1))
    assert ids(table.start_prefill(max_tokens=8)) == ["b1", "b2"]
    queued(table, make, ("urgent", 4, 0), ("later", 4, 1))  # taken while the batch ran
    assert ids(table.abort_prefill()) == ["b1", "b2"]
    assert ids(table.prefill_queue()) == ["urgent", "b1", "b2", "same", "later"]
    assert ids(table.start_prefill(max_tokens=12)) == ["urgent", "b1", "b2"]  # b1 and b2 keep their blocks


def test_the_batch_size_a_rank_announces_is_the_batch_it_plans(make: Make) -> None:
    table = RequestTable()
    queued(table, make, ("a", 300, 4), ("b", 100, 4), ("c", 50, 1), ("d", 60, 2), ("e", 10, 1), ("f", 500, 0))
    # In order: f (500), c (50), e (10), d (60), a (300), b (100).
    for max_tokens, expected in ((400, ["f"]), (560, ["f", "c", "e"]), (620, ["f", "c", "e", "d"])):
        size = table.prefill_batch_size(max_tokens)
        batch = table.start_prefill(max_tokens)
        assert ids(batch) == expected and size == (len(batch), sum(len(s.all_tokens) for s in batch))
        table.abort_prefill()  # the same queue again for the next size


def test_a_request_holding_blocks_is_prefilled_before_an_earlier_priority_that_gets_none(make: Make) -> None:
    """An aborted batch keeps its KV blocks; a request of an earlier priority that comes meanwhile
    and finds no blocks would end every plan before it, and the blocks it waits for are the ones
    the batch behind it holds: the request holding blocks goes first."""
    table = RequestTable()
    queued(table, make, ("held", 4, 5))
    [held] = table.start_prefill(max_tokens=8)
    held.blocks = 1  # what the engine's reserve gave it
    queued(table, make, ("urgent", 4, 0))
    table.abort_prefill()
    assert ids(table.prefill_queue()) == ["held", "urgent"]
    assert ids(table.start_prefill(max_tokens=8, reserve=lambda *_: False)) == ["held"]  # KV short: it still runs
    assert ids(table.prefill_queue()) == ["urgent"]
