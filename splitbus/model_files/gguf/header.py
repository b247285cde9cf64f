"""A bounded walk over a GGUF file's header, before ``gguf.GGUFReader`` reads it.

The reader believes every count and length in the file: one array claiming 2**63 items made it
loop, allocating, until memory ran out (from a 49-byte file). :func:`check` reads the same layout
with ``struct`` and holds each count and length against the bytes left in the file and against
bounds far above any model the converter takes, so that the reader only meets a header whose
every part is there. Layout (GGUF v2 and v3, little-endian): magic, version u32, tensor count
u64, KV count u64; each KV: key (u64 length + UTF-8), value type u32, value (an array: item type
u32, item count u64, the items); then each tensor: name, n_dims u32, dims u64 * n_dims, type u32,
offset u64 from the start of the data (the end of the header, rounded up to the alignment).
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Final

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from splitbus.architectures.base import MAX_LAYERS
from splitbus.tokenization import ModelFilesError

VERSIONS: Final = (2, 3)
"""The versions ``GGUFReader`` reads (v1 had 32-bit counts)."""
MAX_KVS: Final = 1 << 12
"""Metadata keys; llama.cpp's converter writes about 40."""
MAX_TENSORS: Final = 16 * MAX_LAYERS + 16
"""A Llama, Qwen2, Mixtral or Qwen3-MoE layer (experts stacked) has at most 12 tensors, and a model
at most MAX_LAYERS layers."""
MAX_ARRAY_ITEMS: Final = 1 << 21
"""Items in all the metadata's arrays together (Llama 3's tokenizer has about 0.66 million). The
reader keeps a numpy view per item, about 0.7 KB each (1.5 KB a string): this caps it near 3 GB."""
MAX_KEY: Final = 1 << 16
"""A key's bytes (the GGUF spec's limit is 65535)."""
MAX_NAME: Final = 1 << 8
"""A tensor name's bytes (ggml's GGML_MAX_NAME is 64)."""
MAX_DIMS: Final = 4
"""ggml's GGML_MAX_DIMS."""
DEFAULT_ALIGNMENT: Final = 32

_SCALARS: Final = {
    GGUFValueType.UINT8: 1,
    GGUFValueType.INT8: 1,
    GGUFValueType.BOOL: 1,
    GGUFValueType.UINT16: 2,
    GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4,
    GGUFValueType.INT32: 4,
    GGUFValueType.FLOAT32: 4,
    GGUFValueType.UINT64: 8,
    GGUFValueType.INT64: 8,
    GGUFValueType.FLOAT64: 8,
}
"""Value type -> its size in bytes."""
_MIN_KV: Final = 8 + 4 + 1
"""The smallest KV: an empty key, a type and a one-byte value."""
_MIN_TENSOR: Final = 8 + 4 + 8 + 4 + 8
"""The smallest tensor info: an empty name, one dimension, a type and an offset."""


