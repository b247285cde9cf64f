"""The bounded walk over a GGUF header (splitbus/model_files/gguf/header.py): a file whose counts or
lengths lie fails naming the file and the field, before ``GGUFReader`` believes them."""

from __future__ import annotations

import os
import random
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from gguf import GGUFReader

from splitbus.model_files.gguf import header, open_reader, prepare
from splitbus.tokenization import ModelFilesError
from tests.model_files.gguf.writer import write_gguf

ARRAY, UINT8, UINT32, STRING = 9, 0, 4, 8


def _str(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def _gguf(kvs: list[bytes] = (), tensors: list[bytes] = (), data: bytes = b"", version: int = 3) -> bytes:  # type: ignore[assignment]
    """A file from raw KVs and tensor infos; ``data`` follows the header, aligned to 32."""
    head = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs)) + b"".join(kvs) + b"".join(tensors)
    return head + b"\0" * (-len(head) % 32) + data


def _kv(key: bytes, kind: int, value: bytes) -> bytes:
    return _str(key) + struct.pack("<I", kind) + value


def _tensor(name: bytes, dims: tuple[int, ...], kind: int = 0, offset: int = 0) -> bytes:
    return _str(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, kind, offset)


ATTACK = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _kv(b"a", ARRAY, struct.pack("<IQ", UINT8, 2**63))
"""49 bytes: one array of 2**63 one-byte items (the reader looped, allocating, until memory ran out)."""

