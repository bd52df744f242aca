"""The byte level of llama.cpp's state layout (little-endian): a writer, a bounds-checked reader
that names the field and the byte offset of every truncation, and StateError."""

from __future__ import annotations

import struct

import numpy as np


class StateError(ValueError):
    """A state blob or file that cannot be restored into this context (or a bad argument to a
    state call); nothing was changed."""


class Writer:
    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def pack(self, fmt: str, *values) -> None:
        self.parts.append(struct.pack("<" + fmt, *values))

    def string(self, s: str) -> None:
        data = s.encode()
        self.pack("I", len(data))
        self.parts.append(data)

    def raw(self, data) -> None:
        # tobytes, not a memoryview cast: the cast refuses arrays with a zero in their shape
        self.parts.append(np.ascontiguousarray(data).tobytes())

    def getvalue(self) -> bytes:
        return b"".join(self.parts)


class Reader:
    """Reads `data` from the front; `base` is the offset of data[0] in its file, so that errors
    give file offsets."""

    def __init__(self, data: bytes, base: int = 0):
        self.data, self.pos, self.base = memoryview(data), 0, base

    @property
    def offset(self) -> int:
        return self.base + self.pos

    @property
    def left(self) -> int:
        return len(self.data) - self.pos

    def unpack(self, fmt: str, what: str):
        size = struct.calcsize("<" + fmt)
        if size > self.left:
            raise StateError(f"truncated state: {what} needs {size} bytes at byte {self.offset}, {self.left} left")
        values = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += size
        return values[0] if len(values) == 1 else values

    def string(self, what: str) -> str:
        n = self.unpack("I", what + " length")
        return bytes(self.bytes(n, what)).decode("utf-8", errors="replace")

    def bytes(self, n: int, what: str) -> memoryview:
        if n < 0 or n > self.left:
            raise StateError(f"truncated state: {what} needs {n} bytes at byte {self.offset}, {self.left} left")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def expect_end(self, what: str) -> None:
        if self.left:
            raise StateError(f"{self.left} unexpected bytes after the {what}, from byte {self.offset}")
