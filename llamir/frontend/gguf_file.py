"""Opening a GGUF file: typed metadata (gguf_meta.Metadata), tensors as memory-mapped arrays.

The container is read directly (header, key/values, tensor infos, aligned data blob) with the
rules of ggml's gguf.cpp (`gguf_init_from_file`) and llama-model-loader's checks on top of it, so a
file llama.cpp refuses is refused here too, with an error naming the key or tensor and the byte
offset: duplicate keys or tensor names, unknown value types, arrays of arrays, a `general.alignment`
that is not a u32 power of two, tensor data not packed in order (overlaps, gaps) or past the end of
the file. It is an order of magnitude faster than gguf.GGUFReader on large vocabularies; the tests
check it against gguf.GGUFReader. Nothing is copied: tensors are views of one memmap.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES

from llamir.frontend.gguf_meta import GGUFError, GGUFType, Metadata, MetadataError, ValueType
from llamir.ir.dtypes import DType, dtype_from_ggml

__all__ = ["DEFAULT_ALIGNMENT", "GGUFError", "GGUFFile", "GGUFTensor", "MetadataError", "read_metadata"]

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_STRING_LENGTH = 1 << 30     # GGUF_MAX_STRING_LENGTH
MAX_ARRAY_ELEMENTS = 1 << 30    # GGUF_MAX_ARRAY_ELEMENTS
MAX_NAME = 64                   # GGML_MAX_NAME, counting the NUL
MAX_DIMS = 4                    # GGML_MAX_DIMS
INT64_MAX = 2**63 - 1

_SCALARS = {GGUFType.UINT8: "<B", GGUFType.INT8: "<b", GGUFType.UINT16: "<H", GGUFType.INT16: "<h",
            GGUFType.UINT32: "<I", GGUFType.INT32: "<i", GGUFType.FLOAT32: "<f", GGUFType.BOOL: "<b",
            GGUFType.UINT64: "<Q", GGUFType.INT64: "<q", GGUFType.FLOAT64: "<d"}
_DTYPES = {GGUFType.UINT8: np.dtype("<u1"), GGUFType.INT8: np.dtype("<i1"), GGUFType.UINT16: np.dtype("<u2"),
           GGUFType.INT16: np.dtype("<i2"), GGUFType.UINT32: np.dtype("<u4"), GGUFType.INT32: np.dtype("<i4"),
           GGUFType.FLOAT32: np.dtype("<f4"), GGUFType.BOOL: np.dtype("<i1"), GGUFType.UINT64: np.dtype("<u8"),
           GGUFType.INT64: np.dtype("<i8"), GGUFType.FLOAT64: np.dtype("<f8")}


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor of the file: numpy-order shape, dtype, and its memory-mapped bytes/elements."""

    name: str
    dtype: DType
    shape: tuple[int, ...]  # numpy order: the reverse of ggml's ne[]
    data: np.ndarray        # memmap view; [..., row_bytes] uint8 for quantized types

    @property
    def n_bytes(self) -> int:
        return int(self.data.nbytes)


@dataclass(frozen=True, slots=True)
class _TensorInfo:
    name: str
    ne: tuple[int, ...]     # ggml order
    ggml_type: int
    offset: int             # into the data section
    n_bytes: int
    at: int                 # byte offset of the tensor info in the file


_U64 = struct.Struct("<Q").unpack_from


