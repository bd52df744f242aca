"""Reductions, scans and orderings over the last axis."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from llamir.ir.dtypes import F32, I32
from llamir.ir.ops.base import Op, register_op, require
from llamir.ir.types import TensorType


@register_op
@dataclass(frozen=True, slots=True)
class SumRows(Op):
    """y[..., 0] = sum(x, axis=-1)."""

    name: ClassVar[str] = "sum_rows"

    def infer(self, x: TensorType) -> TensorType:
        require(x.dtype.is_float, f"expects a float input, got {x.dtype}")
        return x.with_shape(x.shape[:-1] + (1,))


@register_op
@dataclass(frozen=True, slots=True)
class Mean(Op):
    """y[..., 0] = mean(x, axis=-1)."""

    name: ClassVar[str] = "mean"

    def infer(self, x: TensorType) -> TensorType:
        require(x.dtype.is_float, f"expects a float input, got {x.dtype}")
        return x.with_shape(x.shape[:-1] + (1,))


@register_op
@dataclass(frozen=True, slots=True)
class Sum(Op):
    """y[0] = sum of all elements of x."""

    name: ClassVar[str] = "sum"

    def infer(self, x: TensorType) -> TensorType:
        require(x.dtype.is_float, f"expects a float input, got {x.dtype}")
        return TensorType((1,), x.dtype)


INT32_MAX = 2**31 - 1


@register_op
@dataclass(frozen=True, slots=True)
class Argmax(Op):
    """y[r] = the i32 index of the largest x[r, i] (ggml_argmax), ggml's running maximum
    `m = m > x[i] ? m : x[i]; if m == x[i]: idx = i` from m = -inf, idx = 0: equal maxima give
    the last index; a NaN is never picked and restarts the maximum at the next element (so the
    answer is the last maximum of the last NaN-free run); an all-NaN row gives 0.
    x is a matrix [rows, n] or a vector [n] (one row: y is [1]), as ggml asserts."""

    name: ClassVar[str] = "argmax"

    def infer(self, x: TensorType) -> TensorType:
        require(x.dtype == F32, f"expects f32, got {x.dtype}")
        require(x.rank <= 2, f"expects a matrix [rows, n] or a vector [n] as ggml_argmax does, got {x}")
        n = x.shape[-1]
        require(not isinstance(n, int) or n <= INT32_MAX, f"rows of {n} values do not fit an i32 index")
        return TensorType(x.shape[:-1] if x.rank == 2 else (1,), I32)


@register_op
@dataclass(frozen=True, slots=True)
class Cumsum(Op):
    """y[..., i] = x[..., 0] + ... + x[..., i] (ggml_cumsum): y[..., 0] = x[..., 0], then
    y[..., i] = y[..., i - 1] + x[..., i] added in order in f32."""

    name: ClassVar[str] = "cumsum"

    def infer(self, x: TensorType) -> TensorType:
        require(x.dtype == F32, f"expects f32, got {x.dtype}")
        return x


@register_op
@dataclass(frozen=True, slots=True)
class Argsort(Op):
    """y = the i32 indices that sort each row of x (`descending` or ascending), stable."""

    name: ClassVar[str] = "argsort"
    descending: bool = False

    def infer(self, x: TensorType) -> TensorType:
        require(x.dtype == F32, f"expects f32, got {x.dtype}")
        return x.with_dtype(I32)


@register_op
@dataclass(frozen=True, slots=True)
class TopK(Op):
    """y = i32 indices of the k largest values of each row, largest first (ggml_argsort_top_k;
    llamir fixes the order so results are reproducible)."""

    name: ClassVar[str] = "top_k"
    k: int = 1

    def infer(self, x: TensorType) -> TensorType:
        require(x.dtype == F32, f"expects f32, got {x.dtype}")
        n = x.shape[-1]
        require(self.k >= 1 and (not isinstance(n, int) or self.k <= n), f"k={self.k} outside 1..{n}")
        return TensorType(x.shape[:-1] + (self.k,), I32)
