from splitbus.bus.keys import Keys


def test_default_prefix_and_hash_tags() -> None:
    keys = Keys()
    assert keys.requests == "sb:requests"
    assert keys.tasks("w1") == "sb:tasks:{w1}"
    assert keys.out("r1") == "sb:out:{r1}"
    assert keys.kv("r1") == "sb:kv:{r1}"
    assert keys.rdma("p1", "d1") == "sb:rdma:{p1}:{d1}"
    assert keys.workers == "sb:workers"
    assert keys.lease("w1") == "sb:lease:{w1}"
    assert keys.scheduler_lease("s1") == "sb:scheduler-lease:{s1}"


def test_kind_is_bounded() -> None:
    keys = Keys("x")
    assert keys.kind(keys.out("abc")) == "out"
    assert keys.kind(keys.tasks("w")) == "tasks"
    assert keys.kind(keys.requests) == "requests"
    assert keys.kind("unrelated:key") == "other"