class _Cursor:
    """Little-endian reads over the mapped file, with errors that name what was read and where."""

    def __init__(self, data, path: Path):
        self.data, self.pos, self.path = data, 0, path

    def fail(self, message: str, at: int | None = None) -> GGUFError:
        return GGUFError(f"{self.path}: {message} (at byte {self.pos if at is None else at})")

    def unpack(self, fmt: str, what: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.data, self.pos)
        except struct.error:
            raise self.fail(f"truncated GGUF file: cannot read {what}") from None
        self.pos += struct.calcsize(fmt)
        return value

    def remaining(self) -> int:
        return len(self.data) - self.pos

    def raw_string(self, what: str) -> bytes:
        at = self.pos
        n = self.unpack("<Q", f"the length of {what}")
        if n > MAX_STRING_LENGTH:
            raise self.fail(f"{what}: string length {n} exceeds the maximum {MAX_STRING_LENGTH}", at)
        if n > self.remaining():
            raise self.fail(f"{what}: string of {n} bytes runs past the end of the file", at)
        raw = bytes(self.data[self.pos:self.pos + n])
        self.pos += n
        return raw

    def strings(self, count: int, what: str) -> list[str]:
        """`count` length-prefixed UTF-8 strings (a vocabulary: hundreds of thousands; the loop
        only slices, the decoding runs after it)."""
        data, pos, end = self.data, self.pos, len(self.data)
        raws: list[bytes] = []
        append = raws.append
        for i in range(count):
            if pos + 8 > end:
                raise self.fail(f"{what}: item {i} of {count} runs past the end of the file", pos)
            (n,) = _U64(data, pos)
            start = pos + 8
            pos = start + n
            if n > MAX_STRING_LENGTH or pos > end:
                raise self.fail(f"{what}: item {i} is a string of {n} bytes that runs past the end of the file",
                                start - 8)
            append(data[start:pos])
        self.pos = pos
        return [raw.decode("utf-8", "replace") for raw in raws]

    def value(self, key: str, type_id: int) -> tuple[Any, ValueType]:
        """One value of GGUF type `type_id` (gguf.cpp: scalars, strings, arrays of those)."""
        at = self.pos
        if type_id == GGUFType.ARRAY:
            item_id = self.unpack("<i", f"the item type of key {key!r}")
            count = self.unpack("<Q", f"the item count of key {key!r}")
            if item_id == GGUFType.ARRAY:
                raise self.fail(f"key {key!r} is an array of arrays, which gguf.cpp refuses "
                                "(invalid GGUF type 9 for array items)", at)
            if item_id not in _DTYPES and item_id != GGUFType.STRING:
                raise self.fail(f"key {key!r} has invalid GGUF type {item_id} for array items", at)
            item = GGUFType(item_id)
            if count > MAX_ARRAY_ELEMENTS:
                raise self.fail(f"key {key!r}: array of {count} items exceeds the maximum {MAX_ARRAY_ELEMENTS}", at)
            size = 8 if item == GGUFType.STRING else _DTYPES[item].itemsize
            if count * size > self.remaining():
                raise self.fail(f"key {key!r}: array of {count} {item.label} items runs past the end of the file", at)
            vtype = ValueType(GGUFType.ARRAY, item)
            if item == GGUFType.STRING:
                return self.strings(count, f"key {key!r}"), vtype
            end = self.pos + size * count
            arr = np.frombuffer(self.data[self.pos:end], dtype=_DTYPES[item])
            self.pos = end
            return (arr != 0 if item == GGUFType.BOOL else arr), vtype
        if type_id == GGUFType.STRING:
            return self.raw_string(f"key {key!r}").decode("utf-8", "replace"), ValueType(GGUFType.STRING)
        if type_id not in _SCALARS:
            raise self.fail(f"key {key!r} has invalid GGUF type {type_id}", at)
        vtype = ValueType(GGUFType(type_id))
        value = self.unpack(_SCALARS[vtype.type], f"the {vtype} value of key {key!r}")
        return (value != 0 if vtype.type == GGUFType.BOOL else value), vtype


