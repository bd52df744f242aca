"""Reductions and orderings over the last axis."""

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
