"""A GGUF file mapped in place and checked as hostile input.

The format (versions 2 and 3, little-endian): the magic, the version, the tensor count and the key-value
count; the key-value pairs (a string key, a value type, the value; an array is an element type, a length
and the elements); the tensor infos (name, dimension count, dimensions with the row length first, ggml
type, offset in the data section); then, aligned to `general.alignment` (default 32), the data section.

Nothing read from the file is trusted. Every count and length is checked against the bytes that are
there before anything is read, skipped or allocated by it (an array of 2**60 elements in a file of a
few megabytes is refused at its header, not iterated); every tensor must be of a ggml type, have a row
length that is a whole number of its type's blocks, dimensions whose product fits in 63 bits, and lie
inside the data section at an aligned offset without overlapping another. Every failure is one
ModelLoadError naming the file, and the key or tensor where there is one.

The file is mapped copy-on-write (private): tensors are numpy views into the mapping, so loading copies
nothing; a write into one (kvserve makes none) would land in a page of the process's own, never in the
file, and never fault.
"""

import functools
import itertools
import math
import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvserve.errors import ModelLoadError
from kvserve.model.ggml_types import DEQUANTIZED, GEOMETRY

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# ggml's GGML_MAX_DIMS.
MAX_DIMS = 4
# ggml counts elements in int64.
MAX_ELEMENTS = 2**63 - 1
# ggml type ids read as float32 values as they are.
F32 = 0

# GGUF value types: the scalars' struct formats, then the string and the array.
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
STRING = 8
ARRAY = 9
UINT32 = 4
# The least bytes one entry takes: a key-value pair (an empty key, a type, a one-byte value) and a
# tensor info (an empty name, a dimension count of 0, a type and an offset).
_MIN_FIELD_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8

_CUT = ": the file is truncated or corrupt"
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class _Bad(Exception):
    """What is wrong with the file (the ModelLoadError's reason)."""


@dataclass(frozen=True)
class Field:
    """One key-value pair: its value type (for an array, ARRAY and the elements' `item_type`), the element
    count (1 for a scalar), where the value starts (an array's first element) and the whole entry's bytes
    [start, end), key included."""

    key: str
    type: int
    item_type: int
    count: int
    value_at: int
    start: int
    end: int


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: its ggml type, its dimensions as ggml orders them (the row length first), where its
    bytes lie in the file (an absolute offset) and how many there are."""

    name: str
    qtype: int
    dims: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The dimensions as numpy and torch order them (rows first, the row length last)."""
        return tuple(reversed(self.dims))

    @property
    def row_bytes(self) -> int:
        return self.nbytes // (self.elements // self.dims[0])

    @property
    def elements(self) -> int:
        return math.prod(self.dims)


def type_name(qtype: int) -> str:
    from gguf.constants import GGMLQuantizationType

    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return f"type code {qtype}"


def block_geometry(qtype: int) -> tuple[int, int] | None:
    """(elements per block, bytes per block) of a ggml type; None for a code that names no ggml type."""
    if qtype in GEOMETRY:
        return GEOMETRY[qtype]
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    except (ValueError, KeyError):
        return None


@functools.cache
def dequantizable(qtype: int) -> bool:
    """Whether the gguf package dequantizes this ggml type to float (the fallback path for the types
    the native kernels do not read): probed on one block of zeros, for a type the table does not know."""
    if qtype in GEOMETRY:
        return qtype in DEQUANTIZED
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    geometry = block_geometry(qtype)
    if geometry is None:
        return False
    try:
        dequantize(np.zeros(geometry[1], dtype=np.uint8), GGMLQuantizationType(qtype))
    except (NotImplementedError, ValueError, TypeError):
        return False
    return True