CHILD = """
import resource, sys
from pathlib import Path
from splitbus.model_files.gguf import prepare
from splitbus.tokenization import ModelFilesError

size = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
cap = size + (256 << 20)  # what the interpreter maps now, and 256 MiB: the reader grew ~130 MiB/s
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    prepare(Path(sys.argv[1]), Path(sys.argv[2]))
except ModelFilesError as exc:
    print("refused:", exc)
print("grew KiB:", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""


def test_a_49_byte_file_claiming_2_63_items_is_refused_in_flat_memory(tmp_path: Path, repo_root: Path) -> None:
    attack = tmp_path / "attack.gguf"
    attack.write_bytes(ATTACK)
    assert len(ATTACK) == 49
    # In a child capped at 256 MiB more than it maps: a reader that believed the count dies of
    # MemoryError there (not a ModelFilesError) instead of eating this machine.
    env = {**os.environ, "PYTHONPATH": str(repo_root), "OPENBLAS_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(attack), str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert f"refused: {attack} cannot be read as GGUF (truncated or corrupt?): a's item count: {2**63}" in done.stdout
    grew = int(done.stdout.split("grew KiB:")[1])
    assert grew < 32 << 10, done.stdout  # nothing was allocated for the items
    assert not (tmp_path / "cache" / "gguf").exists() or not list((tmp_path / "cache" / "gguf").glob(".*tmp*"))


def _fits(field: bytes) -> bytes:
    """A file of one KV and nothing after it."""
    return b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + field


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (_gguf(version=1), "version: version 1; versions [2, 3] are supported"),
        (_gguf(version=3 << 24), "version: a big-endian file"),
        (b"GGUF" + struct.pack("<IQQ", 3, 2**40, 0), f"tensor count: {2**40} is more than"),
        (b"GGUF" + struct.pack("<IQQ", 3, 0, 2**63), f"metadata count: {2**63} is more than"),
        (_fits(struct.pack("<Q", 2**62) + b"k" * 8), "metadata key at offset 24: a name of 4611686018427387904 bytes"),
        (_fits(_str(b"k\xff") + struct.pack("<IB", UINT8, 1)), "metadata key at offset 24: text that is not UTF-8"),
        (_fits(_kv(b"k", 13, b"")), "): k: unknown value type 13"),
        (_fits(_kv(b"k", STRING, struct.pack("<Q", 2**50))), "k: needs 1125899906842624 bytes at offset"),
        (_fits(_kv(b"k", ARRAY, struct.pack("<IQ", ARRAY, 1))), "k: an array of arrays (not supported)"),
        (_fits(_kv(b"k", ARRAY, struct.pack("<IQ", STRING, 3) + _str(b"a" * 20))), "k[1]'s length: needs 8 bytes"),
        (_fits(_kv(b"k", ARRAY, struct.pack("<IQ", UINT32, 1 << 22))), "k's item count: 4194304 is more than"),
        (_fits(_kv(b"general.alignment", UINT32, struct.pack("<I", 24))), "general.alignment: 24 is not a power"),
        (_fits(_kv(b"general.alignment", UINT8, b"\x20")), "general.alignment: type UINT8, expected UINT32"),
        (_gguf(tensors=[_tensor(b"t", (2,) * 9)]), "tensor t: 9 dimensions; 1 to 4 are allowed"),
        (_gguf(tensors=[_tensor(b"t", (4,), kind=99)]), "tensor t: unknown tensor type 99"),
        (_gguf(tensors=[_tensor(b"t", (33,), kind=8)]), "tensor t: 33 values a row is not a whole number of 32"),
        (_gguf(tensors=[_tensor(b"t", (4,))], data=b"\0" * 8), "tensor t: 16 bytes at data offset 0 do not fit"),
        (_gguf(tensors=[_tensor(b"t", (2**40, 2**40))]), "tensor t: 4835703278458516698824704 bytes at data"),
        (_gguf(tensors=[_tensor(b"t", (1,), offset=4)], data=b"\0" * 64), "bytes at data offset 4 do not fit"),
        (_gguf(tensors=[_tensor(b"t", (8,)), _tensor(b"t", (8,))], data=b"\0" * 64), "a second tensor of that name"),
        (
            _gguf(tensors=[_tensor(b"a", (8,)), _tensor(b"b", (8,))], data=b"\0" * 32),
            "tensors: 64 bytes of tensor data, and the file holds 32",  # both at offset 0: read twice
        ),
    ],
    ids=lambda value: value if isinstance(value, str) else "file",
)
def test_a_lying_header_names_the_file_and_the_field(tmp_path: Path, data: bytes, problem: str) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data)
    with pytest.raises(ModelFilesError) as info:
        open_reader(bad)
    assert str(info.value).startswith(f"{bad} cannot be read as GGUF (truncated or corrupt?): ")
    assert problem in str(info.value)


def test_a_header_that_tells_the_truth_passes(tmp_path: Path) -> None:
    good = tmp_path / "good.gguf"
    good.write_bytes(_gguf([_kv(b"k", ARRAY, struct.pack("<IQ", STRING, 2) + _str(b"a") + _str(b"\xff"))]))
    header.check(good)  # a string value need not be UTF-8 (a token may be bytes)
    assert "k" in open_reader(good).fields


@pytest.fixture(scope="module")
def real_file(tiny_hf: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tiny_hf("llama"), tmp_path_factory.mktemp("real") / "tiny.gguf", "Q8_0")


def test_every_truncation_is_a_model_files_error(real_file: Path, tmp_path: Path) -> None:
    data = real_file.read_bytes()
    end = GGUFReader(real_file).data_offset
    cuts = [*range(0, end + 64), *range(end + 64, len(data) - 32, 997)]  # every byte of the header
    bad = tmp_path / "cut.gguf"
    for cut in cuts:
        bad.write_bytes(data[:cut])
        with pytest.raises(ModelFilesError, match="cannot be read as GGUF|is not a GGUF file"):
            header.check(bad)


def test_garbled_headers_are_model_files_errors_or_read(real_file: Path, tmp_path: Path) -> None:
    """Random bytes over random places of the header: each file is read, or fails with a
    ModelFilesError; never another exception, never a runaway allocation."""
    data = real_file.read_bytes()
    end = GGUFReader(real_file).data_offset
    rng = random.Random(34)
    bad = tmp_path / "garbled.gguf"
    refused = 0
    for _ in range(400):
        garbled = bytearray(data)
        at = rng.randrange(4, end)
        garbled[at : at + 8] = rng.choice([b"\xff" * 8, rng.randbytes(8), struct.pack("<Q", rng.getrandbits(40))])
        bad.write_bytes(bytes(garbled))
        try:
            open_reader(bad)
        except ModelFilesError:
            refused += 1
    assert refused > 100  # most places are counts, lengths and types, and the walk caught them


def test_a_real_file_still_converts(real_file: Path, tmp_path: Path) -> None:
    header.check(real_file)
    assert (prepare(real_file, tmp_path / "cache") / "model.safetensors").is_file()
