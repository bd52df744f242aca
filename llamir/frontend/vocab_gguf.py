"""A fast reader for the metadata of a GGUF file, for loading vocabularies.

`GGUFFile` builds one numpy part per array element, which takes seconds for a 256k-token vocab;
this reads the same key/value section directly (and nothing else) into the same value shapes:
str, int, float, bool, list[str] for string arrays, numpy arrays for numeric ones.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np

_SCALARS = {  # GGUFValueType -> struct format
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}
_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
           10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY, _BOOL = 8, 9, 7


class _Cursor:
    def __init__(self, data: mmap.mmap, path: Path):
        self.data, self.pos, self.path = data, 0, path

    def unpack(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.data, self.pos)
        except struct.error:
            raise ValueError(f"{self.path}: truncated GGUF metadata at byte {self.pos}") from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.pos + n > len(self.data):
            raise ValueError(f"{self.path}: string of {n} bytes at byte {self.pos} runs past the end")
        s = self.data[self.pos:self.pos + n].decode("utf-8", errors="replace")
        self.pos += n
        return s

    def strings(self, count: int) -> list[str]:
        data, pos, out = self.data, self.pos, []
        for _ in range(count):
            (n,) = struct.unpack_from("<Q", data, pos)
            out.append(data[pos + 8:pos + 8 + n].decode("utf-8", "replace"))
            pos += 8 + n
        if pos > len(data):
            raise ValueError(f"{self.path}: string array runs past the end of the file")
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
                raise ValueError(f"{self.path}: unknown GGUF array item type {item_type} at byte {self.pos}")
            dtype = np.dtype(_DTYPES[item_type])
            if self.pos + dtype.itemsize * count > len(self.data):
                raise ValueError(f"{self.path}: array of {count} items at byte {self.pos} runs past the end")
            arr = np.frombuffer(self.data[self.pos:self.pos + dtype.itemsize * count], dtype=dtype)
            self.pos += dtype.itemsize * count
            return arr.astype(bool) if item_type == _BOOL else arr
        if vtype not in _SCALARS:
            raise ValueError(f"{self.path}: unknown GGUF value type {vtype} at byte {self.pos}")
        return self.unpack(_SCALARS[vtype])


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The key/value metadata of a GGUF file (versions 2 and 3)."""
    path = Path(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != b"GGUF":
            raise ValueError(f"{path}: bad magic {data[:4]!r}; not a GGUF file")
        cur = _Cursor(data, path)
        cur.pos = 4
        version = cur.unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (llama.cpp reads 2 and 3)")
        cur.unpack("<Q")  # tensor count
        n_kv = cur.unpack("<Q")
        meta = {}
        for _ in range(n_kv):
            key = cur.string()
            meta[key] = cur.value(cur.unpack("<I"))
        return meta