class _Cursor:
    """Reads little-endian fields from the start of ``data``; every read is checked against the
    bytes left, and a failure names the file and the field."""

    def __init__(self, data: bytes | mmap.mmap, where: Path | str) -> None:
        self.data, self.pos, self.where = data, 0, str(where)
        self.items_left = MAX_ARRAY_ITEMS

    @property
    def left(self) -> int:
        return len(self.data) - self.pos

    def fail(self, field: str, problem: str) -> ModelFilesError:
        return ModelFilesError(f"{self.where} cannot be read as GGUF (truncated or corrupt?): {field}: {problem}")

    def skip(self, size: int, field: str) -> int:
        """Step over ``size`` bytes; returns where they start."""
        if size > self.left:
            raise self.fail(field, f"needs {size} bytes at offset {self.pos}, and the file has {self.left} left")
        start, self.pos = self.pos, self.pos + size
        return start

    def u32(self, field: str) -> int:
        return int(struct.unpack_from("<I", self.data, self.skip(4, field))[0])

    def u64(self, field: str) -> int:
        return int(struct.unpack_from("<Q", self.data, self.skip(8, field))[0])

    def count(self, field: str, high: int, min_size: int) -> int:
        """A count of things of at least ``min_size`` bytes each: at most ``high``, and no more than
        the bytes left could hold."""
        value = self.u64(field)
        if value > min(high, self.left // min_size):
            raise self.fail(field, f"{value} is more than the limit {high} or the {self.left} bytes left can hold")
        return value

    def string(self, field: str) -> None:
        """Step over a string value (its text is checked where it is read: a token need not be UTF-8)."""
        self.skip(self.u64(f"{field}'s length"), field)

    def name(self, field: str, high: int) -> str:
        """A key or a tensor name: the reader decodes these as UTF-8."""
        size = self.u64(f"{field}'s length")
        if size > high:
            raise self.fail(field, f"a name of {size} bytes; at most {high} are allowed")
        start = self.skip(size, field)
        try:
            return bytes(self.data[start : start + size]).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(field, f"text that is not UTF-8 ({exc.reason} at byte {exc.start})") from None


def check(path: Path) -> None:
    """Walk ``path``'s header; ModelFilesError naming the file and the field when any part of it
    is missing, out of bounds or of a type the reader cannot read."""
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            check_bytes(data, path)
    except ModelFilesError:
        raise
    except (OSError, ValueError) as exc:  # an empty file cannot be mapped
        raise ModelFilesError(f"{path} cannot be read as GGUF: {exc}") from None


def check_bytes(data: bytes | mmap.mmap, where: Path | str) -> None:
    """:func:`check` of a file's bytes; ``where`` names the file in errors."""
    cursor = _Cursor(data, where)
    if bytes(data[:4]) != b"GGUF":
        raise cursor.fail("magic", "the file does not start with b'GGUF'")
    cursor.skip(4, "magic")
    _version(cursor)
    tensors = cursor.count("tensor count", MAX_TENSORS, _MIN_TENSOR)
    kvs = cursor.count("metadata count", MAX_KVS, _MIN_KV)
    alignment = DEFAULT_ALIGNMENT
    for _ in range(kvs):
        key = cursor.name(f"metadata key at offset {cursor.pos}", MAX_KEY)
        alignment = _value(cursor, key) or alignment
    infos = [_tensor_info(cursor) for _ in range(tensors)]
    _tensor_data(cursor, infos, -(-cursor.pos // alignment) * alignment, alignment)


def _version(cursor: _Cursor) -> None:
    version = cursor.u32("version")
    if version & 0xFFFF == 0:
        raise cursor.fail("version", "a big-endian file; only little-endian files are supported")
    if version not in VERSIONS:
        raise cursor.fail("version", f"version {version}; versions {list(VERSIONS)} are supported")


def _value(cursor: _Cursor, key: str) -> int | None:
    """Step over ``key``'s value; returns the alignment when ``key`` is ``general.alignment``."""
    kind = _value_type(cursor, key)
    if key == "general.alignment":
        if kind != GGUFValueType.UINT32:
            raise cursor.fail(key, f"type {kind.name}, expected UINT32")
        alignment = cursor.u32(key)
        if alignment == 0 or alignment & (alignment - 1):
            raise cursor.fail(key, f"{alignment} is not a power of two")
        return alignment
    if kind == GGUFValueType.ARRAY:
        _array(cursor, key)
    elif kind == GGUFValueType.STRING:
        cursor.string(key)
    else:
        cursor.skip(_SCALARS[kind], key)
    return None


def _value_type(cursor: _Cursor, field: str) -> GGUFValueType:
    raw = cursor.u32(f"{field}'s type")
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise cursor.fail(field, f"unknown value type {raw}") from None


def _array(cursor: _Cursor, key: str) -> None:
    """An array of scalars (one bounds check for all of them) or of strings (each checked); the
    converter needs no array of arrays, and their nesting has no bound, so none is read."""
    kind = _value_type(cursor, f"{key}'s items")
    if kind == GGUFValueType.ARRAY:
        raise cursor.fail(key, "an array of arrays (not supported)")
    size = _SCALARS.get(kind, 8)  # a string is at least its u64 length
    count = cursor.count(f"{key}'s item count", cursor.items_left, size)
    cursor.items_left -= count
    if kind != GGUFValueType.STRING:
        cursor.skip(count * size, key)
        return
    for i in range(count):
        cursor.string(f"{key}[{i}]")


def _tensor_info(cursor: _Cursor) -> tuple[str, int, int]:
    """One tensor's (name, bytes of data, offset), its dimensions and type checked."""
    name = cursor.name(f"tensor name at offset {cursor.pos}", MAX_NAME)
    n_dims = cursor.u32(f"tensor {name}'s dimension count")
    if not 1 <= n_dims <= MAX_DIMS:
        raise cursor.fail(f"tensor {name}", f"{n_dims} dimensions; 1 to {MAX_DIMS} are allowed")
    dims = [cursor.u64(f"tensor {name}'s dimensions") for _ in range(n_dims)]
    raw = cursor.u32(f"tensor {name}'s type")
    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(raw)]
    except (ValueError, KeyError):
        raise cursor.fail(f"tensor {name}", f"unknown tensor type {raw}") from None
    if dims[0] % block:
        raise cursor.fail(f"tensor {name}", f"{dims[0]} values a row is not a whole number of {block}-value blocks")
    elements = 1
    for dim in dims:
        elements *= dim
    return name, elements // block * type_size, cursor.u64(f"tensor {name}'s offset")


def _tensor_data(cursor: _Cursor, infos: list[tuple[str, int, int]], start: int, alignment: int) -> None:
    """Every tensor's bytes inside the file, aligned, named once; all of them together no more
    than the data holds (so no tensor is read twice through overlapping offsets)."""
    room = max(0, len(cursor.data) - start)
    names: set[str] = set()
    for name, size, offset in infos:
        if name in names:
            raise cursor.fail(f"tensor {name}", "a second tensor of that name")
        names.add(name)
        if offset % alignment or offset + size > room:
            raise cursor.fail(
                f"tensor {name}", f"{size} bytes at data offset {offset} do not fit the {room} aligned bytes there"
            )
    total = sum(size for _, size, _ in infos)
    if total > room:
        raise cursor.fail("tensors", f"{total} bytes of tensor data, and the file holds {room} after the header")
