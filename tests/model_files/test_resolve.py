"""splitbus/model_files/resolve.py: what ``--model`` names becomes the folder to load (a GGUF file
through ``splitbus.model_files.gguf.prepare``, stubbed here) and the name to serve."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitbus.model_files.resolve import resolve_model, served_name
from splitbus.tokenization import ModelFilesError
from tests.model_files.fakes import stub_prepare


@pytest.fixture
def prepared(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Path, Path]]:
    return stub_prepare(monkeypatch)


def test_a_folder_is_loaded_as_it_is(tmp_path: Path, prepared: list[tuple[Path, Path]]) -> None:
    (tmp_path / "my-model").mkdir()
    assert resolve_model(tmp_path / "my-model", tmp_path / "data") == tmp_path / "my-model"
    assert prepared == []


def test_a_gguf_file_is_prepared_in_the_data_folders_model_cache(
    tmp_path: Path, prepared: list[tuple[Path, Path]]
) -> None:
    gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    said: list[str] = []
    assert resolve_model(gguf, tmp_path / "data", said.append) == tmp_path / "data" / "models" / "gguf" / "fake"
    assert prepared == [(gguf, tmp_path / "data" / "models")]
    (line,) = said  # said before a conversion that may take a while
    assert line.startswith(f"{gguf}: its Hugging Face folder from {tmp_path / 'data' / 'models' / 'gguf'}")
    upper = tmp_path / "X.GGUF"
    upper.write_bytes(b"GGUF")
    assert resolve_model(upper, tmp_path / "data").name == "fake"  # the suffix in any case


@pytest.mark.parametrize("name, message", [("weights.bin", "neither"), ("absent.gguf", "does not exist")])
def test_anything_else_is_a_model_files_error_naming_it(
    tmp_path: Path, prepared: list[tuple[Path, Path]], name: str, message: str
) -> None:
    if name != "absent.gguf":
        (tmp_path / name).write_bytes(b"x")
    with pytest.raises(ModelFilesError, match=message) as failed:
        resolve_model(tmp_path / name, tmp_path / "data")
    assert str(tmp_path / name) in str(failed.value) and prepared == []


def test_a_folder_named_like_a_gguf_file_is_a_folder(tmp_path: Path, prepared: list[tuple[Path, Path]]) -> None:
    (tmp_path / "odd.gguf").mkdir()
    assert resolve_model(tmp_path / "odd.gguf", tmp_path) == tmp_path / "odd.gguf"
    assert served_name(tmp_path / "odd.gguf") == "odd.gguf" and prepared == []


def test_the_served_name_is_the_files_stem_or_the_folders_name_unless_given(tmp_path: Path) -> None:
    gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    assert served_name(gguf) == "SmolLM2-135M-Instruct.Q4_1"  # not the cache folder's name
    assert served_name(gguf, "smol") == "smol"
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    assert served_name(tmp_path / "models" / "tiny" / ".." / "tiny") == "tiny"  # resolved, as before
