"""Fused ops: single ops for chains that passes/fusion.py recognises, so a backend can run each
as one loop. Each states its math as the composition it replaces, and its reference kernel
(ir/interp_fused.py) computes exactly that composition."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from llamir.ir.ops.attention import SoftMaxExt
from llamir.ir.ops.base import Op, register_op, require
from llamir.ir.ops.elementwise import can_repeat
from llamir.ir.ops.matmul import MulMat
from llamir.ir.ops.norm import require_eps
from llamir.ir.types import TensorType


@register_op
@dataclass(frozen=True, slots=True)
class RmsNormMul(Op):
    """y = rms_norm(x, eps) * w   (w tiled to x's shape, as ggml_mul repeats it)."""

    name: ClassVar[str] = "rms_norm_mul"
    arity: ClassVar[int] = 2
    eps: float = 1e-6

    def infer(self, x: TensorType, w: TensorType) -> TensorType:
        require(x.dtype.is_float and w.dtype.is_float, f"expects float inputs, got {x.dtype} and {w.dtype}")
        require(can_repeat(w, x), f"{w} cannot be repeated to {x}")
        require_eps(self.eps)
        return x


@register_op
@dataclass(frozen=True, slots=True)
class NormMulAdd(Op):
    """y = norm(x, eps) * w (+ b when `bias`)   (w and b tiled to x's shape): a layer norm."""

    name: ClassVar[str] = "norm_mul_add"
    eps: float = 1e-5
    bias: bool = True

    def n_inputs(self) -> int:
        return 3 if self.bias else 2

    def infer(self, x: TensorType, w: TensorType, *b: TensorType) -> TensorType:
        for t in (x, w, *b):
            require(t.dtype.is_float, f"expects float inputs, got {t.dtype}")
        for t in (w, *b):
            require(can_repeat(t, x), f"{t} cannot be repeated to {x}")
        require_eps(self.eps)
        return x


@register_op
@dataclass(frozen=True, slots=True)
class SoftMaxAttn(Op):
    """y = mul_mat(v, soft_max_ext(mul_mat(k, q), mask, scale, max_bias, sinks)): attention
    without flash attention, as one op. q [S, H, T, d], k [S, Hkv, n, d] and v [S, Hkv, dv, n]
    (mul_mat's weight side: the transposed V cache) -> y [S, H, T, dv]; rounding as the three
    ops (q to k's vec_dot_type, the probabilities to v's)."""

    name: ClassVar[str] = "soft_max_attn"
    scale: float = 1.0
    max_bias: float = 0.0
    mask: bool = True
    sinks: bool = False

    def n_inputs(self) -> int:
        return 3 + int(self.mask) + int(self.sinks)

    def softmax_op(self) -> SoftMaxExt:
        return SoftMaxExt(scale=self.scale, max_bias=self.max_bias, mask=self.mask, sinks=self.sinks)

    def infer(self, q: TensorType, k: TensorType, v: TensorType, *rest: TensorType) -> TensorType:
        require(q.rank == 4 and k.rank == 4 and v.rank == 4, f"expects rank-4 q, k, v; got {q}, {k}, {v}")
        kq = MulMat().infer(k, q)
        probs = self.softmax_op().infer(kq, *rest)
        return MulMat().infer(v, probs)
