"""prepare(): a GGUF file -> a cached Hugging Face folder, converted once per file and converter
version, renamed into place whole; bad files fail naming the file and leave nothing behind."""

from __future__ import annotations

import errno
import hashlib
import json
import re
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFWriter
from safetensors import SafetensorError
from safetensors.numpy import load_file

import splitbus.model_files.gguf as gguf_models
from splitbus.architectures import load_config
from splitbus.cli import worker_cmd
from splitbus.cli.main import build_parser
from splitbus.env import load_env
from splitbus.model_files.gguf import CONVERTER_VERSION, FILES, prepare
from splitbus.model_files.resolve import resolve_model
from splitbus.tokenization import ModelFilesError, ModelTokenizer
from tests.model_files.gguf.writer import write_gguf
from tests.modes import folder_modes, mode


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
    assert source == {
        "file": "tiny-llama.gguf",
        "size": gguf_file.stat().st_size,
        "sha256": sha,
        "converter": CONVERTER_VERSION,
    }
    original = load_file(str(tiny_hf("llama") / "model.safetensors"))
    converted = load_file(str(folder / "model.safetensors"))
    assert sorted(converted) == sorted(original)
    assert all(np.array_equal(converted[name], original[name]) for name in original)  # F32: exact
    assert load_config(folder) == load_config(tiny_hf("llama"))
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


def _with_end_ids(writer: GGUFWriter) -> None:
    writer.add_eot_token_id(EOT)
    writer.add_eom_token_id(EOM)


EOT, EOM = 5, 6  # any ids of the tiny vocabulary other than its EOS


def test_eot_and_eom_end_generation_too(tiny_hf: Callable[[str], Path], tmp_path: Path) -> None:
    path = write_gguf(tiny_hf("llama"), tmp_path / "eot.gguf", metadata=_with_end_ids)
    folder = prepare(path, tmp_path / "cache")
    eos = json.loads((tiny_hf("llama") / "config.json").read_text())["eos_token_id"]
    assert set(ModelTokenizer.load(folder).eos_token_ids) == {eos, EOT, EOM}
    assert json.loads((folder / "config.json").read_text())["eos_token_id"] == [eos, EOT, EOM]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_file_without_eot_keeps_one_eos(tiny_hf: Callable[[str], Path], tmp_path: Path, arch: str) -> None:
    folder = prepare(write_gguf(tiny_hf(arch), tmp_path / "plain.gguf"), tmp_path / "cache")
    eos = json.loads((tiny_hf(arch) / "config.json").read_text())["eos_token_id"]
    assert json.loads((folder / "config.json").read_text())["eos_token_id"] == eos
    assert ModelTokenizer.load(folder).eos_token_ids == (eos,)


@pytest.mark.parametrize("tensor", ["token_embd.weight", "output.weight"])
def test_the_token_count_must_equal_the_matrix_rows(
    tiny_hf: Callable[[str], Path], tmp_path: Path, conversions: list[Path], tensor: str
) -> None:
    hf = tiny_hf("llama")  # not tied: it has both matrices
    config = json.loads((hf / "config.json").read_text())
    short = np.zeros((config["vocab_size"] - 1, config["hidden_size"]), np.float32)
    bad = write_gguf(hf, tmp_path / "bad.gguf", drop=frozenset({tensor}), extra_tensors={tensor: short})
    counts = f"the tokenizer has {config['vocab_size']} tokens but {tensor}'s rows is {config['vocab_size'] - 1}"
    with pytest.raises(ModelFilesError, match=re.escape(f"{bad}: {counts}")):
        prepare(bad, tmp_path / "cache")
    assert conversions == [] and _entries(tmp_path / "cache") == set()


def test_the_metadata_vocab_size_must_equal_the_token_count(tiny_hf: Callable[[str], Path], tmp_path: Path) -> None:
    n = json.loads((tiny_hf("llama") / "config.json").read_text())["vocab_size"]
    bad = write_gguf(tiny_hf("llama"), tmp_path / "bad.gguf", hparams={"vocab_size": n + 1})
    with pytest.raises(ModelFilesError, match=f"the tokenizer has {n} tokens but the metadata's vocab_size is {n + 1}"):
        prepare(bad, tmp_path / "cache")


def _float32_size(hf: Path) -> int:
    return sum(a.size * 4 for a in load_file(str(hf / "model.safetensors")).values())


