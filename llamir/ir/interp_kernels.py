"""The numpy kernels of the reference interpreter, one per op class.

Each kernel follows the op's docstring, computed in float32 the way ggml's CPU backend does
where the difference is observable: matmul activations are rounded to the weight's
vec_dot_type, rope angles are accumulated in f32, softmax sums in f64, and so on.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from llamir.ir import ggml_math, ops
from llamir.ir.dtypes import BF16, F16, F32, DType
from llamir.ir.graph import Node
from llamir.ir.numerics import Numerics, host_numerics

f32 = np.float32
KERNELS: dict[type, Callable] = {}


@dataclass
class Context:
    """What a kernel may read besides its inputs: the numerics profile it reproduces, the thread
    count ggml would run with (flash attention splits its work by it), and a cache of prepared
    weights keyed by buffer address."""

    weight_cache: dict | None = None
    exact: bool = True   # False: matmuls through BLAS (close to ggml, not bit for bit, much faster)
    numerics: Numerics = field(default_factory=host_numerics)
    n_threads: int = 2


def kernel(*classes: type):
    def wrap(fn):
        for cls in classes:
            KERNELS[cls] = fn
        return fn
    return wrap


# -- storage conversions -----------------------------------------------------------------
def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """ggml_compute_fp32_to_bf16: round to nearest even; NaN stays a quiet NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, ((u >> 16) | 64).astype(np.uint16), rounded)


def to_f32(x: np.ndarray, dtype: DType) -> np.ndarray:
    """Storage -> float32 values."""
    if dtype == F32:
        return x
    if dtype == F16 or dtype.is_int:
        return x.astype(np.float32)
    if dtype == BF16:
        return bf16_to_f32(x)
    from llamir.ir import quants

    return quants.dequantize(np.ascontiguousarray(x), dtype)


def from_f32(x: np.ndarray, dtype: DType) -> np.ndarray:
    """float32 values -> storage of `dtype` (f16 rounds to nearest even, quantized uses
    ggml-cpu's from_float, as its set_rows and cpy do: the reference quantizer but for q8_0/q8_1)."""
    if dtype == F32:
        return np.ascontiguousarray(x, dtype=np.float32)
    if dtype == F16:
        return x.astype(np.float16)
    if dtype == BF16:
        return f32_to_bf16(x)
    if dtype.is_int:
        return x.astype(dtype.np_dtype)
    from llamir.ir import quants

    return quants.cpu_from_float(np.ascontiguousarray(x, dtype=np.float32), dtype)


