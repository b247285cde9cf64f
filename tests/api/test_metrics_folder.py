"""The folder an API in N processes keeps its metrics in (splitbus/api/metrics.py), and what
/metrics serves with and without it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from splitbus.api.metrics import MULTIPROCESS_DIR_ENV, exposition_registry, shared_across_processes


def test_the_folder_is_private_empty_named_in_the_environment_and_removed_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(MULTIPROCESS_DIR_ENV, "/the/operators/own")
    with shared_across_processes() as folder:
        assert os.environ[MULTIPROCESS_DIR_ENV] == folder
        assert list(Path(folder).iterdir()) == []
        assert stat.S_IMODE(Path(folder).stat().st_mode) == 0o700
        (Path(folder) / "counter_1.db").write_bytes(b"x")  # what a process writes there
        assert exposition_registry() is not REGISTRY  # the processes' values, combined
    assert not Path(folder).exists()
    assert os.environ[MULTIPROCESS_DIR_ENV] == "/the/operators/own"


def test_one_process_serves_its_own_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MULTIPROCESS_DIR_ENV, raising=False)
    assert exposition_registry() is REGISTRY
    with shared_across_processes():
        pass
    assert MULTIPROCESS_DIR_ENV not in os.environ
