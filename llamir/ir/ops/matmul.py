"""Matrix products and row gathers/scatters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from llamir.ir import dims
from llamir.ir.dtypes import F32, I32, I64
from llamir.ir.ops.base import Op, register_op, require
from llamir.ir.types import TensorType


def _pad_left(shape: tuple, rank: int) -> tuple:
    return (1,) * (rank - len(shape)) + tuple(shape)


@register_op
@dataclass(frozen=True, slots=True)
class MulMat(Op):
    """y[..., n, m] = sum_k a[..., m, k] * b[..., n, k]   (y = b @ a.T; ggml_mul_mat(a, b)).

    a's batch axes repeat into b's: a[i // (B_b / B_a)] serves b[i] (this is how GQA heads
    share a KV head). y is f32. As in ggml's CPU backend, b is first rounded to a's
    vec_dot_type (f16 for f16 a, q8_0/q8_1/q8_K for quantized a), see ir/quants.py.
    """

    name: ClassVar[str] = "mul_mat"
    arity: ClassVar[int] = 2

    def infer(self, a: TensorType, b: TensorType) -> TensorType:
        require(a.rank >= 2 and b.rank >= 2, f"expects rank >= 2 operands, got {a} and {b}")
        require(a.shape[-1] == b.shape[-1], f"inner dims differ: {a} x {b}")
        require(b.dtype.is_float and not b.dtype.is_quantized, f"b must be float, got {b.dtype}")
        require(not a.dtype.is_int, f"a must be float or quantized, got {a.dtype}")
        rank = max(a.rank, b.rank)
        batch_a = _pad_left(a.shape[:-2], rank - 2)
        batch_b = _pad_left(b.shape[:-2], rank - 2)
        for da, db in zip(batch_a, batch_b):
            require(dims.divides(da, db), f"a's batch {a} does not repeat into b's batch {b}")
        return TensorType(batch_b + (b.shape[-2], a.shape[-2]), F32)


@register_op
@dataclass(frozen=True, slots=True)
class MulMatId(Op):
    """Expert matmul: as [E, M, K], b [T, n_b, K], ids i32 [T, k] ->
    y[t, i] = as[ids[t, i]] @ b[t, i % n_b]   (y [T, k, M], f32; n_b is 1 or k)."""

    name: ClassVar[str] = "mul_mat_id"
    arity: ClassVar[int] = 3

    def infer(self, w: TensorType, b: TensorType, ids: TensorType) -> TensorType:
        require(w.rank == 3 and b.rank == 3 and ids.rank == 2, f"expects [E,M,K], [T,n_b,K], [T,k]; "
                f"got {w}, {b}, {ids}")
        require(ids.dtype == I32, f"ids must be i32, got {ids.dtype}")
        require(w.shape[-1] == b.shape[-1], f"inner dims differ: {w} x {b}")
        require(b.shape[0] == ids.shape[0], f"b {b} and ids {ids} disagree on T")
        require(b.shape[1] == 1 or b.shape[1] == ids.shape[1], f"b's axis 1 must be 1 or k: {b}, {ids}")
        return TensorType((ids.shape[0], ids.shape[1], w.shape[1]), F32)


@register_op
@dataclass(frozen=True, slots=True)
class GetRows(Op):
    """y[..., i, :] = a[..., idx[..., i], :]  (rows gathered, dequantized to f32; i32 stays i32).

    a [B3, B2, R, C] with idx [B3, B2, N]: each batch picks from its own rows.
    """

    name: ClassVar[str] = "get_rows"
    arity: ClassVar[int] = 2

    def infer(self, a: TensorType, idx: TensorType) -> TensorType:
        require(idx.dtype == I32, f"indices must be i32, got {idx.dtype}")
        require(a.rank >= 2, f"data must have rank >= 2, got {a}")
        require(idx.rank == a.rank - 1, f"indices {idx} must have rank {a.rank - 1} for data {a}")
        require(idx.shape[:-1] == a.shape[:-2], f"batch axes of data {a} and indices {idx} differ")
        dtype = I32 if a.dtype == I32 else F32
        return TensorType(idx.shape + (a.shape[-1],), dtype)


@register_op
@dataclass(frozen=True, slots=True)
class SetRows(Op):
    """dst[..., idx[..., i], :] = convert(src[..., i, :]) in place; returns (a view of) dst.

    dst [B3, B2, R, C], src [B3, B2, N, C], idx [B2', N] with B2 % B2' == 0. The write is a
    side effect on dst's memory, which is how KV caches are filled.
    """

    name: ClassVar[str] = "set_rows"
    arity: ClassVar[int] = 3
    has_side_effects: ClassVar[bool] = True

    def infer(self, dst: TensorType, src: TensorType, idx: TensorType) -> TensorType:
        require(idx.dtype in (I32, I64), f"indices must be i32 or i64, got {idx.dtype}")
        require(src.dtype.is_float and not src.dtype.is_quantized, f"src must be float, got {src.dtype}")
        require(dst.rank >= 2 and src.rank == dst.rank, f"src {src} and dst {dst} ranks differ")
        require(src.shape[-1] == dst.shape[-1], f"row lengths differ: src {src}, dst {dst}")
        require(src.shape[:-2] == dst.shape[:-2], f"batch axes differ: src {src}, dst {dst}")
        require(idx.shape[-1] == src.shape[-2], f"{idx.shape[-1]} indices for {src.shape[-2]} rows")
        if idx.rank >= 2 and dst.rank >= 3:
            require(dims.divides(idx.shape[-2], dst.shape[-3]), f"indices {idx} do not repeat into {dst}")
        return dst