def tile_to(b: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """ggml repeat-broadcast: b's axes tile the target's (size-1 axes broadcast for free)."""
    b = b.reshape((1,) * (len(shape) - b.ndim) + b.shape)
    reps = [s // d if d not in (1, s) else 1 for s, d in zip(shape, b.shape, strict=True)]
    if any(r != 1 for r in reps):
        b = np.tile(b, reps)
    return np.broadcast_to(b, shape)


def _in(node: Node, i: int) -> DType:
    return node.inputs[i].dtype


# -- element-wise ------------------------------------------------------------------------
_BINARY = {ops.Add: np.add, ops.Sub: np.subtract, ops.Mul: np.multiply, ops.Div: np.divide}


@kernel(*_BINARY)
def _binary(ctx, node, args, bindings):
    a, b = to_f32(args[0], _in(node, 0)), to_f32(args[1], _in(node, 1))
    with np.errstate(all="ignore"):
        y = _BINARY[type(node.op)](a, tile_to(b, a.shape), dtype=f32)
    return from_f32(y, node.dtype)


def _sigmoid(x):
    """ggml's op_sigmoid: 1 / (1 + expf(-x)), glibc expf."""
    return f32(1) / (f32(1) + ggml_math.expf(-x))


def _silu_scalar(x):
    """ggml_silu_f32: x / (1 + expf(-x)), glibc expf (the f16/bf16 rows and f32 row tails)."""
    return x / (f32(1) + ggml_math.expf(-x))


def _gelu_f32(x):
    """ggml_gelu_f32: 0.5f*x*(1.0f + tanhf(SQRT_2_OVER_PI*x*(1.0f + GELU_COEF_A*x*x))), with GCC's
    fma for the innermost 1 + (a*x)*x and glibc's tanhf."""
    inner = ggml_math.fma(f32(0.044715) * x, x, f32(1))
    return f32(0.5) * x * (f32(1) + ggml_math.tanhf(f32(math.sqrt(2 / math.pi)) * x * inner))


def _gelu_table(x):
    """ggml's CPU gelu: x rounded to f16, looked up in an f16 table of gelu_f32, +-10 clamps."""
    xh = x.astype(np.float16).astype(f32)
    y = _gelu_f32(xh).astype(np.float16).astype(f32)
    return np.where(x <= -10, f32(0), np.where(x >= 10, x, y))


def _gelu_quick_table(x):
    xh = x.astype(np.float16).astype(f32)
    return (xh * _sigmoid(f32(1.702) * xh)).astype(np.float16).astype(f32)


_UNARY: dict[type, Callable] = {
    ops.Neg: np.negative, ops.Abs: np.abs, ops.Sgn: np.sign,
    ops.Step: lambda x: (x > 0).astype(f32), ops.Tanh: ggml_math.tanhf,
    ops.Elu: lambda x: np.where(x > 0, x, ggml_math.expm1f(x)), ops.Relu: lambda x: np.maximum(x, f32(0)),
    ops.Sigmoid: _sigmoid, ops.Gelu: _gelu_table,
    ops.GeluErf: lambda x: f32(0.5) * x * (f32(1) + ggml_math.erff(x * f32(1 / math.sqrt(2)))),
    ops.GeluQuick: _gelu_quick_table, ops.Silu: ggml_math.vec_silu,   # (the profile is passed below)
    ops.HardSigmoid: lambda x: np.clip((x + 3) / 6, 0, 1),
    ops.HardSwish: lambda x: x * np.clip((x + 3) / 6, 0, 1),
    ops.Exp: ggml_math.expf, ops.Log: ggml_math.logf, ops.Sqr: np.square, ops.Sqrt: np.sqrt,
    ops.Sin: ggml_math.sinf, ops.Cos: ggml_math.cosf,
    ops.Softplus: lambda x: np.where(x > 20, x, ggml_math.logf(f32(1) + ggml_math.expf(x))),  # op_softplus
}


_EXACT_FOR_BF16 = {ops.Gelu: _gelu_f32, ops.GeluQuick: lambda x: x * _sigmoid(f32(1.702) * x)}
_SCALAR_FOR_F16 = {ops.Silu: _silu_scalar}  # ggml_vec_silu_f16/bf16 have no 16-lane path


def _profiled(fn: Callable, numerics) -> Callable:
    """`fn` bound to the numerics profile when it is one of ggml's vectorised loops."""
    return (lambda x: fn(x, numerics)) if fn is ggml_math.vec_silu else fn


@kernel(*_UNARY)
def _unary(ctx, node, args, bindings):
    fn = _UNARY[type(node.op)]
    if _in(node, 0) != F32:
        fn = _SCALAR_FOR_F16.get(type(node.op), fn)
    if _in(node, 0) == BF16:  # ggml's bf16 gelus compute in f32, without the f16 tables
        fn = _EXACT_FOR_BF16.get(type(node.op), fn)
    with np.errstate(all="ignore"):
        y = _profiled(fn, ctx.numerics)(to_f32(args[0], _in(node, 0)))
    return from_f32(np.asarray(y, dtype=f32), node.dtype)


# ggml_vec_swiglu_f32 is vec_silu (its 16-lane/tail split) times g
_GLU_ACT = {ops.SwiGlu: ggml_math.vec_silu, ops.GeGlu: _gelu_table, ops.ReGlu: _UNARY[ops.Relu],
            ops.GeGluErf: _UNARY[ops.GeluErf], ops.GeGluQuick: _gelu_quick_table}


@kernel(*_GLU_ACT)
def _glu(ctx, node, args, bindings):
    x = to_f32(args[0], _in(node, 0))
    if node.op.split:
        a, b = x, to_f32(args[1], _in(node, 1))
    else:
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        if node.op.swapped:  # only the fused form has halves to swap
            a, b = b, a
    act = _GLU_ACT[type(node.op)]
    if act is ggml_math.vec_silu and _in(node, 0) != F32:  # ggml_vec_swiglu_f16/bf16: scalar silu
        act = _silu_scalar
    with np.errstate(all="ignore"):
        y = _profiled(act, ctx.numerics)(a) * b
    return from_f32(y, node.dtype)


@kernel(ops.Scale)
def _scale(ctx, node, args, bindings):
    x = to_f32(args[0], _in(node, 0))
    y = x * f32(node.op.s) + f32(node.op.b) if node.op.b else x * f32(node.op.s)
    return from_f32(y, node.dtype)


@kernel(ops.Clamp)
def _clamp(ctx, node, args, bindings):
    return from_f32(np.clip(to_f32(args[0], _in(node, 0)), f32(node.op.min), f32(node.op.max)), node.dtype)


@kernel(ops.Fill)
def _fill(ctx, node, args, bindings):
    return from_f32(np.full(args[0].shape, node.op.c, dtype=f32), node.dtype)


# -- normalisation -----------------------------------------------------------------------
def _row_sums(x: np.ndarray) -> np.ndarray:
    """`ggml_float sum += x[i]` over the last axis, in order (np.sum would pair the terms up)."""
    if x.shape[-1] == 0:
        return np.zeros(x.shape[:-1] + (1,))
    return np.add.accumulate(x.astype(np.float64), axis=-1)[..., -1:]


@kernel(ops.RmsNorm)
def _rms_norm(ctx, node, args, bindings):
    x = to_f32(args[0], _in(node, 0))
    mean = (_row_sums(x * x) / x.shape[-1]).astype(f32)
    scale = (f32(1) / np.sqrt(mean + f32(node.op.eps))).astype(f32)
    return from_f32(x * scale, node.dtype)


@kernel(ops.Norm)
def _norm(ctx, node, args, bindings):
    x = to_f32(args[0], _in(node, 0))
    mean = _row_sums(x).astype(f32) / f32(x.shape[-1])   # ggml_vec_sum_f32, then a float division
    centred = x - mean
    # ggml_vec_cvar_f32: the squares summed vector by vector, then the tail, into a float64
    var = (ggml_math.chunked_sum(centred * centred, ctx.numerics) / x.shape[-1]).astype(f32)
    return from_f32(centred * (f32(1) / np.sqrt(var + f32(node.op.eps))), node.dtype)


@kernel(ops.L2Norm)
def _l2_norm(ctx, node, args, bindings):
    x = to_f32(args[0], _in(node, 0))
    norm = np.sqrt(_row_sums(x * x).astype(f32))
    return from_f32(x * (f32(1) / np.maximum(norm, f32(node.op.eps))), node.dtype)


def _group_sum(part: np.ndarray) -> np.ndarray:
    """ggml_compute_forward_group_norm's sums over [..., g, L, W]: each row into a double, the row
    sums added in order. [..., 1, 1, 1] float64."""
    rows = _row_sums(part)                                          # [..., g, L, 1]
    flat = rows.reshape(rows.shape[:-3] + (-1,))
    return np.add.accumulate(flat, axis=-1)[..., -1:].reshape(rows.shape[:-3] + (1, 1, 1))


@kernel(ops.GroupNorm)
def _group_norm(ctx, node, args, bindings):
    x = to_f32(args[0], _in(node, 0))
    channels = x.shape[-3]
    per_group = -(-channels // node.op.n_groups)
    y = np.empty_like(x)
    for c0 in range(0, channels, per_group):
        part = x[..., c0:c0 + per_group, :, :]
        count = part.shape[-3] * part.shape[-2] * part.shape[-1]
        mean = (_group_sum(part) / count).astype(f32)
        centred = part - mean
        var = (_group_sum(centred * centred) / count).astype(f32)
        y[..., c0:c0 + per_group, :, :] = centred * (f32(1) / np.sqrt(var + f32(node.op.eps)))
    return from_f32(y, node.dtype)


# -- reductions and orderings ------------------------------------------------------------
@kernel(ops.SumRows)
def _sum_rows(ctx, node, args, bindings):
    x = to_f32(args[0], _in(node, 0))
    return from_f32(_row_sums(x).astype(f32), node.dtype)


@kernel(ops.Mean)
def _mean(ctx, node, args, bindings):
    x = to_f32(args[0], _in(node, 0))
    return from_f32(_row_sums(x).astype(f32) / f32(x.shape[-1]), node.dtype)


@kernel(ops.Sum)
def _sum(ctx, node, args, bindings):
    x = to_f32(args[0], _in(node, 0))
    rows = _row_sums(x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1))
    return from_f32(_row_sums(rows.reshape(1, -1)).reshape(1).astype(f32), node.dtype)


@kernel(ops.Argmax)
def _argmax(ctx, node, args, bindings):
    rows = np.asarray(args[0], dtype=f32).reshape(-1, args[0].shape[-1])
    return np.array([ggml_argmax_row(row) for row in rows], dtype=np.int32)


def ggml_argmax_row(row: np.ndarray) -> int:
    """ggml_vec_argmax_f32 on one row: the last maximum of the last NaN-free run (the running
    maximum restarts after a NaN, since `m > x` and `m == x` are false for NaN); 0 when all NaN."""
    ok = ~np.isnan(row)
    if not ok.any():
        return 0
    end = len(row) - int(np.argmax(ok[::-1]))          # one past the last number
    nan_before = np.flatnonzero(~ok[:end])
    run = row[(nan_before[-1] + 1 if nan_before.size else 0):end]
    return end - 1 - int(np.argmax(run[::-1]))         # np.argmax gives the first maximum


@kernel(ops.Cumsum)
def _cumsum(ctx, node, args, bindings):
    # add.accumulate adds each value to the previous sum in order, in f32, as ggml_vec_cumsum_f32;
    # overflow to inf and inf - inf are values here, not errors
    with np.errstate(over="ignore", invalid="ignore"):
        return np.cumsum(np.asarray(args[0], dtype=f32), axis=-1, dtype=f32)


@kernel(ops.Argsort)
def _argsort(ctx, node, args, bindings):
    x = args[0]
    order = np.argsort(-x if node.op.descending else x, axis=-1, kind="stable")
    return order.astype(np.int32)


@kernel(ops.TopK)
def _top_k(ctx, node, args, bindings):
    order = np.argsort(-args[0], axis=-1, kind="stable")
    return np.ascontiguousarray(order[..., : node.op.k].astype(np.int32))


# -- layout copies -----------------------------------------------------------------------
@kernel(ops.Cont)
def _cont(ctx, node, args, bindings):
    from llamir.ir.interp import storage_shape

    return np.array(args[0], copy=True, order="C").reshape(
        storage_shape(node.type.evaluate(bindings), node.dtype))


@kernel(ops.Cpy)
def _cpy(ctx, node, args, bindings):
    src = _in(node, 0)
    if src == node.dtype:
        return np.array(args[0], copy=True, order="C")
    return from_f32(to_f32(args[0], src), node.dtype)


@kernel(ops.Concat)
def _concat(ctx, node, args, bindings):
    return np.concatenate([args[0], args[1]], axis=node.op.axis % args[0].ndim)


@kernel(ops.Repeat)
def _repeat(ctx, node, args, bindings):
    from llamir.ir.interp import storage_shape

    shape = storage_shape(node.type.evaluate(bindings), node.dtype)
    return np.ascontiguousarray(tile_to(args[0], shape))


from llamir.ir import interp_attention as _attention  # noqa: E402,F401  (registers flash_attn_ext)
from llamir.ir import interp_nn as _nn  # noqa: E402,F401  (registers the matmul, rope and softmax kernels)
from llamir.ir import interp_ssm as _ssm  # noqa: E402,F401  (registers ssm_conv and ssm_scan)
