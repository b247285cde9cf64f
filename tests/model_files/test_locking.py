"""splitbus/model_files/locking.py: the lock file is private like everything in the data folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitbus.model_files.locking import exclusive
from tests.modes import mode


@pytest.mark.usefixtures("umask_022")
def test_the_lock_file_is_0600(tmp_path: Path) -> None:
    with exclusive(tmp_path / ".x.lock"):
        assert mode(tmp_path / ".x.lock") == 0o600
    with exclusive(tmp_path / ".x.lock"):  # taken again: the same file
        assert [p.name for p in tmp_path.iterdir()] == [".x.lock"]