class GGUFFile:
    """A parsed GGUF file: `metadata` (typed, key -> value) and `tensors` (name -> GGUFTensor)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if f.seek(0, 2) else b""
        except OSError as err:
            raise GGUFError(f"cannot open {self.path}: {err.strerror or err}") from None
        self.metadata = Metadata({}, source=str(self.path))
        self.tensors: dict[str, GGUFTensor] = {}
        self.alignment = DEFAULT_ALIGNMENT
        self.data_offset = 0
        try:
            self._parse(mapped)
        finally:
            if isinstance(mapped, mmap.mmap):
                mapped.close()

    def _parse(self, data) -> None:
        if len(data) < 8:
            raise GGUFError(f"{self.path}: file is too short to be GGUF ({len(data)} bytes)")
        if data[:4] != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: bad magic {bytes(data[:4])!r}, expected {GGUF_MAGIC!r}; not a GGUF file")
        cur = _Cursor(data, self.path)
        cur.pos = 4
        self.version = cur.unpack("<I", "the GGUF version")
        self._check_version(self.version)
        n_tensors = cur.unpack("<q", "the tensor count")
        n_kv = cur.unpack("<q", "the key/value count")
        if n_tensors < 0 or n_kv < 0:
            raise cur.fail(f"negative count in the header: {n_tensors} tensors, {n_kv} key/value pairs", 8)
        self.metadata = self._read_kvs(cur, n_kv)
        self.alignment = self._alignment()
        infos = self._read_tensor_infos(cur, n_tensors)
        if not infos:
            return
        self.data_offset = -(-cur.pos // self.alignment) * self.alignment
        if self.data_offset > len(data):
            raise cur.fail(f"the data section would start at byte {self.data_offset}, past the end of the file "
                           f"({len(data)} bytes)")
        self._check_offsets(infos)
        blob = np.memmap(self.path, dtype=np.uint8, mode="r")
        for info in infos:
            self.tensors[info.name] = self._tensor(blob, info)

    def _check_version(self, version: int) -> None:
        if version == 0 or version & 0xFFFF == 0:
            raise GGUFError(f"{self.path}: bad GGUF version {version} (a file of the other endianness?)")
        if version == 1:
            raise GGUFError(f"{self.path}: GGUF version 1 is no longer supported (llama.cpp reads 2 and 3)")
        if version > 3:
            raise GGUFError(f"{self.path}: GGUF version {version} is not supported (llama.cpp reads 2 and 3)")

    def _read_kvs(self, cur: _Cursor, n_kv: int) -> Metadata:
        values: dict[str, Any] = {}
        types: dict[str, ValueType] = {}
        seen: set[bytes] = set()
        for i in range(n_kv):
            at = cur.pos
            raw = cur.raw_string(f"key {i}")
            if not raw:
                raise cur.fail(f"key {i} is empty", at)
            if raw in seen:
                raise cur.fail(f"duplicate key {raw.decode('utf-8', 'replace')!r} (key/value pair {i})", at)
            seen.add(raw)
            key = raw.decode("utf-8", "replace")
            value, vtype = cur.value(key, cur.unpack("<i", f"the type of key {key!r}"))
            # gguf_find_key compares C strings and returns the first match: a NUL ends the name
            name = key.partition("\0")[0]
            if name not in values:
                values[name], types[name] = value, vtype
        return Metadata(values, types, str(self.path))

    def _alignment(self) -> int:
        key = "general.alignment"
        if key not in self.metadata:
            return DEFAULT_ALIGNMENT
        vtype, value = self.metadata.type_of(key), self.metadata[key]
        if vtype != ValueType(GGUFType.UINT32):
            raise MetadataError(f"{self.path}: metadata key {key!r} must be of type u32 but is {vtype} "
                                f"(value {value!r})")
        if value == 0 or value & (value - 1):
            raise MetadataError(f"{self.path}: {key} = {value} is not a power of 2")
        return value

    def _read_tensor_infos(self, cur: _Cursor, n_tensors: int) -> list[_TensorInfo]:
        infos: list[_TensorInfo] = []
        seen: set[bytes] = set()
        names: set[str] = set()
        for i in range(n_tensors):
            at = cur.pos
            raw = cur.raw_string(f"the name of tensor {i}")
            label = raw.decode("utf-8", "replace")
            if len(raw) >= MAX_NAME:
                raise cur.fail(f"tensor {i} name {label!r} is too long: {len(raw)} >= {MAX_NAME} bytes", at)
            if raw in seen:
                raise cur.fail(f"duplicate tensor name {label!r} (tensor {i})", at)
            seen.add(raw)
            # ggml keeps the name as a C string, and llama's loader refuses two equal ones
            name = label.partition("\0")[0]
            if name in names:
                raise cur.fail(f"tensor {i}: invalid model: tensor {name!r} is duplicated", at)
            names.add(name)
            infos.append(self._tensor_info(cur, name, at))
        return infos

    def _tensor_info(self, cur: _Cursor, name: str, at: int) -> _TensorInfo:
        n_dims = cur.unpack("<I", f"the dim count of tensor {name!r}")
        if n_dims > MAX_DIMS:
            raise cur.fail(f"tensor {name!r} has {n_dims} dims (ggml allows at most {MAX_DIMS})", at)
        ne = tuple(cur.unpack("<q", f"dim {j} of tensor {name!r}") for j in range(n_dims)) or (1,)
        if any(n < 0 for n in ne):
            raise cur.fail(f"tensor {name!r} has a negative dim in ne = {list(ne)}", at)
        n_elements = int(np.prod(ne, dtype=object))
        if n_elements > INT64_MAX:
            raise cur.fail(f"tensor {name!r}: ne = {list(ne)} has more than INT64_MAX elements", at)
        ggml_type = cur.unpack("<i", f"the type of tensor {name!r}")
        if ggml_type not in GGML_QUANT_SIZES:
            raise cur.fail(f"tensor {name!r} has invalid ggml type {ggml_type}", at)
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        if ne[0] % block:
            raise cur.fail(f"tensor {name!r}: ne[0] = {ne[0]} is not a multiple of the block size {block} of "
                           f"ggml type {ggml_type}", at)
        n_bytes = n_elements // block * type_size
        if n_bytes > 2**64 - 1:
            raise cur.fail(f"tensor {name!r}: ne = {list(ne)} is more than 2^64 bytes", at)
        offset = cur.unpack("<Q", f"the data offset of tensor {name!r}")
        return _TensorInfo(name, ne, ggml_type, offset, n_bytes, at)

    def _check_offsets(self, infos: list[_TensorInfo]) -> None:
        """gguf.cpp: each tensor's data follows the previous one's, padded to the alignment (no overlap,
        no gap, in order); llama's loader: and it lies within the file."""
        expected, previous = 0, None
        for info in infos:
            if info.offset != expected:
                if previous is None or info.offset > expected:
                    how = f"leaving {info.offset - expected} bytes unused before it"
                else:
                    how = (f"overlapping the data of tensor {previous.name!r} (bytes [{previous.offset}, "
                           f"{previous.offset + previous.n_bytes}) of the data section)")
                raise GGUFError(f"{self.path}: tensor {info.name!r} (info at byte {info.at}) has data offset "
                                f"{info.offset}, expected {expected}: {how}; GGUF tensor data must be packed in "
                                f"order, each tensor padded to the alignment {self.alignment}")
            expected += -(-info.n_bytes // self.alignment) * self.alignment
            previous = info
        file_size = self.path.stat().st_size
        for info in infos:
            begin = self.data_offset + info.offset
            if begin + info.n_bytes > file_size:
                raise GGUFError(f"{self.path}: tensor {info.name!r} data is not within the file bounds: it needs "
                                f"bytes [{begin}, {begin + info.n_bytes}) but the file has {file_size}: the file "
                                "is truncated or corrupted")

    def _tensor(self, blob: np.ndarray, info: _TensorInfo) -> GGUFTensor:
        try:
            dtype = dtype_from_ggml(info.ggml_type)
        except ValueError as err:
            raise GGUFError(f"{self.path}: tensor {info.name!r}: {err}") from None
        shape = tuple(reversed(info.ne))
        begin = self.data_offset + info.offset
        raw = blob[begin:begin + info.n_bytes]
        if dtype.is_quantized:
            data = raw.reshape(shape[:-1] + (dtype.row_bytes(info.ne[0]),))
        elif dtype.name == "bf16":
            data = raw.view(np.uint16).reshape(shape)
        else:
            data = raw.view(dtype.np_dtype).reshape(shape)
        return GGUFTensor(info.name, dtype, shape, data)

    def get(self, key: str, default: Any = None) -> Any:
        """The raw value of `key` (no type check: use metadata.get_u32 and friends for that)."""
        return self.metadata.get(key, default)


def read_metadata(path: str | Path) -> Metadata:
    """Only the key/value metadata of a GGUF file."""
    return GGUFFile(path).metadata
