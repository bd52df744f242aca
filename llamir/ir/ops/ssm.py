"""State-space-model ops (Mamba, Mamba-2), with ggml's semantics in numpy dimension order.

`ssm_conv` is the depthwise causal convolution over each sequence's window of the last
d_conv - 1 inputs plus the new tokens; `ssm_scan` is the selective scan that carries each
sequence's state over its tokens and returns the outputs and the last states in one tensor.
Both take f32 only (ggml's CPU backend aborts on anything else). Their strides follow ggml's
asserts, which the reference interpreter checks when it runs them: sx and x, B, C need
contiguous rows (the last axis packed, and sx's channel rows, x's heads and B's and C's groups
back to back), s, dt and A must be contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from llamir.ir import dims
from llamir.ir.dims import Dim
from llamir.ir.dtypes import F32, I32
from llamir.ir.ops.base import Op, register_op, require
from llamir.ir.types import TensorType

INT32_MAX = 2**31 - 1


def _f32(t: TensorType, what: str) -> None:
    require(t.dtype == F32, f"{what} must be f32, got {t}")


def window_tokens(window: Dim, d_conv: Dim) -> Dim:
    """n_t = window - (d_conv - 1): the tokens of a window of `window` columns (ggml_ssm_conv);
    for a symbolic window (`rs_seq_tokens+3`) the difference is a dim when d_conv is concrete."""
    require(isinstance(d_conv, int), f"the conv width d_conv = {d_conv} must be concrete")
    n_t = dims.add(window, 1 - d_conv)
    if isinstance(n_t, int):
        require(n_t >= 0, f"a window of {window} columns is shorter than d_conv - 1 = {d_conv - 1}")
    else:
        require(all(c > 0 for c, _ in dims.terms(n_t)),
                f"a window of {window} columns holds n_t = {n_t} tokens, which is not a size: build the window "
                f"as n_t+{d_conv - 1} columns (the cached columns, then the tokens)")
    return n_t


@register_op
@dataclass(frozen=True, slots=True)
class SsmConv(Op):
    """Depthwise causal conv1d over sliding windows (ggml_ssm_conv):
    sx [n_s, d_inner, d_conv - 1 + n_t], c [d_inner, d_conv] -> y [n_s, n_t, d_inner] f32,
    y[s, t, i] = sum_{k < d_conv} sx[s, i, t + k] * c[i, k], accumulated from 0 in k order as GCC
    compiles ggml's loop: the products of whole groups of the profile's fused_tail taps rounded,
    then the last d_conv % fused_tail as fmas (all fmas for d_conv < fused_tail: Mamba's 4 taps)."""

    name: ClassVar[str] = "ssm_conv"
    arity: ClassVar[int] = 2

    def infer(self, sx: TensorType, c: TensorType) -> TensorType:
        _f32(sx, "sx")
        _f32(c, "c")
        require(sx.rank == 3, f"sx must be [n_s, d_inner, d_conv - 1 + n_t], got {sx}")
        require(c.rank == 2, f"c must be [d_inner, d_conv], got {c}")
        d_inner, d_conv = c.shape
        require(not isinstance(d_conv, int) or d_conv >= 1, f"c {c} has no taps (d_conv = {d_conv})")
        require(sx.shape[1] == d_inner, f"sx {sx} has {sx.shape[1]} channels but c {c} has {d_inner}")
        n_t = window_tokens(sx.shape[2], d_conv)
        return TensorType((sx.shape[0], n_t, d_inner), F32)


@register_op
@dataclass(frozen=True, slots=True)
class SsmScan(Op):
    """Selective scan (ggml_ssm_scan) of sequences s = 0..n_s-1, each from state slot ids[s]:
    inputs s [n_rs, H, hd, ds] (all state slots), x [n_s, n_t, H, hd], dt [n_s, n_t, H],
    A [H, ds] (Mamba-1) or [H, 1] (Mamba-2: one decay per head), B, C [n_s, n_t, G, ds] with
    G | H (head h reads group h // (H/G)), ids i32 [n_s].  With h_0 = s[ids[s]], per token t:
        d = softplus(dt[s, t, h])   (dt when dt > 20, else logf(1 + expf(dt)))
        h_t = h_{t-1} * expf(d * A[h]) + B[s, t, g] * (x[s, t, h] * d)    (one fma)
        y[s, t, h, i] = sum_k h_t[h, i, k] * C[s, t, g, k]
    The result is 1-D f32: y (x's elements, [n_s, n_t, H, hd]) then K state blocks
    [K, n_s, H, hd, ds]: block 0 the last states h_{n_t}, block k (0 < k < K) the states k tokens
    before the end, h_{n_t - k} (snapshots to roll back to; Mamba-2 only); blocks k >= n_t,
    which ggml leaves unwritten, are zero. The sums over ds are fmas in ggml's order: for
    Mamba-1 one by one; for Mamba-2 four vector accumulators over whole 4-vector steps of the
    numerics profile's lanes, reduced as GGML_F32_VEC_REDUCE, then the rest one by one."""

    name: ClassVar[str] = "ssm_scan"
    arity: ClassVar[int] = 7
    K: int = 1

    def infer(self, s: TensorType, x: TensorType, dt: TensorType, A: TensorType, B: TensorType,
              C: TensorType, ids: TensorType) -> TensorType:
        require(1 <= self.K <= INT32_MAX, f"K = {self.K} must be in [1, {INT32_MAX}]")
        for t, what in ((s, "s"), (x, "x"), (dt, "dt"), (A, "A"), (B, "B"), (C, "C")):
            _f32(t, what)
        require(s.rank == 4, f"s must be [n_rs, n_head, head_dim, d_state], got {s}")
        require(x.rank == 4, f"x must be [n_s, n_t, n_head, head_dim], got {x}")
        n_s, n_t, n_head, head_dim = x.shape
        d_state = s.shape[3]
        require(s.shape[1:3] == (n_head, head_dim), f"s {s} does not hold states of x's heads {x}")
        require(dt.shape == (n_s, n_t, n_head), f"dt must be [n_s, n_t, n_head] = [{n_s},{n_t},{n_head}], got {dt}")
        require(B.shape == C.shape, f"B {B} and C {C} differ")
        require(B.rank == 4 and B.shape[0:2] == (n_s, n_t) and B.shape[3] == d_state,
                f"B and C must be [n_s, n_t, n_group, d_state] = [{n_s},{n_t},n_group,{d_state}], got {B}")
        require(dims.divides(B.shape[2], n_head), f"n_group {B.shape[2]} does not divide n_head {n_head}")
        require(ids.dtype == I32 and ids.rank == 1 and ids.shape[0] == n_s, f"ids must be i32 [{n_s}], got {ids}")
        require(A.rank == 2 and A.shape[0] == n_head, f"A must be [n_head, d_state] or [n_head, 1], got {A}")
        if A.shape[1] != 1:
            require(A.shape[1] == d_state, f"A {A} must be [{n_head}, {d_state}] (Mamba-1) or [{n_head}, 1] (Mamba-2)")
            require(self.K == 1, f"K = {self.K}: state snapshots need Mamba-2's A [n_head, 1], got {A}")
        states = dims.prod((self.K, n_s, n_head, head_dim, d_state))
        return TensorType((dims.add(x.numel, states),), F32)
