"""A GGUF file's metadata and tensor table, read in one pass over a memory map.

`gguf.GGUFReader` builds a numpy view for every part of every metadata value, so a 49k-token
vocabulary with its merges costs it seconds in every process that opens the file (4.5 s for
SmolLM2 on these machines). This reader walks the same layout with `struct` and decodes each
string once: the whole header of that file in ~0.1 s. Tensor data is not read here: each
tensor is a numpy view into the read-only map, as `GGUFReader` gives it (quantised types as
their raw bytes, float and integer types as their values).

The layout (GGUF v2 and v3, either byte order): magic `GGUF`, version u32, tensor count u64,
metadata count u64; each metadata entry a string key, a u32 value type and the value (arrays:
item type u32, count u64, items); each tensor a string name, u32 dims, u64 per dim (innermost
first), u32 ggml type, u64 offset from the data start; the data start is the end of that table
rounded up to `general.alignment` (32 by default). Strings are u64 length plus UTF-8 bytes.
Anything out of bounds or unknown is a `ValueError` naming where it was found.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32

_SCALARS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f", GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d", GGUFValueType.BOOL: "?",
}
# Tensor types whose data is read as values, not as raw blocks.
_VALUE_DTYPES: dict[GGMLQuantizationType, type[np.generic]] = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFField:
    """One metadata entry: its value as Python data (arrays as lists)."""

    key: str
    type: GGUFValueType
    value: Any
    item_type: GGUFValueType | None = None
    """The items' type of an array, else None."""

    @property
    def is_array(self) -> bool:
        return self.type == GGUFValueType.ARRAY


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    dims: tuple[int, ...]
    """As the file lists them: innermost first (ne0 = in_features of a matrix)."""
    data_offset: int
    n_bytes: int
    data: np.ndarray
    """A read-only view into the file: values for float / integer types, raw bytes (the
    blocks) for quantised ones."""

    @property
    def shape(self) -> tuple[int, ...]:
        """Outermost first, as torch and HF name it (rows = ne1, cols = ne0)."""
        return tuple(reversed(self.dims))


class GGUFFile:
    """`fields` (key -> GGUFField, in file order) and `tensors` (in file order) of one file,
    which stays mapped while the object lives."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as exc:  # an empty file cannot be mapped
                raise ValueError(f"{self.path}: not a GGUF file ({exc})") from None
        self.fields: dict[str, GGUFField] = {}
        self.tensors: list[GGUFTensor] = []
        _Parser(self._map, str(self.path)).parse_into(self)


class _Parser:
    def __init__(self, buf: mmap.mmap, where: str) -> None:
        self.buf, self.where, self.offset = buf, where, 0
        self.order = "<"

    def fail(self, what: str) -> ValueError:
        return ValueError(f"{self.where}: {what} (at byte {self.offset})")

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.offset + size > len(self.buf):
            raise self.fail("the file ends inside its header")
        (value,) = struct.unpack_from(self.order + fmt, self.buf, self.offset)
        self.offset += size
        return value

    def string(self) -> str:
        n = self.take("Q")
        end = self.offset + n
        if end > len(self.buf):
            raise self.fail(f"a string of {n} bytes runs past the end of the file")
        raw = self.buf[self.offset:end]
        self.offset = end
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"a string is not UTF-8 ({exc})") from None

    def value_type(self) -> GGUFValueType:
        raw = self.take("I")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise self.fail(f"unknown metadata value type {raw}") from None

    def value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.ARRAY:
            raise self.fail("an array holds arrays: not supported")
        return self.take(_SCALARS[kind])

    def array(self) -> tuple[GGUFValueType, list[Any]]:
        item = self.value_type()
        count = self.take("Q")
        if item == GGUFValueType.STRING:
            return item, [self.string() for _ in range(count)]
        if item == GGUFValueType.ARRAY:
            return item, [self.array()[1] for _ in range(count)]
        code = _SCALARS[item]
        size = struct.calcsize(code) * count
        if self.offset + size > len(self.buf):
            raise self.fail(f"an array of {count} items runs past the end of the file")
        values = list(struct.unpack_from(f"{self.order}{count}{code}", self.buf, self.offset))
        self.offset += size
        return item, values

    def parse_into(self, out: GGUFFile) -> None:
        if self.buf[:4] != _MAGIC:
            raise self.fail("not a GGUF file (no GGUF magic)")
        self.offset = 4
        version = self.take("I")
        if version not in _VERSIONS and version & 0xFFFF == 0:  # written big-endian
            self.order, self.offset = ">", 4
            version = self.take("I")
        if version not in _VERSIONS:
            raise self.fail(f"GGUF version {version} (this reader takes {_VERSIONS})")
        n_tensors, n_fields = self.take("Q"), self.take("Q")
        for _ in range(n_fields):
            key = self.string()
            kind = self.value_type()
            if key in out.fields:
                raise self.fail(f"metadata key {key!r} appears twice")
            if kind == GGUFValueType.ARRAY:
                item, values = self.array()
                out.fields[key] = GGUFField(key, kind, values, item)
            else:
                out.fields[key] = GGUFField(key, kind, self.value(kind))
        infos = [self.tensor_info() for _ in range(n_tensors)]
        align_field = out.fields.get("general.alignment")
        alignment = int(align_field.value) if align_field is not None else _DEFAULT_ALIGNMENT
        if alignment <= 0 or alignment & (alignment - 1):
            raise self.fail(f"general.alignment {alignment} is not a power of two")
        start = -(-self.offset // alignment) * alignment
        names: set[str] = set()
        for name, dims, kind, rel in infos:
            if name in names:
                raise self.fail(f"tensor {name!r} appears twice")
            names.add(name)
            out.tensors.append(self.tensor(name, dims, kind, start + rel))

    def tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self.string()
        n_dims = self.take("I")
        if n_dims > 8:
            raise self.fail(f"tensor {name!r} has {n_dims} dimensions")
        dims = tuple(self.take("Q") for _ in range(n_dims))
        raw = self.take("I")
        try:
            kind = GGMLQuantizationType(raw)
        except ValueError:
            raise self.fail(f"tensor {name!r} has unknown ggml type {raw}") from None
        return name, dims, kind, self.take("Q")

    def tensor(self, name: str, dims: tuple[int, ...], kind: GGMLQuantizationType,
               offset: int) -> GGUFTensor:
        block, type_size = GGML_QUANT_SIZES[kind]
        n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
        if n_elements % block:
            raise self.fail(f"tensor {name!r}: {n_elements} values are not whole "
                            f"{kind.name} blocks of {block}")
        n_bytes = n_elements // block * type_size
        if offset + n_bytes > len(self.buf):
            raise self.fail(f"tensor {name!r}'s data runs past the end of the file")
        shape = tuple(reversed(dims))
        dtype = _VALUE_DTYPES.get(kind)
        if dtype is None:
            dtype, shape = np.dtype(np.uint8), tuple(quant_shape_to_byte_shape(shape, kind))
        dtype = np.dtype(dtype).newbyteorder(self.order)
        data = np.ndarray(shape, dtype=dtype, buffer=self.buf, offset=offset)
        return GGUFTensor(name, kind, dims, offset, n_bytes, data)
