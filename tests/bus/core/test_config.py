"""``BusConfig``'s checks: a config with several faults names the first in a fixed order."""

from __future__ import annotations

import pytest

from splitbus.bus.core.config import BusConfig

BAD_CLUSTER_URL = "redis+cluster://127.0.0.1:7000/5"
"""A cluster URL that names a database: refused when the config is made."""


def test_a_bad_cluster_url_is_named_before_the_result_windows() -> None:
    with pytest.raises(ValueError, match="takes no path"):
        BusConfig(redis_url=BAD_CLUSTER_URL, result_grace_s=-1)
    with pytest.raises(ValueError, match="takes no path"):
        BusConfig(redis_url=BAD_CLUSTER_URL, replay_window_s=-1)


def test_the_reads_and_the_result_ttls_are_named_before_a_bad_cluster_url() -> None:
    with pytest.raises(ValueError, match="block_ms must be > 0"):
        BusConfig(redis_url=BAD_CLUSTER_URL, block_ms=0)
    with pytest.raises(ValueError, match="finished_result_ttl_s"):
        BusConfig(redis_url=BAD_CLUSTER_URL, finished_result_ttl_s=0)
