"""Opening a GGUF file: metadata as plain Python values, tensors as memory-mapped arrays.

The container is read directly (header, key/values, tensor infos, aligned data blob), with the
`gguf` package's type tables; it is an order of magnitude faster than gguf.GGUFReader on large
vocabularies, and every way a file can be broken gets an error that says where and what. The
tests check it against gguf.GGUFReader. Nothing is copied: tensors are views of one memmap.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from llamir.ir.dtypes import DType, dtype_from_ggml

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

_SCALARS = {  # GGUFValueType -> struct format
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}
_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
           10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY, _BOOL = 8, 9, 7


class GGUFError(ValueError):
    """A GGUF file that cannot be used, with the reason in the message."""


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


class _Cursor:
    """Little-endian reads over the mapped file, with errors that name the byte offset."""

    def __init__(self, data, path: Path):
        self.data, self.pos, self.path = data, 0, path

    def unpack(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.data, self.pos)
        except struct.error:
            raise GGUFError(f"{self.path}: truncated GGUF file: cannot read {fmt} at byte {self.pos}") from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.pos + n > len(self.data):
            raise GGUFError(f"{self.path}: string of {n} bytes at byte {self.pos} runs past the end of the file")
        s = self.data[self.pos:self.pos + n].decode("utf-8", errors="replace")
        self.pos += n
        return s

    def strings(self, count: int) -> list[str]:
        data, pos, out = self.data, self.pos, []
        for _ in range(count):
            if pos + 8 > len(data):
                raise GGUFError(f"{self.path}: string array runs past the end of the file")
            (n,) = struct.unpack_from("<Q", data, pos)
            out.append(data[pos + 8:pos + 8 + n].decode("utf-8", "replace"))
            pos += 8 + n
        if pos > len(data):
            raise GGUFError(f"{self.path}: string array runs past the end of the file")
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type, count = self.unpack("<I"), self.unpack("<Q")
            if item_type == _STRING:
                return self.strings(count)
            if item_type == _ARRAY:
                return [self.value(self.unpack("<I")) for _ in range(count)]
            if item_type not in _DTYPES:
                raise GGUFError(f"{self.path}: unknown GGUF array item type {item_type} at byte {self.pos}")
            dtype = np.dtype(_DTYPES[item_type])
            end = self.pos + dtype.itemsize * count
            if end > len(self.data):
                raise GGUFError(f"{self.path}: array of {count} items at byte {self.pos} runs past the end")
            arr = np.frombuffer(self.data[self.pos:end], dtype=dtype)
            self.pos = end
            return arr.astype(bool) if item_type == _BOOL else arr
        if vtype not in _SCALARS:
            raise GGUFError(f"{self.path}: unknown GGUF value type {vtype} at byte {self.pos}")
        value = self.unpack(_SCALARS[vtype])
        return bool(value) if vtype == _BOOL else value


class GGUFFile:
    """A parsed GGUF file: `metadata` (key -> value) and `tensors` (name -> GGUFTensor)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if f.seek(0, 2) else b""
        except OSError as err:
            raise GGUFError(f"cannot open {self.path}: {err.strerror or err}") from None
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, GGUFTensor] = {}
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
        self.version = cur.unpack("<I")
        if self.version not in (2, 3):
            raise GGUFError(f"{self.path}: GGUF version {self.version} is not supported (llama.cpp reads 2 and 3)")
        n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.unpack("<I")
            if not 1 <= n_dims <= 4:
                raise GGUFError(f"{self.path}: tensor {name!r} has {n_dims} dims (ggml allows 1 to 4)")
            ne = [cur.unpack("<q") for _ in range(n_dims)]
            ggml_type, offset = cur.unpack("<I"), cur.unpack("<Q")
            infos.append((name, ne, ggml_type, offset))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"{self.path}: general.alignment = {alignment} is not a power of two")
        start = -(-cur.pos // alignment) * alignment
        blob = np.memmap(self.path, dtype=np.uint8, mode="r") if infos else None
        for name, ne, ggml_type, offset in infos:
            self.tensors[name] = self._tensor(blob, start, name, ne, ggml_type, offset, alignment)

    def _tensor(self, blob, start, name, ne, ggml_type, offset, alignment) -> GGUFTensor:
        try:
            dtype = dtype_from_ggml(ggml_type)
        except ValueError as err:
            raise GGUFError(f"{self.path}: tensor {name!r}: {err}") from None
        if any(n <= 0 for n in ne):
            raise GGUFError(f"{self.path}: tensor {name!r} has a non-positive dim in ne = {ne}")
        if ne[0] % dtype.block_size:
            raise GGUFError(f"{self.path}: tensor {name!r}: ne[0] = {ne[0]} is not a multiple of the "
                            f"{dtype} block size {dtype.block_size}")
        if offset % alignment:
            raise GGUFError(f"{self.path}: tensor {name!r}: offset {offset} is not aligned to {alignment}")
        shape = tuple(reversed(ne))
        row = dtype.row_bytes(ne[0])
        n_bytes = row * int(np.prod(ne[1:], dtype=np.int64))
        begin = start + offset
        if begin + n_bytes > len(blob):
            raise GGUFError(f"{self.path}: tensor {name!r} needs bytes [{begin}, {begin + n_bytes}) but the file "
                            f"has {len(blob)}: the file is truncated")
        raw = blob[begin:begin + n_bytes]
        if dtype.is_quantized or dtype.name == "bf16":
            data = raw.reshape(shape[:-1] + (row,)) if dtype.is_quantized else raw.view(np.uint16).reshape(shape)
        else:
            data = raw.view(dtype.np_dtype).reshape(shape)
        return GGUFTensor(name, dtype, shape, data)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise GGUFError(f"{self.path}: required metadata key {key!r} is missing")
        return self.metadata[key]


def read_metadata(path: str | Path) -> dict[str, Any]:
    """Only the key/value metadata of a GGUF file."""
    return GGUFFile(path).metadata
