"""Each script's outcome enum names every value the script can return: the integers its Lua
returns and those its ``returns=`` declaration (docs/bus.md's script table) lists, no more and
no fewer, so decoding a reply never meets a value without a member."""

from __future__ import annotations

import re
from enum import IntEnum

import pytest

from splitbus.bus.core.scripts import SCRIPTS
from splitbus.bus.dispatch import DispatchOutcome, ReassertOutcome, SettleOutcome
from splitbus.bus.limits import Ended
from splitbus.bus.runs import RunState
from splitbus.bus.tenants import AddOutcome, SetOutcome

ENUMS: dict[str, type[IntEnum]] = {
    "dispatch": DispatchOutcome,
    "settle_failed": SettleOutcome,
    "reassert": ReassertOutcome,
    "settle_run": RunState,
    "add_tenant": AddOutcome,
    "add_tenant_keys": AddOutcome,
    "set_tenant": SetOutcome,
    "end_request": Ended,
}


@pytest.mark.parametrize("name", sorted(ENUMS))
def test_the_enum_covers_every_value_the_lua_returns(name: str) -> None:
    returned = {int(v) for v in re.findall(r"\breturn (-?\d+)\b", SCRIPTS[name].source)}
    assert returned == {member.value for member in ENUMS[name]}


@pytest.mark.parametrize("name", sorted(ENUMS))
def test_the_enum_covers_every_value_the_declaration_names(name: str) -> None:
    declared = {int(clause.split()[0]) for clause in SCRIPTS[name].returns.split(";")}
    assert declared == {member.value for member in ENUMS[name]}


def test_the_dispatch_labels_are_the_metrics_values() -> None:
    """The ``outcome`` label values docs/metrics.md lists; NOT_OURS is counted as already_acked."""
    labels = {member: member.label for member in DispatchOutcome}
    assert labels == {
        DispatchOutcome.DISPATCHED: "dispatched",
        DispatchOutcome.ALREADY_ACKED: "already_acked",
        DispatchOutcome.NOT_OURS: "already_acked",
        DispatchOutcome.DUPLICATE: "duplicate",
        DispatchOutcome.STALE: "stale",
        DispatchOutcome.RECOVERING: "recovering",
        DispatchOutcome.WORKER_GONE: "worker_gone",
        DispatchOutcome.WORKER_DRAINING: "worker_draining",
    }
