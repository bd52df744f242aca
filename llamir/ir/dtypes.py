"""Element types of the IR, the GGUF block-quantized types included.

Block and type sizes come from the `gguf` package (GGML_QUANT_SIZES), never retyped here.
A quantized tensor of shape [..., n] is stored as bytes [..., n // block_size * type_size].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# gguf lists Q8_1 with an old 40-byte layout (f32 d and s); ggml's block_q8_1 is two fp16 then 32 int8.
_TYPE_SIZE_FIXES = {GGMLQuantizationType.Q8_1: 36}


@dataclass(frozen=True, slots=True)
class DType:
    """One IR element type: a name, its ggml type id, and its block geometry."""

    name: str
    ggml_type: GGMLQuantizationType
    kind: str  # "float", "int" or "quant"

    @property
    def block_size(self) -> int:
        """Elements per block (1 for plain types)."""
        return GGML_QUANT_SIZES[self.ggml_type][0]

    @property
    def type_size(self) -> int:
        """Bytes per block (the element size for plain types)."""
        return _TYPE_SIZE_FIXES.get(self.ggml_type, GGML_QUANT_SIZES[self.ggml_type][1])

    @property
    def is_float(self) -> bool:
        return self.kind == "float"

    @property
    def is_int(self) -> bool:
        return self.kind == "int"

    @property
    def is_quantized(self) -> bool:
        return self.kind == "quant"

    @property
    def np_dtype(self) -> np.dtype:
        """The numpy dtype of one element; uint8 bytes for quantized and bf16 storage."""
        return _NP_DTYPES.get(self.name, np.dtype(np.uint8))

    def row_bytes(self, n: int) -> int:
        """Bytes taken by a contiguous row of `n` elements."""
        if n % self.block_size:
            raise ValueError(f"a {self.name} row of {n} elements is not a whole number of "
                             f"{self.block_size}-element blocks")
        return n // self.block_size * self.type_size

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return self.name.upper()


def _make(name: str, kind: str) -> DType:
    return DType(name, GGMLQuantizationType[name.upper()], kind)


F32 = _make("f32", "float")
F16 = _make("f16", "float")
BF16 = _make("bf16", "float")
I8 = _make("i8", "int")
I16 = _make("i16", "int")
I32 = _make("i32", "int")
I64 = _make("i64", "int")
Q4_0 = _make("q4_0", "quant")
Q4_1 = _make("q4_1", "quant")
Q5_0 = _make("q5_0", "quant")
Q5_1 = _make("q5_1", "quant")
Q8_0 = _make("q8_0", "quant")
Q8_1 = _make("q8_1", "quant")
Q2_K = _make("q2_k", "quant")
Q3_K = _make("q3_k", "quant")
Q4_K = _make("q4_k", "quant")
Q5_K = _make("q5_k", "quant")
Q6_K = _make("q6_k", "quant")
Q8_K = _make("q8_k", "quant")

ALL_DTYPES: tuple[DType, ...] = (
    F32, F16, BF16, I8, I16, I32, I64,
    Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K,
)
QUANT_DTYPES: tuple[DType, ...] = tuple(d for d in ALL_DTYPES if d.is_quantized)

_BY_NAME = {d.name: d for d in ALL_DTYPES}
_BY_GGML = {d.ggml_type: d for d in ALL_DTYPES}
_NP_DTYPES = {
    "f32": np.dtype(np.float32), "f16": np.dtype(np.float16),
    "i8": np.dtype(np.int8), "i16": np.dtype(np.int16),
    "i32": np.dtype(np.int32), "i64": np.dtype(np.int64),
}


def dtype_named(name: str) -> DType:
    """The dtype printed as `name` (e.g. "q4_k"); a clear error for an unknown name."""
    try:
        return _BY_NAME[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(_BY_NAME)}") from None


def dtype_from_ggml(ggml_type: int) -> DType:
    """The dtype of a ggml/GGUF type id; a clear error for types llamir cannot hold."""
    try:
        return _BY_GGML[GGMLQuantizationType(ggml_type)]
    except (KeyError, ValueError):
        try:
            label = GGMLQuantizationType(ggml_type).name
        except ValueError:
            label = "unknown"
        raise ValueError(f"ggml type {ggml_type} ({label}) is not supported by llamir") from None