def dequantize(data: np.ndarray, qtype: int) -> np.ndarray:
    """float32 values of `data` (rows of blocks of `qtype`, uint8 [..., row bytes]), through the gguf
    package's dequantizer; [..., row length]."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    return np.asarray(gguf_dequantize(data, GGMLQuantizationType(qtype)), dtype=np.float32)


class _Cursor:
    """Reads the header and metadata front to back; every read is checked against the file's size."""

    def __init__(self, buf: mmap.mmap, size: int) -> None:
        self.buf = buf
        self.size = size
        self.pos = 0

    def take(self, n: int, what: str) -> int:
        """Skip `n` bytes; returns where they start."""
        at = self.pos
        if n > self.size - at:
            raise _Bad(
                f"{what} at byte {at} ({n} bytes) runs past the end of the file ({self.size} bytes){_CUT}"
            )
        self.pos = at + n
        return at

    def u32(self, what: str) -> int:
        value: int = _U32.unpack_from(self.buf, self.take(4, what))[0]
        return value

    def u64(self, what: str) -> int:
        value: int = _U64.unpack_from(self.buf, self.take(8, what))[0]
        return value

    def string(self, what: str) -> str:
        n = self.u64(f"the length of {what}")
        at = self.take(n, what)
        try:
            return self.buf[at : at + n].decode("utf-8")
        except UnicodeDecodeError:
            raise _Bad(f"{what} at byte {at} is not UTF-8") from None

    def skip_strings(self, count: int, what: str) -> None:
        """Skip `count` strings (the caller checked that their lengths fit: count * 8 <= what is left)."""
        buf, size, pos = self.buf, self.size, self.pos
        unpack = _U64.unpack_from
        for i in range(count):
            if pos + 8 > size:
                raise _Bad(f"{what}: string {i} at byte {pos} runs past the end of the file{_CUT}")
            pos += 8 + unpack(buf, pos)[0]
            if pos > size:
                raise _Bad(f"{what}: string {i} runs past the end of the file ({size} bytes){_CUT}")
        self.pos = pos


class GgufFile:
    """A GGUF file's metadata and tensors, its bytes mapped in place (build it with `open_gguf`)."""

    def __init__(
        self,
        path: str,
        buf: mmap.mmap,
        fields: dict[str, Field],
        tensors: dict[str, TensorInfo],
        alignment: int,
    ) -> None:
        self.path = path
        self._buf = buf
        self.fields = fields
        self.tensors = tensors
        self.alignment = alignment

    def value(self, key: str) -> Any:
        """The value of `key` as Python values (an array as a list); None where the file lacks it."""
        f = self.fields.get(key)
        if f is None:
            return None
        try:
            if f.type == STRING:
                return _string_at(self._buf, f.value_at)[0]
            if f.type != ARRAY:
                return struct.unpack_from(_SCALARS[f.type], self._buf, f.value_at)[0]
            if f.item_type == STRING:
                return list(self._strings(f))
            dtype = np.dtype(_SCALARS[f.item_type].replace("?", "u1"))
            values = np.frombuffer(self._buf, dtype=dtype, count=f.count, offset=f.value_at)
            return (values != 0).tolist() if f.item_type == 7 else values.tolist()
        except UnicodeDecodeError:
            raise ModelLoadError(self.path, f"the metadata {key} is not UTF-8") from None

    def _strings(self, f: Field) -> Iterator[str]:
        pos = f.value_at
        for _ in range(f.count):
            s, pos = _string_at(self._buf, pos)
            yield s

    def raw(self, f: Field) -> bytes:
        """The entry's bytes as the file holds them (key, type and value)."""
        return self._buf[f.start : f.end]

    def array(self, t: TensorInfo) -> np.ndarray:
        """A view of the tensor's bytes in the mapping: float32 values in `t.shape` for F32, otherwise
        uint8 rows of blocks [*t.shape[:-1], t.row_bytes]."""
        if t.qtype == F32:
            return np.frombuffer(self._buf, dtype="<f4", count=t.elements, offset=t.offset).reshape(t.shape)
        data = np.frombuffer(self._buf, dtype=np.uint8, count=t.nbytes, offset=t.offset)
        return data.reshape(*t.shape[:-1], t.row_bytes)

    def block_field(self, t: TensorInfo, at: int, dtype: str) -> np.ndarray:
        """A strided view of one field of every block of `t`: the `dtype` value `at` bytes into each."""
        geometry = block_geometry(t.qtype)
        assert geometry is not None
        blocks = t.nbytes // geometry[1]
        return np.ndarray(
            (blocks,), dtype=dtype, buffer=self._buf, offset=t.offset + at, strides=(geometry[1],)
        )

    def floats(self, t: TensorInfo) -> np.ndarray:
        """The tensor's values as float32 in `t.shape`: a view for F32, dequantized otherwise."""
        if t.qtype == F32:
            return self.array(t)
        if not dequantizable(t.qtype):
            raise ModelLoadError(
                self.path, f"tensor {t.name} is of {type_name(t.qtype)}, which kvserve cannot read"
            )
        return dequantize(self.array(t), t.qtype).reshape(t.shape)

    def drop_resident_pages(self) -> None:
        """Let go of the mapping's resident pages (clean file pages: a later read maps them again from
        the page cache)."""
        self._buf.madvise(mmap.MADV_DONTNEED)


