"""Normalisations over the last axis."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from llamir.ir.ops.base import Op, register_op, require
from llamir.ir.types import TensorType


class RowNorm(Op):
    can_inplace: ClassVar[bool] = True

    def infer(self, x: TensorType) -> TensorType:
        require(x.dtype.is_float, f"expects a float input, got {x.dtype}")
        require_eps(self.eps)
        return x


def require_eps(eps: float) -> None:
    """ggml's norm kernels GGML_ASSERT(eps >= 0.0f), which also refuses NaN."""
    require(eps >= 0, f"eps must be >= 0 (not NaN), got {eps}")


@register_op
@dataclass(frozen=True, slots=True)
class RmsNorm(RowNorm):
    """y = x / sqrt(mean(x**2, axis=-1) + eps), over the last axis."""

    name: ClassVar[str] = "rms_norm"
    eps: float = 1e-6


@register_op
@dataclass(frozen=True, slots=True)
class Norm(RowNorm):
    """y = (x - mean(x)) / sqrt(var(x) + eps), over the last axis (ggml_norm: no affine part)."""

    name: ClassVar[str] = "norm"
    can_inplace: ClassVar[bool] = False
    eps: float = 1e-5


@register_op
@dataclass(frozen=True, slots=True)
class L2Norm(RowNorm):
    """y = x / max(sqrt(sum(x**2, axis=-1)), eps), over the last axis."""

    name: ClassVar[str] = "l2_norm"
    can_inplace: ClassVar[bool] = False
    eps: float = 1e-12


@register_op
@dataclass(frozen=True, slots=True)
class GroupNorm(RowNorm):
    """ggml_group_norm: x [..., C, L, W] (ggml [W, L, C]) normalised per group of
    ceil(C / n_groups) channels over all of (channels, L, W)."""

    name: ClassVar[str] = "group_norm"
    can_inplace: ClassVar[bool] = False
    n_groups: int = 1
    eps: float = 1e-5

    def infer(self, x: TensorType) -> TensorType:
        require(x.rank >= 3, f"expects rank >= 3 (channels at axis -3), got {x}")
        require(self.n_groups >= 1, f"n_groups must be >= 1, got {self.n_groups}")
        return RowNorm.infer(self, x)
