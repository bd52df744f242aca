"""Rotary embeddings, masked softmax and fused attention, with ggml's semantics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from llamir.ir import dims
from llamir.ir.dtypes import F16, F32, I32
from llamir.ir.ops.base import Op, register_op, require
from llamir.ir.types import TensorType

ROPE_NORM = 0   # rotate adjacent pairs (x[2i], x[2i+1]): llama-family GGUFs
ROPE_NEOX = 2   # rotate halves (x[i], x[i + n_dims/2]): qwen2, qwen3, gemma, phi, ...
ROPE_MODES = {ROPE_NORM: "norm", ROPE_NEOX: "neox"}


@register_op
@dataclass(frozen=True, slots=True)
class RopeExt(Op):
    """Rotary position embedding of x [..., T, H, d] at positions pos i32 [T] (ggml_rope_ext).

    Pair i (i < n_dims/2) is rotated by theta_i = pos * freq_base^(-2i/n_dims) / ff[i], with
    YaRN: theta = freq_scale*theta blended back towards theta by ramp(i)*ext_factor between the
    correction dims, and cos/sin scaled by attn_factor (times 1 + 0.1 ln(1/freq_scale) when
    ext_factor != 0). Axes at or beyond n_dims pass through. Optional input 3: freq factors ff.
    """

    name: ClassVar[str] = "rope_ext"
    can_inplace: ClassVar[bool] = True
    n_dims: int = 0
    mode: int = ROPE_NORM
    n_ctx_orig: int = 0
    freq_base: float = 10000.0
    freq_scale: float = 1.0
    ext_factor: float = 0.0
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    freq_factors: bool = False

    def n_inputs(self) -> int:
        return 3 if self.freq_factors else 2

    def infer(self, x: TensorType, pos: TensorType, *factors: TensorType) -> TensorType:
        require(self.mode in ROPE_MODES, f"mode {self.mode} is not supported (norm=0, neox=2)")
        require(x.dtype in (F32, F16), f"x must be f32 or f16, got {x.dtype}")
        require(x.rank >= 3, f"x must be [..., T, H, d], got {x}")
        require(pos.dtype == I32 and pos.rank == 1, f"pos must be i32 [T], got {pos}")
        require(pos.shape[0] == x.shape[-3], f"{pos.shape[0]} positions for {x.shape[-3]} tokens")
        head = x.shape[-1]
        require(self.n_dims % 2 == 0 and 0 < self.n_dims and (not isinstance(head, int) or
                self.n_dims <= head), f"n_dims={self.n_dims} must be even and within the head size {head}")
        if factors:
            require(factors[0].dtype == F32 and factors[0].rank == 1, f"freq factors must be f32 [n], got "
                    f"{factors[0]}")
            n = factors[0].shape[0]
            require(not isinstance(n, int) or n >= self.n_dims // 2, f"{n} freq factors < n_dims/2")
        return x


@register_op
@dataclass(frozen=True, slots=True)
class SoftMaxExt(Op):
    """y = softmax(x*scale + slope_h*mask) over the last axis (ggml_soft_max_ext).

    x [..., H, T, n], mask [..., H', T', n] f32/f16 with T' >= T (rows past T unused) and H' | H,
    slope_h the ALiBi slope of head h (1 when max_bias == 0). With `sinks` (input 3, f32 [H]),
    each row's normaliser also counts exp(sinks[h]) (attention sinks, gpt-oss).
    """

    name: ClassVar[str] = "soft_max_ext"
    can_inplace: ClassVar[bool] = True
    scale: float = 1.0
    max_bias: float = 0.0
    mask: bool = False
    sinks: bool = False

    def n_inputs(self) -> int:
        return 1 + int(self.mask) + int(self.sinks)

    def infer(self, x: TensorType, *rest: TensorType) -> TensorType:
        require(x.dtype == F32, f"x must be f32, got {x.dtype}")
        rest = list(rest)
        if self.mask:
            m = rest.pop(0)
            require(m.dtype in (F32, F16), f"mask must be f32 or f16, got {m.dtype}")
            require(m.shape[-1] == x.shape[-1], f"mask {m} and x {x} differ in the last axis")
            require(m.rank <= x.rank, f"mask {m} has a higher rank than {x}")
            rows_m, rows_x = (m.shape[-2] if m.rank >= 2 else 1), (x.shape[-2] if x.rank >= 2 else 1)
            require(not (isinstance(rows_m, int) and isinstance(rows_x, int)) or rows_m >= rows_x
                    or rows_m == rows_x, f"mask {m} has fewer rows than x {x}")
            for axis in (-3, -4):
                if m.rank >= -axis and x.rank >= -axis:
                    require(dims.divides(m.shape[axis], x.shape[axis]), f"mask {m} does not repeat into {x}")
        if self.sinks:
            s = rest.pop(0)
            require(s.dtype == F32 and s.rank == 1, f"sinks must be f32 [H], got {s}")
        require(self.max_bias == 0 or (x.rank >= 3 and self.mask), "ALiBi needs a head axis and a mask")
        return x


@register_op
@dataclass(frozen=True, slots=True)
class FlashAttnExt(Op):
    """Fused attention (ggml_flash_attn_ext), output PERMUTED like ggml's:
    q [S, H, T, dk], k [S, Hkv, n, dk], v [S, Hkv, n, dv], mask [S', H', T', n] ->
    y [S, T, H, dv] = softmax(softcap(q k^T * scale) + slope_h*mask) v, per head h using KV head
    h // (H/Hkv). softcap(z) = c*tanh(z/c) when logit_softcap = c != 0. Optional sinks f32 [H].
    """

    name: ClassVar[str] = "flash_attn_ext"
    scale: float = 1.0
    max_bias: float = 0.0
    logit_softcap: float = 0.0
    mask: bool = True
    sinks: bool = False

    def n_inputs(self) -> int:
        return 3 + int(self.mask) + int(self.sinks)

    def infer(self, q: TensorType, k: TensorType, v: TensorType, *rest: TensorType) -> TensorType:
        require(q.rank == 4 and k.rank == 4 and v.rank == 4, f"expects rank-4 q, k, v; got {q}, {k}, {v}")
        require(q.dtype == F32, f"q must be f32, got {q.dtype}")
        require(all(t.dtype.is_float or t.dtype.is_quantized for t in (k, v)),
                f"unsupported k/v types {k.dtype}/{v.dtype}")
        require(q.shape[-1] == k.shape[-1], f"q {q} and k {k} head sizes differ")
        require(k.shape[-2] == v.shape[-2] and k.shape[1] == v.shape[1], f"k {k} and v {v} differ")
        require(dims.divides(k.shape[1], q.shape[1]), f"KV heads of {k} do not divide the heads of {q}")
        require(q.shape[0] == k.shape[0] == v.shape[0], f"stream axes differ: {q}, {k}, {v}")
        rest = list(rest)
        if self.mask:
            m = rest.pop(0)
            require(m.dtype in (F16, F32), f"mask must be f16 or f32, got {m.dtype}")
            require(m.rank == 4 and m.shape[-1] == k.shape[-2], f"mask {m} does not match {k}")
            require(dims.divides(m.shape[1], q.shape[1]) and dims.divides(m.shape[0], q.shape[0]),
                    f"mask {m} heads/streams do not repeat into q {q}")
        if self.sinks:
            s = rest.pop(0)
            require(s.dtype == F32 and s.rank == 1, f"sinks must be f32 [H], got {s}")
        return TensorType((q.shape[0], q.shape[2], q.shape[1], v.shape[-1]), F32)