def test_too_little_free_space_is_refused_before_writing(
    tiny_hf: Callable[[str], Path],
    gguf_file: Path,
    tmp_path: Path,
    conversions: list[Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    free: list[Path] = []

    def disk_usage(path: Path) -> shutil._ntuple_diskusage:
        free.append(Path(path))
        return shutil._ntuple_diskusage(1 << 40, (1 << 40) - 1000, 1000)

    monkeypatch.setattr(gguf_models.shutil, "disk_usage", disk_usage)
    with pytest.raises(ModelFilesError) as info:
        prepare(gguf_file, tmp_path / "cache")
    message = str(info.value)
    assert f"{gguf_file}: converting it writes " in message and f"into {tmp_path / 'cache' / 'gguf'}, " in message
    assert "which has 0.00 GB free" in message
    assert free == [tmp_path / "cache" / "gguf"] and conversions == []
    assert _entries(tmp_path / "cache") == set()


def test_the_space_asked_for_is_the_float32_weights_and_the_tokenizer(
    tiny_hf: Callable[[str], Path], gguf_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    needed: list[int] = []
    monkeypatch.setattr(gguf_models, "_check_free_space", lambda path, parent, need: needed.append(need))
    folder = prepare(gguf_file, tmp_path / "cache")
    weights = _float32_size(tiny_hf("llama"))
    others = sum(p.stat().st_size for p in folder.iterdir() if p.name != "model.safetensors")
    assert needed == [weights + others]  # the safetensors header (a few kB) aside: what is written


@pytest.mark.parametrize(
    "error",
    [
        SafetensorError("Error while serializing: I/O error: File too large (os error 27)"),
        OSError(errno.ENOSPC, "No space left on device"),
    ],
)
def test_a_failed_write_names_the_folder_and_the_space(
    tiny_hf: Callable[[str], Path], gguf_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    def failing(*args: Any) -> None:
        raise error

    monkeypatch.setattr(gguf_models.weights, "write", failing)
    with pytest.raises(ModelFilesError) as info:
        prepare(gguf_file, tmp_path / "cache")
    message = str(info.value)
    assert message.startswith(f"{gguf_file}: cannot write its converted folder in {tmp_path / 'cache' / 'gguf'}")
    assert "(it needs 0.00 GB)" in message and str(error) in message
    assert _entries(tmp_path / "cache") == set()  # the temporary folder went too


def test_the_worker_says_why_and_exits_2(
    gguf_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(gguf_models.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10, 10, 0))
    monkeypatch.setattr(worker_cmd, "run_service", lambda *a: pytest.fail("the worker started"))
    args = ["worker", "--role", "mixed", "--model", str(gguf_file), "--data-dir", str(tmp_path / "d")]
    code = worker_cmd.run(build_parser(load_env({})).parse_args(args), load_env({}))
    out = capsys.readouterr()
    assert code == 2
    assert f"splitbus worker: {gguf_file}: converting it writes " in out.out + out.err
    assert "Traceback" not in out.out + out.err


def test_a_killed_conversion_s_leftovers_are_removed(gguf_file: Path, tmp_path: Path) -> None:
    key = hashlib.sha256(gguf_file.read_bytes()).hexdigest()[:16]
    cache = tmp_path / "cache" / "gguf"
    for left in (f".{key}.tmp-killed", f".{key}.old-killed"):
        (cache / left).mkdir(parents=True)
        (cache / left / "model.safetensors").write_bytes(b"half a file")
    (cache / ".0123456789abcdef.tmp-other").mkdir()  # another file's: its own lock guards it
    folder = prepare(gguf_file, tmp_path / "cache")
    assert _entries(tmp_path / "cache") == {folder.name, ".0123456789abcdef.tmp-other"}


def test_metadata_text_that_is_not_utf8_names_the_file_and_key(tiny_hf: Callable[[str], Path], tmp_path: Path) -> None:
    good = write_gguf(tiny_hf("llama"), tmp_path / "good.gguf")
    data = bytearray(good.read_bytes())
    key = b"general.architecture"
    at = data.find(key) + len(key) + 4 + 8  # after the value type (uint32) and the string's length (uint64)
    assert data[at : at + 5] == b"llama"
    data[at + 2] = 0xFF
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(
        ModelFilesError, match=re.escape(f"{bad}: metadata general.architecture holds text that is not UTF-8")
    ):
        prepare(bad, tmp_path / "cache")


@pytest.mark.usefixtures("umask_022")
def test_a_conversion_that_makes_the_data_folder_makes_every_folder_0700(gguf_file: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    folder = resolve_model(gguf_file, data)  # the first thing to run: it makes the data folder
    assert folder_modes(data) == {
        ".": 0o700,
        "models": 0o700,
        "models/gguf": 0o700,
        f"models/gguf/{folder.name}": 0o700,
    }
    assert {mode(file) for file in folder.iterdir()} == {0o600}
    assert mode(data / "models" / "gguf" / f".{folder.name}.lock") == 0o600


@pytest.mark.usefixtures("umask_022")
def test_model_folders_an_older_version_left_0755_are_tightened(gguf_file: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "models" / "gguf").mkdir(parents=True)  # 0755 each, as an older conversion left them
    folder = resolve_model(gguf_file, data)
    modes = folder_modes(data)
    assert modes.pop(".") == 0o755  # the data folder may be the user's: left as it is
    assert modes == {"models": 0o700, "models/gguf": 0o700, f"models/gguf/{folder.name}": 0o700}
