"""A GGUF file, converted once into a cached Hugging Face folder that everything downstream loads.

``prepare(path, cache_root)`` returns ``cache_root / "gguf" / <sha256[:16]>`` holding
``config.json``, ``model.safetensors`` (float32), ``tokenizer.json``, ``tokenizer_config.json``
and ``source.json`` (the file's name, size, sha256 and the converter version). The folder is
written beside its final place and renamed into it, so no reader sees half of one; a folder made
by another converter version is made again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

from gguf import GGUFReader
from safetensors import SafetensorError

from splitbus.folders import private_folder
from splitbus.model_files.gguf import header, metadata, weights
from splitbus.model_files.gguf.vocab import GGUFVocab, read_vocab, vocab_files
from splitbus.model_files.locking import exclusive, remove_leftovers
from splitbus.tokenization import ModelFilesError

logger = logging.getLogger(__name__)

CONVERTER_VERSION: Final = 2
"""Raised whenever the folder this package writes changes: older cached folders are redone.
2: config.json's ``eos_token_id`` lists EOT and EOM too."""

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
    private_folder(cache_root)
    private_folder(folder.parent)
    with exclusive(folder.parent / f".{folder.name}.lock"):
        if not _is_current(folder, source):  # another process may have converted it while we waited
            _remove_leftovers(folder)
            _install(_convert(path, source, folder.parent), folder)
    return folder


def _remove_leftovers(folder: Path) -> None:
    """A run killed while converting (SIGKILL, the OOM killer) leaves its temporary folder, up
    to a whole float32 copy; under the lock nobody else is writing one, so they go."""
    for left in remove_leftovers(folder.parent, f".{folder.name}.tmp-*") + remove_leftovers(
        folder.parent, f".{folder.name}.old-*"
    ):
        logger.info("removed %s, left by a conversion that did not finish", left)


def _is_current(folder: Path, source: Source) -> bool:
    """Converted from these bytes by this version, and whole (a user may have deleted a file)."""
    found = Source.read(folder)
    if found is None or (found.sha256, found.converter) != (source.sha256, CONVERTER_VERSION):
        return False
    return all((folder / name).is_file() for name in FILES)


def _convert(path: Path, source: Source, parent: Path) -> Path:
    """A complete folder under a temporary name in ``parent``; ``source.json`` is written last.
    Everything is read and checked, and the free space too, before the first byte is written."""
    reader = open_reader(path)
    config = metadata.hf_config(reader, path)
    vocab = read_vocab(reader)
    config |= _end_ids(vocab)
    check_vocab_size(reader, config, len(vocab.tokens), path)
    files = _tokenizer_files(vocab, path)
    files["config.json"] = json.dumps(config, indent=2) + "\n"
    files["source.json"] = json.dumps(asdict(source), indent=2) + "\n"
    need = weights.float32_bytes(reader, config, path) + sum(len(t.encode()) for t in files.values())
    _check_free_space(path, parent, need)
    tmp = Path(tempfile.mkdtemp(prefix=f".{source.sha256[:16]}.tmp-", dir=parent))
    try:
        weights.write(reader, config, tmp / "model.safetensors", path)
        for name, text in files.items():  # source.json last (dicts keep their order)
            (tmp / name).write_text(text)
        _private(tmp)
    except (OSError, SafetensorError) as exc:  # a full disk, a file size limit, a read-only cache
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelFilesError(
            f"{path}: cannot write its converted folder in {parent} (it needs {_gb(need)}): {exc}"
        ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def _end_ids(vocab: GGUFVocab) -> dict[str, Any]:
    """config.json's ``eos_token_id``: every id that ends generation, as llama.cpp ends on EOS,
    EOT and EOM (an instruct GGUF may name ``<|eot_id|>`` only as EOT)."""
    ids = vocab.end_ids
    if not ids:
        return {}
    return {"eos_token_id": ids[0] if len(ids) == 1 else list(ids)}


def check_vocab_size(reader: GGUFReader, config: dict[str, Any], n_tokens: int, where: Path | str) -> None:
    """The token list, the metadata's vocabulary size and the rows of the embedding and output
    matrices must agree (llama.cpp requires it): a token past the rows would index out of range."""
    rows = {"the metadata's vocab_size": int(config["vocab_size"])}
    for tensor in reader.tensors:
        if tensor.name in ("token_embd.weight", "output.weight"):
            rows[f"{tensor.name}'s rows"] = weights.hf_shape(tensor)[0]
    for what, count in rows.items():
        if count != n_tokens:
            raise ModelFilesError(f"{where}: the tokenizer has {n_tokens} tokens but {what} is {count}")


def _check_free_space(path: Path, parent: Path, need: int) -> None:
    free = shutil.disk_usage(parent).free
    if free < need:
        raise ModelFilesError(
            f"{path}: converting it writes {_gb(need)} (float32 weights and the tokenizer) into {parent}, "
            f"which has {_gb(free)} free; free some space or give another --data-dir"
        )


def _gb(size: int) -> str:
    return f"{size / 1e9:.2f} GB"


def _private(tmp: Path) -> None:
    """mkdtemp makes the folder 0700; its files, written under the umask, are made 0600 (the
    cache is the user's, as everything in the data folder is)."""
    for file in tmp.iterdir():
        file.chmod(0o600)


def _tokenizer_files(vocab: GGUFVocab, path: Path) -> dict[str, str]:
    files = vocab_files(vocab, str(path))
    if set(files) != TOKENIZER_FILES:
        raise ModelFilesError(f"{path}: the tokenizer gave files {sorted(files)}, expected {sorted(TOKENIZER_FILES)}")
    return files


def _install(tmp: Path, folder: Path) -> None:
    """Rename ``tmp`` to ``folder``; a stale folder there is moved aside first, then removed."""
    old = folder.with_name(f".{folder.name}.old-{uuid.uuid4().hex}")
    if folder.exists():
        folder.rename(old)
    tmp.rename(folder)
    shutil.rmtree(old, ignore_errors=True)


def open_reader(path: Path) -> GGUFReader:
    """``GGUFReader`` over the file, its errors (a truncated or corrupt file) as ModelFilesError.
    The header is walked first (:func:`header.check`): the reader trusts its counts."""
    header.check(path)
    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError, OSError) as exc:
        raise ModelFilesError(f"{path} cannot be read as GGUF (truncated or corrupt?): {exc}") from None
    if reader.byte_order != "I":
        raise ModelFilesError(f"{path} is a big-endian GGUF file; only little-endian files are supported")
    return reader
