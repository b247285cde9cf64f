import pytest
from redis.crc import key_slot

from splitbus.bus.core.keys import Keys
from splitbus.env import load_env
from tests.bus.slots import BUILDERS, build, slots

CELL_KEYS = sorted(set(BUILDERS) - {"out", "wake", "dp", "ep_store", "rdma", "reply"})
"""The control plane: every key tagged by the cell."""


def test_default_prefix_cell_and_hash_tags() -> None:
    keys = Keys()
    assert keys.requests == "sb:requests:{main}"
    assert keys.tasks("w1") == "sb:tasks:{main}:w1"
    assert keys.out("api-1.out.0", "r1") == "sb:out:{api-1.out.0}:r1"
    assert keys.wake("api-1.out.0") == "sb:wake:{api-1.out.0}"
    assert keys.kv("r1") == "sb:kv:{main}:r1"
    assert keys.rdma("p1", "d1") == "sb:rdma:{p1}:{d1}"
    assert keys.dp("g0") == "sb:dp:{g0}"
    assert keys.ep_store("g0") == "sb:ep:{g0}"
    assert keys.workers == "sb:workers:{main}"
    assert keys.lease("w1") == "sb:lease:{main}:w1"
    assert keys.scheduler_lease("s1") == "sb:scheduler-lease:{main}:s1"
    assert Keys("x", "east").cancel == "x:cancel:{east}"


@pytest.mark.parametrize("cell", ["main", "east-2", "c.1"])
def test_a_cells_control_plane_is_one_slot_the_cells_own(cell: str) -> None:
    keys = Keys(cell=cell)
    names = [build(name, keys, *ids) for name in CELL_KEYS for ids in (["w-0"], ["d:1"], ["cmpl-9f:1-0"])]
    assert slots(names) == {key_slot(cell.encode())}, names


def test_a_readers_streams_are_its_slot_and_readers_spread() -> None:
    keys = Keys()
    for reader in ("api-1a2b.out.0", "api-1a2b.out.1", "api-ffff.out.0"):
        names = [keys.wake(reader), *(keys.out(reader, f"cmpl-{i}") for i in range(50))]
        assert slots(names) == {key_slot(reader.encode())}
    readers = [f"api-{i:04x}.out.0" for i in range(64)]
    assert len(slots([keys.wake(r) for r in readers])) > 32  # tags hash apart, not onto one primary


@pytest.mark.parametrize("cell", ["", "a{b", "a}b", "a:b", "a b", "a\tb"])
def test_a_cell_that_is_no_tag_is_refused(cell: str) -> None:
    with pytest.raises(ValueError, match="cell"):
        Keys(cell=cell)
    if cell:
        with pytest.raises(ValueError, match="SPLITBUS_CELL"):
            load_env({"SPLITBUS_CELL": cell})


def test_the_cell_comes_from_the_environment() -> None:
    assert load_env({}).cell == load_env({"SPLITBUS_CELL": ""}).cell == "main"
    assert load_env({"SPLITBUS_CELL": "east"}).cell == "east"


def test_kind_is_bounded() -> None:
    keys = Keys("x")
    assert keys.kind(keys.out("api.0", "abc")) == "out"
    assert keys.kind(keys.tasks("w")) == "tasks"
    assert keys.kind(keys.requests) == "requests"
    assert keys.kind("unrelated:key") == "other"
