"""Reference kernels of ssm_conv and ssm_scan, bit for bit as ggml's CPU backend computes them
(ggml_compute_forward_ssm_conv_f32 / ggml_compute_forward_ssm_scan_f32, built by GCC, whose
-ffp-contract=fast makes every a*b + c there one fma).

ssm_conv sums its d_conv taps in order from 0, the products of whole groups of fused_tail taps
rounded (GCC's in-order vectorised reduction), the rest fmas (its scalar tail). ssm_scan updates each state as
fma(h, expf(d*A), B*(x*d)) with glibc's expf and logf (the softplus of dt); its output dots are
sequential fmas for Mamba-1 (A [H, ds]), and for Mamba-2 (A [H, 1]) the vector loop of the
numerics profile: four accumulators over whole GGML_F32_STEP steps of d_state, reduced as
GGML_F32_VEC_REDUCE, then the leftover states one fma at a time.
"""

from __future__ import annotations

import numpy as np

from llamir.ir import ggml_math, ops
from llamir.ir.interp_kernels import f32, kernel
from llamir.ir.interp_nn import _check_indices
from llamir.ir.numerics import Numerics


def require_layout(array: np.ndarray, what: str, packed_axes: int) -> None:
    """ggml's stride asserts: the last `packed_axes` axes of `array` are laid out contiguously
    (nb[0] = the element size, nb[1] = ne[0]*nb[0], ...); axes of size 1 have no stride to check."""
    want = array.itemsize
    for axis in range(array.ndim - 1, array.ndim - 1 - packed_axes, -1):
        n = array.shape[axis]
        if n != 1 and array.strides[axis] != want:
            raise ValueError(f"{what} needs its last {packed_axes} axes contiguous (ggml's stride asserts), "
                             f"got strides {array.strides} for shape {array.shape}")
        want *= n


@kernel(ops.SsmConv)
def _ssm_conv(ctx, node, args, bindings):
    sx, c = args
    require_layout(sx, "ssm_conv's sx", 2)   # ops.cpp: nb[0] == 4, nb[1] == ne[0]*4
    require_layout(c, "ssm_conv's c", 2)     # read as packed rows of d_conv taps
    d_conv = c.shape[1]
    n_t = sx.shape[2] - d_conv + 1
    fused_from = conv_fused_from(d_conv, ctx.numerics)
    acc = np.zeros((sx.shape[0], sx.shape[1], n_t), f32)          # [n_s, d_inner, n_t]
    for k in range(d_conv):
        window, tap = sx[:, :, k:k + n_t], c[:, k:k + 1]
        acc = acc + window * tap if k < fused_from else ggml_math.fma(window, tap, acc)
    return acc.transpose(0, 2, 1)                                   # [n_s, n_t, d_inner]


def conv_fused_from(d_conv: int, numerics: Numerics) -> int:
    """The first tap ssm_conv fuses into an fma: GCC vectorises ggml's `sumf += s*c` as an in-order
    reduction, rounding the products of whole groups of numerics.fused_tail taps (8 in the AVX-512
    build, 4 in the AVX2 one) and adding them one by one; the scalar tail's are fmas."""
    return d_conv - d_conv % numerics.fused_tail


def softplus(x: np.ndarray) -> np.ndarray:
    """ggml_compute_softplus_f32: x when x > 20, else logf(1 + expf(x))."""
    with np.errstate(over="ignore"):
        return np.where(x > 20, x, ggml_math.logf(f32(1) + ggml_math.expf(x))).astype(f32)


def _dot_sequential(h: np.ndarray, c: np.ndarray) -> np.ndarray:
    """sum_k h[..., k] * c[..., k] as one fma after another from 0 (ggml's scalar loop)."""
    acc = np.zeros(np.broadcast_shapes(h.shape, c.shape)[:-1], f32)
    for k in range(h.shape[-1]):
        acc = ggml_math.fma(h[..., k], c[..., k], acc)
    return acc


def _dot_vectorised(h: np.ndarray, c: np.ndarray, numerics: Numerics) -> np.ndarray:
    """The Mamba-2 dot of ggml's GGML_SIMD loop: 4 x lanes accumulators over the whole steps of the
    last axis, GGML_F32_VEC_REDUCE, then the rest one fma at a time."""
    step = numerics.step
    n = h.shape[-1]
    head = n - n % step
    acc = np.zeros(np.broadcast_shapes(h.shape, c.shape)[:-1] + (step,), f32)
    for k in range(0, head, step):
        acc = ggml_math.fma(h[..., k:k + step], c[..., k:k + step], acc)
    total = ggml_math.reduce_accumulators(acc, numerics)
    for k in range(head, n):
        total = ggml_math.fma(h[..., k], c[..., k], total)
    return total


@kernel(ops.SsmScan)
def _ssm_scan(ctx, node, args, bindings):
    s, x, dt, A, B, C, ids = args
    for array, what, packed in ((s, "s", 4), (dt, "dt", 3), (A, "A", 2), (x, "x", 2), (B, "B", 2), (C, "C", 2)):
        require_layout(array, f"ssm_scan's {what}", packed)
    K = node.op.K
    n_s, n_t, n_head, head_dim = x.shape
    n_group = B.shape[2]
    _check_indices(ids, s.shape[0], "ssm_scan state id")
    group = np.arange(n_head) // (n_head // n_group)                # repeat_interleave of the groups
    mamba2 = A.shape[1] == 1
    d = softplus(dt)                                               # [n_s, n_t, H]
    h = s[ids].astype(f32)                                         # [n_s, H, hd, ds] (a copy)
    y = np.empty(x.shape, f32)
    states = np.zeros((K,) + h.shape, f32)                         # [K, n_s, H, hd, ds]
    for t in range(n_t):
        d_t = d[:, t, :, None, None]                               # [n_s, H, 1, 1]
        x_dt = x[:, t, :, :, None] * d_t                           # [n_s, H, hd, 1]
        b, c = B[:, t][:, group, None, :], C[:, t][:, group, None, :]   # [n_s, H, 1, ds]
        with np.errstate(over="ignore", under="ignore"):
            decay = ggml_math.expf(d_t * A[None, :, None, :])      # [n_s, H, 1, ds or 1]
        h = ggml_math.fma(h, decay, b * x_dt)
        y[:, t] = _dot_vectorised(h, c, ctx.numerics) if mamba2 else _dot_sequential(h, c)
        back = n_t - 1 - t                                         # this token's snapshot block
        if 0 < back < K:
            states[back] = h
    states[0] = h
    return np.concatenate([y.ravel(), states.ravel()])
