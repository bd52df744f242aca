"""Taking a GGUF file apart and writing it back with one thing changed, for the bad-input tests.

Independent of llamir's reader: the file is split into raw key/value records, tensor infos and the
data blob by the layout of ggml's gguf.h, so a test can rewrite any one value's type or bytes,
duplicate records, move offsets or lie about counts, and `to_bytes` writes exactly that.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field, replace

U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
SCALAR_FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<b",
              U64: "<Q", I64: "<q", F64: "<d"}


@dataclass
class KV:
    """One key/value record: `raw` is the value's encoding after its type id."""

    key: bytes
    vtype: int
    raw: bytes

    @property
    def name(self) -> str:
        return self.key.decode("utf-8", "replace")


@dataclass
class TensorInfo:
    name: bytes
    ne: list[int]
    ggml_type: int
    offset: int


@dataclass
class Gguf:
    version: int
    kvs: list[KV]
    tensors: list[TensorInfo]
    blob: bytes                    # everything from the aligned start of the data section
    alignment: int = 32
    n_kv: int | None = None        # None: the true count; otherwise the count written
    n_tensors: int | None = None
    pad_byte: bytes = field(default=b"\0")

    def __repr__(self) -> str:   # short: hypothesis prints the arguments of a failing case
        return f"<Gguf v{self.version}: {len(self.kvs)} keys, {len(self.tensors)} tensors, {len(self.blob)} data bytes>"

    def kv(self, key: str) -> KV:
        return next(kv for kv in self.kvs if kv.key == key.encode())

    def set(self, key: str, vtype: int, raw: bytes) -> Gguf:
        """A copy with `key` re-typed to `vtype` holding the encoded `raw` (added when missing)."""
        out = self.copy()
        for i, kv in enumerate(out.kvs):
            if kv.key == key.encode():
                out.kvs[i] = KV(kv.key, vtype, raw)
                return out
        out.kvs.append(KV(key.encode(), vtype, raw))
        return out

    def drop(self, key: str) -> Gguf:
        out = self.copy()
        out.kvs = [kv for kv in out.kvs if kv.key != key.encode()]
        return out

    def copy(self) -> Gguf:
        return replace(self, kvs=list(self.kvs), tensors=[replace(t, ne=list(t.ne)) for t in self.tensors])

    def to_bytes(self) -> bytes:
        out = bytearray(b"GGUF")
        out += struct.pack("<I", self.version)
        out += struct.pack("<q", len(self.tensors) if self.n_tensors is None else self.n_tensors)
        out += struct.pack("<q", len(self.kvs) if self.n_kv is None else self.n_kv)
        for kv in self.kvs:
            out += string(kv.key) + struct.pack("<i", kv.vtype) + kv.raw
        for t in self.tensors:
            out += string(t.name) + struct.pack("<I", len(t.ne)) + b"".join(struct.pack("<q", n) for n in t.ne)
            out += struct.pack("<iQ", t.ggml_type, t.offset)
        if self.tensors:
            out += self.pad_byte * (-len(out) % self.alignment)
        return bytes(out) + self.blob


def string(s: bytes | str) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def scalar(vtype: int, value) -> bytes:
    return struct.pack(SCALAR_FMT[vtype], value)


def array(item_type: int, values) -> bytes:
    """The encoding of an ARRAY value (item type, count, items)."""
    body = b"".join(string(v) if item_type == STRING else scalar(item_type, v) for v in values)
    return struct.pack("<iQ", item_type, len(values)) + body


def parse(data: bytes) -> Gguf:
    """Split a well-formed GGUF file into records (raises on anything else: test input only)."""
    pos = 4
    version, n_tensors, n_kv = struct.unpack_from("<Iqq", data, pos)
    pos += 20
    kvs, alignment = [], 32
    for _ in range(n_kv):
        key, pos = _string(data, pos)
        (vtype,) = struct.unpack_from("<i", data, pos)
        pos += 4
        end = _skip_value(data, pos, vtype)
        kvs.append(KV(key, vtype, data[pos:end]))
        if key == b"general.alignment":
            (alignment,) = struct.unpack_from("<I", data, pos)
        pos = end
    tensors = []
    for _ in range(n_tensors):
        name, pos = _string(data, pos)
        (n_dims,) = struct.unpack_from("<I", data, pos)
        ne = list(struct.unpack_from(f"<{n_dims}q", data, pos + 4))
        pos += 4 + 8 * n_dims
        ggml_type, offset = struct.unpack_from("<iQ", data, pos)
        pos += 12
        tensors.append(TensorInfo(name, ne, ggml_type, offset))
    start = pos + (-pos % alignment) if tensors else pos
    return Gguf(version, kvs, tensors, data[start:], alignment)


def _string(data: bytes, pos: int) -> tuple[bytes, int]:
    (n,) = struct.unpack_from("<Q", data, pos)
    return data[pos + 8:pos + 8 + n], pos + 8 + n


def _skip_value(data: bytes, pos: int, vtype: int) -> int:
    if vtype == STRING:
        return _string(data, pos)[1]
    if vtype == ARRAY:
        item_type, count = struct.unpack_from("<iQ", data, pos)
        pos += 12
        if item_type == STRING:
            for _ in range(count):
                pos = _string(data, pos)[1]
            return pos
        return pos + struct.calcsize(SCALAR_FMT[item_type]) * count
    return pos + struct.calcsize(SCALAR_FMT[vtype])
