"""The pieces of `bench bus --redis-cluster` that need no servers: which API node follows which
streams, the hashed tags it compares with the placed ones (the API's own placement, tested in
tests/bus/core/test_cluster.py), and the command counts' arithmetic."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from redis.crc import key_slot

from splitbus.bench.bus_cluster import ClusterBenchConfig, api_names, assignment, delta, hashed_readers
from splitbus.redis_cluster import slot_ranges


def owner_of(primaries: int) -> Callable[[int], int]:
    ranges = slot_ranges(primaries)
    return lambda slot: next(i for i, (low, high) in enumerate(ranges) if low <= slot <= high)


def test_every_stream_goes_to_exactly_one_api_node() -> None:
    groups = assignment(ClusterBenchConfig(streams=10, api_nodes=3))
    assert [len(g) for g in groups] == [4, 3, 3]
    assert sorted(rid for g in groups for rid in g) == sorted(f"tok-{i}" for i in range(10))


def test_hashed_tags_are_the_plain_names() -> None:
    # Where these land is CRC16's choice: on 3 primaries, bench-api-1 and -2 share one.
    assert api_names(ClusterBenchConfig(api_nodes=2)) == ("bench-api-0", "bench-api-1")
    tags = hashed_readers(ClusterBenchConfig(api_nodes=3))
    assert tags == ("bench-api-0.0", "bench-api-1.0", "bench-api-2.0")
    assert [owner_of(3)(key_slot(t.encode())) for t in tags] == [1, 2, 2]


def test_delta_keeps_the_commands_that_ran() -> None:
    before = {"xadd": 10, "xread": 4, "auth": 1}
    after = {"xadd": 1010, "xread": 4, "auth": 2, "evalsha": 3}
    assert delta(before, after) == {"auth": 1, "evalsha": 3, "xadd": 1000}


def test_a_cluster_of_one_is_refused() -> None:
    with pytest.raises(ValueError, match="between 2 and 16"):
        ClusterBenchConfig(primaries=1)
    with pytest.raises(ValueError, match="at most the number of streams"):
        ClusterBenchConfig(streams=2, api_nodes=3)
