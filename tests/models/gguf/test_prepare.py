"""prepare(): a GGUF file -> a cached Hugging Face folder, converted once per file and converter
version, renamed into place whole; bad files fail naming the file and leave nothing behind."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

import splitbus.models.gguf as gguf_models
from splitbus.models.gguf import CONVERTER_VERSION, FILES, prepare
from splitbus.tokenization import ModelFilesError, ModelTokenizer
from splitbus.worker.engines.paddle.config import ModelConfig
from tests.models.gguf.writer import write_gguf


@pytest.fixture
def gguf_file(tiny_hf: Callable[[str], Path], tmp_path: Path) -> Path:
    return write_gguf(tiny_hf("llama"), tmp_path / "tiny-llama.gguf")


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The model.safetensors paths written, one per conversion."""
    written: list[Path] = []
    real = gguf_models.weights.write

    def counting(reader: Any, config: dict[str, Any], path: Path, where: Path | str) -> None:
        written.append(path)
        real(reader, config, path, where)

    monkeypatch.setattr(gguf_models.weights, "write", counting)
    return written


def _entries(cache: Path) -> set[str]:
    return {p.name for p in (cache / "gguf").iterdir() if not p.name.endswith(".lock")}


def test_prepare_writes_a_hugging_face_folder(tiny_hf: Callable[[str], Path], gguf_file: Path, tmp_path: Path) -> None:
    sha = hashlib.sha256(gguf_file.read_bytes()).hexdigest()
    folder = prepare(gguf_file, tmp_path / "cache")
    assert folder == tmp_path / "cache" / "gguf" / sha[:16]
    assert {p.name for p in folder.iterdir()} == FILES
    assert _entries(tmp_path / "cache") == {sha[:16]}  # no temporary folder left
    source = json.loads((folder / "source.json").read_text())
    assert source == {"file": "tiny-llama.gguf", "size": gguf_file.stat().st_size, "sha256": sha, "converter": 1}
    original = load_file(str(tiny_hf("llama") / "model.safetensors"))
    converted = load_file(str(folder / "model.safetensors"))
    assert sorted(converted) == sorted(original)
    assert all(np.array_equal(converted[name], original[name]) for name in original)  # F32: exact
    assert ModelConfig.load(folder) == ModelConfig.load(tiny_hf("llama"))
    assert ModelTokenizer.load(folder).eos_token_ids  # the tokenizer files load as a folder's do


def test_second_prepare_reuses_the_folder(gguf_file: Path, tmp_path: Path, conversions: list[Path]) -> None:
    folder = prepare(gguf_file, tmp_path / "cache")
    stamp = (folder / "model.safetensors").stat()
    copy = tmp_path / "elsewhere" / "renamed.gguf"  # the key is the bytes, not the path
    copy.parent.mkdir()
    copy.write_bytes(gguf_file.read_bytes())
    assert prepare(gguf_file, tmp_path / "cache") == prepare(copy, tmp_path / "cache") == folder
    assert len(conversions) == 1
    again = (folder / "model.safetensors").stat()
    assert (again.st_ino, again.st_mtime_ns) == (stamp.st_ino, stamp.st_mtime_ns)


@pytest.mark.parametrize("stale", ["older converter", "no source.json", "other file's hash", "a file deleted"])
def test_a_stale_folder_is_converted_again(
    gguf_file: Path, tmp_path: Path, conversions: list[Path], stale: str
) -> None:
    folder = prepare(gguf_file, tmp_path / "cache")
    source = json.loads((folder / "source.json").read_text())
    if stale == "no source.json":
        (folder / "source.json").unlink()
    elif stale == "a file deleted":
        (folder / "tokenizer.json").unlink()
    else:
        key = "converter" if stale == "older converter" else "sha256"
        (folder / "source.json").write_text(json.dumps(source | {key: 0 if key == "converter" else "0" * 64}))
    (folder / "model.safetensors").write_bytes(b"half a file")
    assert prepare(gguf_file, tmp_path / "cache") == folder
    assert len(conversions) == 2
    assert json.loads((folder / "source.json").read_text())["converter"] == CONVERTER_VERSION
    assert load_file(str(folder / "model.safetensors"))  # the new one, whole
    assert _entries(tmp_path / "cache") == {folder.name}  # the stale one is gone


def test_concurrent_prepares_convert_once(gguf_file: Path, tmp_path: Path, conversions: list[Path]) -> None:
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(prepare(gguf_file, tmp_path / "cache"))) for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and len(results) == 3
    assert len(conversions) == 1


def _not_gguf(path: Path, good: Path) -> None:
    path.write_text('{"this": "is json"}')


def _empty(path: Path, good: Path) -> None:
    path.write_bytes(b"")


def _truncated_header(path: Path, good: Path) -> None:
    path.write_bytes(good.read_bytes()[:100])


def _truncated_tensors(path: Path, good: Path) -> None:
    data = good.read_bytes()
    path.write_bytes(data[: len(data) - 1000])


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        (_not_gguf, r"bad\.gguf is not a GGUF file \(it does not start with b'GGUF'\)"),
        (_empty, r"bad\.gguf is not a GGUF file"),
        (_truncated_header, r"bad\.gguf cannot be read as GGUF \(truncated or corrupt\?\)"),
        (_truncated_tensors, r"bad\.gguf cannot be read as GGUF \(truncated or corrupt\?\)"),
    ],
)
def test_bad_files_fail_naming_the_file(
    gguf_file: Path, tmp_path: Path, make: Callable[[Path, Path], None], problem: str
) -> None:
    bad = tmp_path / "bad.gguf"
    make(bad, gguf_file)
    with pytest.raises(ModelFilesError, match=problem):
        prepare(bad, tmp_path / "cache")
    assert not (tmp_path / "cache" / "gguf").exists() or _entries(tmp_path / "cache") == set()


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        ({"arch": "phi2"}, "architecture 'phi2' is not supported"),
        ({"tensor_types": {"blk.0.ffn_down.weight": "I8"}}, "tensor blk.0.ffn_down.weight has type I8"),
    ],
)
def test_unconvertible_files_leave_no_folder(
    tiny_hf: Callable[[str], Path], tmp_path: Path, options: dict[str, Any], problem: str
) -> None:
    bad = write_gguf(tiny_hf("llama"), tmp_path / "bad.gguf", **options)
    with pytest.raises(ModelFilesError, match=problem) as info:
        prepare(bad, tmp_path / "cache")
    assert str(bad) in str(info.value)
    assert _entries(tmp_path / "cache") == set()


def test_missing_file_fails(tmp_path: Path) -> None:
    with pytest.raises(ModelFilesError, match=r"nothing\.gguf does not exist or is not a file"):
        prepare(tmp_path / "nothing.gguf", tmp_path / "cache")