def _string_at(buf: mmap.mmap, at: int) -> tuple[str, int]:
    """The string at `at` (its bounds checked when the file was opened) and where the next one starts."""
    n: int = _U64.unpack_from(buf, at)[0]
    return buf[at + 8 : at + 8 + n].decode("utf-8"), at + 8 + n


def open_gguf(path: str) -> GgufFile:
    """Map and check the GGUF file at `path`; raises ModelLoadError naming it and what is wrong."""
    if not os.path.isfile(path):
        raise ModelLoadError(path, "not a regular file")
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise ModelLoadError(path, f"not a GGUF file: {size} bytes, shorter than a GGUF header")
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except OSError as e:
        raise ModelLoadError(path, f"cannot read the file ({e})") from None
    try:
        fields, tensors, alignment = _parse(buf, size)
    except _Bad as e:
        raise ModelLoadError(path, str(e)) from None
    return GgufFile(path, buf, fields, tensors, alignment)


def _parse(buf: mmap.mmap, size: int) -> tuple[dict[str, Field], dict[str, TensorInfo], int]:
    c = _Cursor(buf, size)
    if buf[:4] != MAGIC:
        raise _Bad("not a GGUF file (no GGUF magic)")
    c.pos = 4
    version = c.u32("the version")
    if version not in VERSIONS:
        if int.from_bytes(version.to_bytes(4, "little"), "big") in VERSIONS:
            raise _Bad("a big-endian GGUF file, which kvserve does not read")
        raise _Bad(f"GGUF version {version}, not one kvserve reads ({', '.join(map(str, VERSIONS))})")
    n_tensors = c.u64("the tensor count")
    n_fields = c.u64("the metadata count")
    left = size - c.pos
    if n_fields > left // _MIN_FIELD_BYTES:
        raise _Bad(
            f"the header claims {n_fields} metadata entries, more than the file's {size} bytes hold{_CUT}"
        )
    if n_tensors > left // _MIN_TENSOR_INFO_BYTES:
        raise _Bad(f"the header claims {n_tensors} tensors, more than the file's {size} bytes hold{_CUT}")
    fields: dict[str, Field] = {}
    for i in range(n_fields):
        f = _field(c, i)
        if f.key in fields:
            raise _Bad(f"the metadata key {f.key} appears twice")
        fields[f.key] = f
    alignment = DEFAULT_ALIGNMENT
    if "general.alignment" in fields:
        f = fields["general.alignment"]
        if f.type != UINT32:
            raise _Bad("general.alignment must be a uint32")
        alignment = _U32.unpack_from(buf, f.value_at)[0]
        if alignment == 0 or alignment & (alignment - 1):
            raise _Bad(f"general.alignment {alignment} is not a power of two")
    infos = [_tensor_info(c, i) for i in range(n_tensors)]
    data_start = -(-c.pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, qtype, dims, offset in infos:
        if name in tensors:
            raise _Bad(f"tensor {name} appears twice")
        tensors[name] = _place(name, qtype, dims, offset, data_start, alignment, size)
    by_start = sorted(tensors.values(), key=lambda t: (t.offset, t.nbytes))
    for a, b in itertools.pairwise(by_start):
        if b.offset < a.offset + a.nbytes:
            raise _Bad(f"tensors {a.name} and {b.name} overlap (bytes {b.offset} to {a.offset + a.nbytes})")
    return fields, tensors, alignment


def _field(c: _Cursor, i: int) -> Field:
    start = c.pos
    key = c.string(f"metadata key {i}")
    kind = c.u32(f"the value type of {key}")
    item, count = kind, 1
    if kind == ARRAY:
        item = c.u32(f"the element type of {key}")
        count = c.u64(f"the length of {key}")
        if item == ARRAY:
            raise _Bad(f"the metadata {key} is an array of arrays, which kvserve does not read")
    at = c.pos
    left = c.size - at
    if item == STRING:
        if count > left // 8:
            raise _Bad(
                f"the metadata {key} claims {count} strings, more than the file's {c.size} bytes hold{_CUT}"
            )
        if kind == ARRAY:
            c.skip_strings(count, f"the metadata {key}")
        else:
            c.take(c.u64(f"the length of {key}"), f"the metadata {key}")
    elif item in _SCALARS:
        itemsize = struct.calcsize(_SCALARS[item])
        if count > left // itemsize:
            raise _Bad(
                f"the metadata {key} claims {count} values of {itemsize} bytes, more than the file's "
                f"{c.size} bytes hold{_CUT}"
            )
        c.take(count * itemsize, f"the metadata {key}")
    else:
        raise _Bad(f"the metadata {key} has value type {item}, not a GGUF type")
    return Field(key, kind, item, count, at, start, c.pos)


def _tensor_info(c: _Cursor, i: int) -> tuple[str, int, tuple[int, ...], int]:
    name = c.string(f"the name of tensor {i}")
    n_dims = c.u32(f"the dimension count of tensor {name}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise _Bad(f"tensor {name} has {n_dims} dimensions (1 to {MAX_DIMS} are possible)")
    dims = tuple(c.u64(f"the dimensions of tensor {name}") for _ in range(n_dims))
    qtype = c.u32(f"the type of tensor {name}")
    offset = c.u64(f"the offset of tensor {name}")
    return name, qtype, dims, offset


def _place(
    name: str, qtype: int, dims: tuple[int, ...], offset: int, data_start: int, alignment: int, size: int
) -> TensorInfo:
    """The tensor's info once its type, dimensions and bytes are checked against the file."""
    geometry = block_geometry(qtype)
    if geometry is None:
        raise _Bad(f"tensor {name} has type code {qtype}, which names no ggml type")
    block, block_bytes = geometry
    if 0 in dims:
        raise _Bad(f"tensor {name} has a dimension of 0 ({list(dims)})")
    elements = math.prod(dims)
    if elements > MAX_ELEMENTS:
        raise _Bad(f"tensor {name}'s dimensions {list(dims)} overflow: {elements} elements")
    if dims[0] % block:
        raise _Bad(
            f"tensor {name}'s rows of {dims[0]} elements are not whole blocks of {type_name(qtype)} "
            f"({block} elements each)"
        )
    if offset % alignment:
        raise _Bad(f"tensor {name}'s data at offset {offset} is not aligned to {alignment} bytes")
    nbytes = elements // block * block_bytes
    start = data_start + offset
    if start + nbytes > size:
        raise _Bad(
            f"tensor {name}'s {nbytes} bytes at byte {start} run past the end of the file ({size} bytes)"
            + _CUT
        )
    return TensorInfo(name, qtype, dims, start, nbytes)
