"""Opening a GGUF file: metadata as plain Python values, tensors as memory-mapped arrays.

The `gguf` package does the parsing; this module turns its failures into errors that say
what was wrong with the file, and never copies tensor data (everything stays memory-mapped).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType

from llamir.ir.dtypes import DType, dtype_from_ggml

GGUF_MAGIC = b"GGUF"


class GGUFError(ValueError):
    """A GGUF file that cannot be used, with the reason in the message."""


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor of the file: numpy-order shape, dtype, and its memory-mapped bytes/elements."""

    name: str
    dtype: DType
    shape: tuple[int, ...]  # numpy order: the reverse of ggml's ne[]
    data: np.ndarray        # memmap; [..., row_bytes] uint8 for quantized types

    @property
    def n_bytes(self) -> int:
        return int(self.data.nbytes)


class GGUFFile:
    """A parsed GGUF file: `metadata` (key -> value) and `tensors` (name -> GGUFTensor)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        _check_header(self.path)
        try:
            reader = GGUFReader(self.path, "r")
        except (ValueError, IndexError, KeyError, OSError, OverflowError, TypeError) as err:
            raise GGUFError(f"{self.path}: malformed GGUF file ({type(err).__name__}: {err})") from None
        self.version = int(reader.fields["GGUF.version"].parts[-1][0])
        self.metadata: dict[str, Any] = {
            key: _field_value(field) for key, field in reader.fields.items() if not key.startswith("GGUF.")
        }
        self.tensors: dict[str, GGUFTensor] = {}
        for t in reader.tensors:
            try:
                dtype = dtype_from_ggml(int(t.tensor_type))
            except ValueError as err:
                raise GGUFError(f"{self.path}: tensor {t.name!r}: {err}") from None
            shape = tuple(int(n) for n in reversed(t.shape.tolist()))
            self.tensors[t.name] = GGUFTensor(t.name, dtype, shape, t.data)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise GGUFError(f"{self.path}: required metadata key {key!r} is missing")
        return self.metadata[key]


def _check_header(path: Path) -> None:
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as err:
        raise GGUFError(f"cannot open {path}: {err.strerror or err}") from None
    if len(head) < 8:
        raise GGUFError(f"{path}: file is too short to be GGUF ({len(head)} bytes)")
    if head[:4] != GGUF_MAGIC:
        raise GGUFError(f"{path}: bad magic {head[:4]!r}, expected {GGUF_MAGIC!r}; not a GGUF file")
    version = int.from_bytes(head[4:8], "little")
    if version not in (2, 3):
        raise GGUFError(f"{path}: GGUF version {version} is not supported (llama.cpp reads 2 and 3)")


def _scalar(field, part_index: int) -> Any:
    raw = field.parts[part_index]
    return raw.tobytes().decode("utf-8", errors="replace") if raw.dtype == np.uint8 else raw[0].item()


def _field_value(field) -> Any:
    """A reader field as Python: str, int, float, bool, or a list/numpy array for arrays."""
    types = field.types
    if not types:
        return None
    if types[0] == GGUFValueType.ARRAY:
        item_type = types[1] if len(types) > 1 else None
        if item_type == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        if item_type == GGUFValueType.ARRAY:
            return [field.parts[i] for i in field.data]
        values = [field.parts[i][0] for i in field.data]
        arr = np.array(values) if values else np.zeros(0)
        return arr.astype(bool) if item_type == GGUFValueType.BOOL else arr
    if types[0] == GGUFValueType.STRING:
        return bytes(field.parts[-1]).decode("utf-8", errors="replace")
    value = field.parts[-1][0].item()
    return bool(value) if types[0] == GGUFValueType.BOOL else value
