"""`splitbus up --engine sim` served from a Redis Cluster (``SPLITBUS_REDIS_URL`` =
``rediss+cluster://...``, TLS to every node): a request goes in over HTTP, P prefills, D decodes, tokens stream back;
the banner masks the password, and `splitbus status` reads the cluster. Fifty concurrent streams
on it (more commands in flight than the API's pool holds per node) are
tests/e2e/test_splitwise.py::test_fifty_concurrent_requests_are_exact_and_both_roles_work[cluster]."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import openai

from splitbus.redis_cluster import EmbeddedCluster
from splitbus.worker.engines.sim import sim_text
from tests.e2e.conftest import start_system, stop_system


def test_a_streamed_completion_on_a_redis_cluster(redis_cluster: EmbeddedCluster, tmp_path: Path) -> None:
    system = start_system(tmp_path, environ={"SPLITBUS_REDIS_URL": redis_cluster.url})
    try:
        client = openai.OpenAI(base_url=system.v1, api_key="x", max_retries=0, timeout=60)
        chunks = list(client.completions.create(model="tiny", prompt="Hello", max_tokens=7, seed=5, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == sim_text(5, 7)
        assert chunks[-1].choices[0].finish_reason == "length"
        printed = "".join(system.output)
        assert "Redis rediss+cluster://splitbus:***@" in printed and redis_cluster.password not in printed
        status = subprocess.run(
            [sys.executable, "-m", "splitbus.cli.main", "status", "--json"],
            env={**os.environ, "SPLITBUS_REDIS_URL": redis_cluster.url},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0, status.stderr
        workers = json.loads(status.stdout)["workers"]
        assert sorted(w["role"] for w in workers if w["alive"]) == ["decode", "prefill"]
    finally:
        assert stop_system(system) == []  # no part outlives up
