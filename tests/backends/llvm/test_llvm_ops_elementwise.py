"""Element-wise ops, fused chains, copies and layout changes on the LLVM backend against the numpy
interpreter (ggml's test-backend-ops, for this backend): odd sizes, one row, broadcasts, views,
every float storage type. Most results are bit-exact: the kernels use ggml's functions."""

from __future__ import annotations

import numpy as np
import pytest

from llamir.ir import BF16, F16, F32, I32, GraphBuilder, ops

rng = np.random.default_rng(1)
FLOATS = [F32, F16, BF16]


def _values(shape, dtype, lo=-3.0, hi=3.0):
    x = rng.uniform(lo, hi, shape).astype(np.float32)
    if dtype == F16:
        return x.astype(np.float16)
    if dtype == BF16:
        return (x.view(np.uint32) >> 16).astype(np.uint16)
    return x


BINARY_SHAPES = [((1, 1), (1, 1)), ((7, 33), (33,)), ((7, 33), (7, 33)), ((3, 5, 17), (1, 5, 1)),
                 ((2, 3, 4, 19), (2, 1, 4, 19)), ((4, 6), (2, 3)), ((5, 40), (1, 40))]


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
@pytest.mark.parametrize("a_shape,b_shape", BINARY_SHAPES)
def test_binary_broadcasts(check, op, a_shape, b_shape):
    b = GraphBuilder("g")
    x, y = b.input("x", a_shape, F32), b.input("y", b_shape, F32)
    b.output("z", getattr(b, op)(x, y))
    check(b.graph, {"x": _values(a_shape, F32), "y": _values(b_shape, F32, 0.5, 3.0)}, exact=True)


@pytest.mark.parametrize("dtype", FLOATS)
def test_binary_storage_types(check, dtype):
    b = GraphBuilder("g")
    x, y = b.input("x", [5, 21], dtype), b.input("y", [21], F32)
    b.output("z", b.mul(x, y))
    b.output("w", b.add(b.cast(x, F32), y))
    check(b.graph, {"x": _values((5, 21), dtype), "y": _values((21,), F32)}, exact=True)


UNARY = ["neg", "abs", "sgn", "step", "tanh", "elu", "relu", "sigmoid", "gelu", "gelu_erf", "gelu_quick",
         "silu", "hardsigmoid", "hardswish", "exp", "log", "sqr", "sqrt", "sin", "cos", "softplus"]


@pytest.mark.parametrize("name", UNARY)
@pytest.mark.parametrize("dtype", [F32, F16])
def test_unary(check, name, dtype):
    positive = name in ("log", "sqrt")
    b = GraphBuilder("g", dims=["T"])
    x = b.input("x", ["T", 37], dtype)
    b.output("y", b.unary(name, x))
    lo, hi = (0.1, 4.0) if positive else (-5.0, 5.0)
    # libm (tanhf, logf, expm1f, ...) where the reference uses numpy's own float32 code: ulps apart
    exact = name not in ("tanh", "log", "softplus", "gelu_erf", "elu", "gelu")
    check(b.graph, {"x": _values((3, 37), dtype, lo, hi)}, {"T": 3}, tol=1e-12, exact=exact)


@pytest.mark.parametrize("kind", ["swiglu", "geglu", "reglu", "geglu_erf", "geglu_quick"])
@pytest.mark.parametrize("form", ["split", "fused", "swapped"])
def test_glu(check, kind, form):
    b = GraphBuilder("g")
    if form == "split":
        g, u = b.input("g", [3, 45], F32), b.input("u", [3, 45], F32)
        b.output("y", b.glu(kind, g, u))
        values = {"g": _values((3, 45), F32), "u": _values((3, 45), F32)}
    else:
        x = b.input("x", [3, 90], F32)
        b.output("y", b.glu(kind, x, swapped=form == "swapped"))
        values = {"x": _values((3, 90), F32)}
    check(b.graph, values, exact=kind != "geglu_erf", tol=1e-12)


