"""Views (no data movement) and layout-changing copies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from llamir.ir import dims
from llamir.ir.dims import Dim
from llamir.ir.dtypes import DType
from llamir.ir.ops.base import Op, register_op, require
from llamir.ir.types import TensorType


@register_op
@dataclass(frozen=True, slots=True)
class View(Op):
    """y = the elements of x's memory at byte `offset` with `shape` and byte `strides`
    (ggml_view_*: strides are ggml's nb[], outermost first; the last axis is contiguous)."""

    name: ClassVar[str] = "view"
    is_view: ClassVar[bool] = True
    shape: tuple[Dim, ...] = ()
    strides: tuple[Dim, ...] = ()
    offset: Dim = 0

    def infer(self, x: TensorType) -> TensorType:
        require(len(self.strides) == len(self.shape), f"{len(self.shape)} dims but {len(self.strides)} strides")
        out = TensorType(tuple(self.shape), x.dtype)
        require(self.strides[-1] == x.dtype.type_size,
                f"the last stride must be the element (or block) size {x.dtype.type_size}, "
                f"got {self.strides[-1]}")
        return out


@register_op
@dataclass(frozen=True, slots=True)
class Reshape(Op):
    """y = x with a new shape of the same element count (x must be contiguous)."""

    name: ClassVar[str] = "reshape"
    is_view: ClassVar[bool] = True
    shape: tuple[Dim, ...] = ()

    def infer(self, x: TensorType) -> TensorType:
        out = TensorType(tuple(self.shape), x.dtype)
        require(out.numel == x.numel, f"cannot reshape {x} to {out}")
        return out


@register_op
@dataclass(frozen=True, slots=True)
class Permute(Op):
    """y = numpy.transpose(x, axes): y.shape[i] = x.shape[axes[i]] (a strided view)."""

    name: ClassVar[str] = "permute"
    is_view: ClassVar[bool] = True
    axes: tuple[int, ...] = ()

    def infer(self, x: TensorType) -> TensorType:
        require(sorted(self.axes) == list(range(x.rank)), f"axes {self.axes} do not permute rank {x.rank}")
        require(self.axes[-1] == x.rank - 1 or not x.dtype.is_quantized, "cannot permute quantized rows")
        return x.with_shape(tuple(x.shape[a] for a in self.axes))


@register_op
@dataclass(frozen=True, slots=True)
class Transpose(Op):
    """y = x with its last two axes swapped (ggml_transpose: ne0 <-> ne1), a strided view."""

    name: ClassVar[str] = "transpose"
    is_view: ClassVar[bool] = True

    def infer(self, x: TensorType) -> TensorType:
        require(x.rank >= 2, f"expects rank >= 2, got {x}")
        require(not x.dtype.is_quantized, f"cannot transpose quantized {x}")
        return x.with_shape(x.shape[:-2] + (x.shape[-1], x.shape[-2]))


@register_op
@dataclass(frozen=True, slots=True)
class Cont(Op):
    """y = a contiguous copy of x (ggml_cont), optionally with a new shape of equal size."""

    name: ClassVar[str] = "cont"
    shape: tuple[Dim, ...] = ()

    def infer(self, x: TensorType) -> TensorType:
        if not self.shape:
            return x
        out = x.with_shape(tuple(self.shape))
        require(out.numel == x.numel, f"cannot cont {x} into {out}")
        return out


@register_op
@dataclass(frozen=True, slots=True)
class Cpy(Op):
    """y = x converted to `dtype` (ggml_cpy into a fresh tensor, i.e. ggml_cast); f32 -> f16 rounds
    to nearest even, float -> quantized uses ggml's reference quantizer."""

    name: ClassVar[str] = "cpy"
    dtype: DType | None = None

    def infer(self, x: TensorType) -> TensorType:
        require(self.dtype is not None, "cpy needs a target dtype")
        src, dst = x.dtype, self.dtype
        ok = src == dst or not (src.is_quantized and dst.is_int or src.is_int and dst.is_quantized)
        require(ok, f"cannot convert {src} to {dst}")
        if self.dtype.is_quantized:
            require(isinstance(x.shape[-1], int) and x.shape[-1] % self.dtype.block_size == 0,
                    f"{x} rows are not whole {self.dtype} blocks")
        return x.with_dtype(self.dtype)


@register_op
@dataclass(frozen=True, slots=True)
class Concat(Op):
    """y = numpy.concatenate([a, b], axis)."""

    name: ClassVar[str] = "concat"
    arity: ClassVar[int] = 2
    axis: int = 0

    def infer(self, a: TensorType, b: TensorType) -> TensorType:
        require(a.rank == b.rank and a.dtype == b.dtype, f"cannot concat {a} and {b}")
        axis = self.axis % a.rank
        for i, (da, db) in enumerate(zip(a.shape, b.shape)):
            require(i == axis or da == db, f"{a} and {b} differ off axis {axis}")
        out = list(a.shape)
        out[axis] = dims.add(a.shape[axis], b.shape[axis])
        return a.with_shape(tuple(out))


@register_op
@dataclass(frozen=True, slots=True)
class Repeat(Op):
    """y = x tiled to `shape` (each dim of x divides the target's; ggml_repeat)."""

    name: ClassVar[str] = "repeat"
    shape: tuple[Dim, ...] = ()

    def infer(self, x: TensorType) -> TensorType:
        out = x.with_shape(tuple(self.shape))
        require(x.rank <= out.rank and all(dims.broadcast_ok(s, b) for s, b in
                                          zip(reversed(x.shape), reversed(out.shape))),
                f"{x} does not tile {out}")
        return out
