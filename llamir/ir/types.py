"""TensorType: a shape (numpy order, outermost first) and an element type."""

from __future__ import annotations

from dataclasses import dataclass

from llamir.ir import dims
from llamir.ir.dims import Bindings, Dim
from llamir.ir.dtypes import DType, dtype_named

MAX_RANK = 4  # like ggml's GGML_MAX_DIMS


@dataclass(frozen=True, slots=True)
class TensorType:
    """shape[-1] is the contiguous axis (ggml's ne[0]); dims may be symbolic."""

    shape: tuple[Dim, ...]
    dtype: DType

    def __post_init__(self) -> None:
        if not 0 < len(self.shape) <= MAX_RANK:
            raise ValueError(f"rank {len(self.shape)} is outside 1..{MAX_RANK}: {self}")
        for d in self.shape:
            if isinstance(d, int) and d < 0:
                raise ValueError(f"negative dim in {self}")

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> Dim:
        return dims.prod(self.shape)

    @property
    def is_concrete(self) -> bool:
        return all(dims.is_concrete(d) for d in self.shape)

    @property
    def row_bytes(self) -> Dim:
        """Bytes of one contiguous row (the last axis)."""
        n = self.shape[-1]
        if isinstance(n, int):
            return self.dtype.row_bytes(n)
        if self.dtype.block_size != 1:
            raise ValueError(f"{self}: a quantized row must have a concrete length")
        return dims.mul(n, self.dtype.type_size)

    @property
    def nbytes(self) -> Dim:
        return dims.mul(dims.prod(self.shape[:-1]), self.row_bytes)

    def contiguous_strides(self) -> tuple[Dim, ...]:
        """Byte strides of the row-major layout (ggml's nb[], reversed)."""
        strides: list[Dim] = [self.dtype.type_size]  # ggml's nb[0]: one element, or one block
        acc: Dim = self.row_bytes
        for d in reversed(self.shape[:-1]):
            strides.append(acc)
            acc = dims.mul(acc, d)
        return tuple(reversed(strides))

    def with_shape(self, shape: tuple[Dim, ...]) -> TensorType:
        return TensorType(tuple(shape), self.dtype)

    def with_dtype(self, dtype: DType) -> TensorType:
        return TensorType(self.shape, dtype)

    def evaluate(self, bindings: Bindings) -> tuple[int, ...]:
        """The concrete shape under `bindings`."""
        return tuple(dims.evaluate(d, bindings) for d in self.shape)

    def substitute(self, bindings: Bindings) -> TensorType:
        return TensorType(tuple(dims.substitute(d, bindings) for d in self.shape), self.dtype)

    def __str__(self) -> str:
        return f"{self.dtype.name}[{','.join(map(str, self.shape))}]"


def parse_type(text: str) -> TensorType:
    """Inverse of str(TensorType): "f32[T,576]". ValueError for anything else."""
    text = text.strip()
    name, bracket, body = text.partition("[")
    if not bracket or not body.endswith("]") or "[" in body[:-1] or "]" in body[:-1]:
        raise ValueError(f"invalid tensor type {text[:60]!r}: expected DTYPE[DIM,...] such as f32[T,64]")
    parts = body[:-1].split(",")
    if len(parts) > MAX_RANK:
        raise ValueError(f"invalid tensor type {text[:60]!r}: more than {MAX_RANK} dims")
    return TensorType(tuple(dims.parse_dim(p) for p in parts), dtype_named(name.strip()))