def test_scale_clamp_fill(check):
    b = GraphBuilder("g")
    x = b.input("x", [4, 19], F32)
    b.output("s", b.scale(x, 0.5, 0.25))
    b.output("c", b.clamp(x, -1.0, 0.5))
    b.output("f", b.op(ops.Fill(c=2.5), x))
    check(b.graph, {"x": _values((4, 19), F32)}, exact=True)


def test_fused_chain_with_f16_intermediate(check):
    """softcap-style chains fuse into one loop; an f16 intermediate still rounds."""
    b = GraphBuilder("g", dims=["T"])
    x, w = b.input("x", ["T", 50], F32), b.weight("w", [50], F32)
    h = b.cast(b.mul(x, w), F16)
    y = b.scale(b.unary("tanh", b.scale(b.cast(h, F32), 1 / 30)), 30.0)
    b.output("y", b.add(y, x))
    check(b.graph, {"x": _values((6, 50), F32), "w": _values((50,), F32)}, {"T": 6}, tol=1e-13)


def test_views_as_inputs(check):
    """A strided view (every other row, an offset) and a transpose feed element-wise ops."""
    b = GraphBuilder("g")
    x = b.input("x", [8, 12], F32)
    v = b.view(x, [3, 10], [96, 4], 8)
    t = b.transpose(b.view(x, [4, 12], [48, 4], 0))
    b.output("a", b.silu(v))
    b.output("b", b.cont(t))
    b.output("c", b.add(b.cont(t), b.view(x, [12, 4], [16, 4], 0)))
    check(b.graph, {"x": _values((8, 12), F32)}, exact=True)


@pytest.mark.parametrize("src,dst", [(F32, F16), (F32, BF16), (F16, F32), (BF16, F32), (F32, I32), (I32, F32),
                                     (F16, F16)])
def test_cpy(check, src, dst):
    b = GraphBuilder("g")
    x = b.input("x", [3, 1, 29], src)
    b.output("y", b.cast(x, dst))
    values = rng.integers(-50, 50, (3, 1, 29)).astype(np.int32) if src == I32 else _values((3, 1, 29), src, -60, 60)
    check(b.graph, {"x": values}, exact=True)


def test_cont_permute_reshape_concat_repeat(check):
    b = GraphBuilder("g", dims=["T"])
    x = b.input("x", [2, "T", 3, 8], F32)
    p = b.permute(x, 0, 2, 1, 3)
    b.output("p", b.cont(p))
    b.output("r", b.cont(p, 6, b.dim("T"), 8))
    y = b.input("y", [2, "T", 3, 5], F32)
    b.output("c", b.concat(x, y, axis=3))
    b.output("c0", b.concat(x, x, axis=0))
    b.output("rep", b.repeat(b.input("s", [1, 3, 1], F32), 2, 6, 4))
    check(b.graph, {"x": _values((2, 4, 3, 8), F32), "y": _values((2, 4, 3, 5), F32),
                    "s": _values((1, 3, 1), F32)}, {"T": 4}, exact=True)


def test_one_row_and_zero_tokens(check):
    b = GraphBuilder("g", dims=["T"])
    x = b.input("x", ["T", 16], F32)
    b.output("y", b.silu(b.scale(x, 2.0)))
    check(b.graph, {"x": _values((1, 16), F32)}, {"T": 1}, exact=True)
    check(b.graph, {"x": np.zeros((0, 16), np.float32)}, {"T": 0}, exact=True)


@pytest.mark.parametrize("dst", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
def test_cpy_quantize_and_back(check, dst):
    from llamir.ir import dtype_named

    dt = dtype_named(dst)
    b = GraphBuilder("g")
    x = b.input("x", [3, 64], F32)
    q = b.cast(x, dt)
    b.output("q", q)
    b.output("back", b.cast(q, F32))
    b.output("half", b.cast(q, F16))
    check(b.graph, {"x": _values((3, 64), F32)}, exact=True)
