"""splitbus/folders.py: every folder splitbus creates is 0700 under the usual umask, missing
parents too; splitbus's own folders are tightened when an older version left them 0755; a
folder the user made (the data folder itself) and a symbolic link's target are left alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitbus.folders import create_private, private_folder
from tests.modes import folder_modes, mode


@pytest.mark.usefixtures("umask_022")
def test_a_plain_mkdir_would_make_0755(tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()  # the attack's premise: the umask leaves others r-x
    assert mode(tmp_path / "plain") == 0o755


@pytest.mark.usefixtures("umask_022")
def test_every_missing_folder_is_made_0700(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    create_private(tmp_path / "data" / "models" / "gguf")
    assert folder_modes(tmp_path) == {".": 0o755, "data": 0o700, "data/models": 0o700, "data/models/gguf": 0o700}


@pytest.mark.usefixtures("umask_022")
def test_an_existing_data_folder_is_left_as_the_user_made_it(tmp_path: Path) -> None:
    data = tmp_path / "shared"
    data.mkdir(mode=0o755)
    create_private(data)
    private_folder(data / "models")
    assert folder_modes(data) == {".": 0o755, "models": 0o700}


@pytest.mark.usefixtures("umask_022")
def test_an_own_folder_an_older_version_left_0755_is_tightened(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir(mode=0o755)
    (tmp_path / "models" / "gguf").mkdir(mode=0o777)
    (tmp_path / "models" / "gguf").chmod(0o777)
    private_folder(tmp_path / "models")
    private_folder(tmp_path / "models" / "gguf")
    assert mode(tmp_path / "models") == mode(tmp_path / "models" / "gguf") == 0o700


@pytest.mark.usefixtures("umask_022")
def test_a_symbolic_link_s_target_is_left_alone(tmp_path: Path) -> None:
    elsewhere = tmp_path / "big-disk"
    elsewhere.mkdir(mode=0o755)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "models").symlink_to(elsewhere)
    private_folder(tmp_path / "data" / "models")
    assert mode(elsewhere) == 0o755
