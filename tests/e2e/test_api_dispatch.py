"""Dispatch from the API node (``splitbus up --dispatch api``): the API places each request itself
and writes its tasks, with no entry in the request stream; the answers are the same."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from splitbus.bus.core.keys import Keys
from tests.e2e.conftest import start_system, stop_system
from tests.e2e.test_splitwise import _fifty_concurrent_requests


def _dispatched_here(base_url: str) -> float:
    text = httpx.get(base_url + "/metrics").text
    match = re.search(r'^splitbus_api_dispatches_total\{outcome="dispatched"\} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


def test_the_api_places_fifty_requests_itself(tmp_path: Path) -> None:
    system = start_system(tmp_path, "--dispatch", "api", "--api-workers", "1")  # its /metrics count all 50
    try:
        _fifty_concurrent_requests(system)
        assert _dispatched_here(system.base_url) >= 50
        r = system.redis()
        assert r.xlen(Keys().requests) == 0  # no request went through the request stream
    finally:
        assert stop_system(system) == []
