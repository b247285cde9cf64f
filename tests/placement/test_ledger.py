"""This replica's reservations against its registry view (pure logic): a snapshot read while a
dispatch was on its way does not show it, so the replica keeps counting it."""

from __future__ import annotations

from splitbus.bus.records import Reserved
from splitbus.placement.decision import Placement
from splitbus.placement.ledger import Ledger, Local, reserve
from tests.placement.snapshot import worker


def _placement(wid: str, blocks: int) -> Placement:
    return Placement(worker(wid, "mixed"), "mixed", "", Reserved(100, 1, blocks))


def test_a_snapshot_forgets_only_the_dispatches_written_before_its_read_began() -> None:
    now = [0.0]
    local: Local = {}
    ledger = Ledger(local, clock=lambda: now[0])
    ledger.reserve(_placement("a", 10))
    now[0] = 1.0
    ledger.written()  # returned at 1.0
    ledger.reserve(_placement("a", 20))
    ledger.reserve(_placement("b", 5))
    assert local == {"a": Reserved(200, 2, 30), "b": Reserved(100, 1, 5)}
    ledger.view_refreshed(read_at=1.5)  # read while the second and third were in flight: it lacks them
    assert local == {"a": Reserved(100, 1, 20), "b": Reserved(100, 1, 5)}
    now[0] = 2.0
    ledger.written()
    ledger.view_refreshed(read_at=1.9)  # began before they returned: they may be missing from it, kept
    assert local == {"a": Reserved(100, 1, 20), "b": Reserved(100, 1, 5)}
    ledger.view_refreshed(read_at=2.1)
    assert local == {}


def test_reserve_adds_each_placements_load_to_its_workers_and_journals_it() -> None:
    local = Local({"a": Reserved(1, 1, 1)})
    reserve(local, [_placement("a", 10), _placement("b", 5), _placement("a", 2)])
    assert local == {"a": Reserved(201, 3, 13), "b": Reserved(100, 1, 5)}
    assert local.journal == ["a", "a", "b", "a"]  # each change, so that a table's columns follow it


def test_each_reservation_keeps_the_time_its_own_write_returned() -> None:
    """``written`` stamps only what was reserved since the last call (an API node calls it after
    each request's write): a reservation written at 1.0 is forgotten by a snapshot read from 2.0
    on, though another written later is kept, and one still in flight across a snapshot is
    stamped by the next call."""
    now = [1.0]
    local = Local()
    ledger = Ledger(local, clock=lambda: now[0])
    ledger.reserve(_placement("a", 10))
    ledger.written()
    ledger.reserve(_placement("b", 5))
    ledger.view_refreshed(read_at=2.0)  # b in flight: kept
    assert local == {"b": Reserved(100, 1, 5)}
    now[0] = 5.0
    ledger.written()
    ledger.view_refreshed(read_at=2.0)  # a: written at 1.0, in the snapshot; b: at 5.0, not yet
    assert local == {"b": Reserved(100, 1, 5)}
    ledger.view_refreshed(read_at=5.5)
    assert local == {}
