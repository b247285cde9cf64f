"""A GGUF file, converted once into a cached Hugging Face folder that everything downstream loads.

``prepare(path, cache_root)`` returns ``cache_root / "gguf" / <sha256[:16]>`` holding
``config.json``, ``model.safetensors`` (float32), ``tokenizer.json``, ``tokenizer_config.json``
and ``source.json`` (the file's name, size, sha256 and the converter version). The folder is
written beside its final place and renamed into it, so no reader sees half of one; a folder made
by another converter version is made again.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Final

from gguf import GGUFReader

from splitbus.models.gguf import metadata, weights
from splitbus.models.gguf.vocab import tokenizer_files
from splitbus.tokenization import ModelFilesError

CONVERTER_VERSION: Final = 1
"""Raised whenever the folder this package writes changes: older cached folders are redone."""

MAGIC: Final = b"GGUF"
CHUNK: Final = 1 << 20
TOKENIZER_FILES: Final = frozenset({"tokenizer.json", "tokenizer_config.json"})
FILES: Final = TOKENIZER_FILES | {"config.json", "model.safetensors", "source.json"}
"""What a complete cached folder holds."""


@dataclass(frozen=True)
class Source:
    """What a cached folder was converted from and by what: its ``source.json``."""

    file: str
    """The GGUF file's name (not its path: the same file elsewhere hits the same cache)."""
    size: int
    """Its size in bytes."""
    sha256: str
    """The sha256 of its bytes, hex; its first 16 characters name the folder."""
    converter: int = CONVERTER_VERSION
    """The ``CONVERTER_VERSION`` that wrote the folder."""

    @classmethod
    def of(cls, path: Path) -> Source:
        """Check that ``path`` is a GGUF file by its magic, then hash it."""
        try:
            with path.open("rb") as f:
                if f.read(len(MAGIC)) != MAGIC:
                    raise ModelFilesError(f"{path} is not a GGUF file (it does not start with {MAGIC!r})")
                f.seek(0)
                digest = hashlib.sha256()
                while chunk := f.read(CHUNK):
                    digest.update(chunk)
                return cls(path.name, f.tell(), digest.hexdigest())
        except (FileNotFoundError, IsADirectoryError):
            raise ModelFilesError(f"{path} does not exist or is not a file") from None
        except OSError as exc:
            raise ModelFilesError(f"{path} cannot be read: {exc}") from None

    @classmethod
    def read(cls, folder: Path) -> Source | None:
        """The folder's ``source.json``; None when it is absent or not one this code wrote."""
        try:
            raw = json.loads((folder / "source.json").read_text())
            return cls(str(raw["file"]), int(raw["size"]), str(raw["sha256"]), int(raw["converter"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None


def prepare(path: Path, cache_root: Path) -> Path:
    """The Hugging Face folder converted from GGUF file ``path``: from the cache when it is
    there (converted by this version), else converted now. ModelFilesError names the file and
    the problem when it cannot be."""
    source = Source.of(path)
    folder = cache_root / "gguf" / source.sha256[:16]
    if _is_current(folder, source):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _lock(folder):
        if not _is_current(folder, source):  # another process may have converted it while we waited
            _install(_convert(path, source, folder.parent), folder)
    return folder


def _is_current(folder: Path, source: Source) -> bool:
    """Converted from these bytes by this version, and whole (a user may have deleted a file)."""
    found = Source.read(folder)
    if found is None or (found.sha256, found.converter) != (source.sha256, CONVERTER_VERSION):
        return False
    return all((folder / name).is_file() for name in FILES)


@contextlib.contextmanager
def _lock(folder: Path) -> Iterator[None]:
    """One converter per file at a time across processes; the others wait, then find it done."""
    with (folder.parent / f".{folder.name}.lock").open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _convert(path: Path, source: Source, parent: Path) -> Path:
    """A complete folder under a temporary name in ``parent``; ``source.json`` is written last."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{source.sha256[:16]}.tmp-", dir=parent))
    try:
        reader = open_reader(path)
        config = metadata.hf_config(reader, path)
        weights.write(reader, config, tmp / "model.safetensors", path)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        _write_tokenizer(reader, tmp, path)
        (tmp / "source.json").write_text(json.dumps(asdict(source), indent=2) + "\n")
        _readable(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def _readable(tmp: Path) -> None:
    """mkdtemp and safetensors create owner-only entries; the cache is read by every process
    that serves the model (a container's other user, too)."""
    tmp.chmod(0o755)
    for file in tmp.iterdir():
        file.chmod(0o644)


def _write_tokenizer(reader: GGUFReader, tmp: Path, path: Path) -> None:
    files = tokenizer_files(reader)
    if set(files) != TOKENIZER_FILES:
        raise ModelFilesError(f"{path}: the tokenizer gave files {sorted(files)}, expected {sorted(TOKENIZER_FILES)}")
    for name, text in files.items():
        (tmp / name).write_text(text)


def _install(tmp: Path, folder: Path) -> None:
    """Rename ``tmp`` to ``folder``; a stale folder there is moved aside first, then removed."""
    old = folder.with_name(f".{folder.name}.old-{uuid.uuid4().hex}")
    if folder.exists():
        folder.rename(old)
    tmp.rename(folder)
    shutil.rmtree(old, ignore_errors=True)


def open_reader(path: Path) -> GGUFReader:
    """``GGUFReader`` over the file, its errors (a truncated or corrupt file) as ModelFilesError."""
    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError, OSError) as exc:
        raise ModelFilesError(f"{path} cannot be read as GGUF (truncated or corrupt?): {exc}") from None
    if reader.byte_order != "I":
        raise ModelFilesError(f"{path} is a big-endian GGUF file; only little-endian files are supported")
    return reader
