"""Element-wise ops of the reference interpreter against closed-form numpy (float64) formulas:
binary ops with ggml's repeat-broadcast, every unary op, scale/clamp/fill and the GLUs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from llamir.ir import F16, F32, GraphBuilder, IRError, ops, run_graph

f32, f16, f64 = np.float32, np.float16, np.float64
_erf = np.vectorize(math.erf, otypes=[f64])


def tiled(b: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """ggml's repeat-broadcast by index arithmetic: y[i] = b[i % b.shape] (b right-aligned)."""
    b = b.reshape((1,) * (len(shape) - b.ndim) + b.shape)
    return b[np.ix_(*[np.arange(n) % m for n, m in zip(shape, b.shape, strict=True)])]


def run_unary(op_name: str, x: np.ndarray, dtype=F32) -> np.ndarray:
    b = GraphBuilder("t")
    leaf = b.input("x", x.shape, dtype)
    b.output("y", b.unary(op_name, leaf))
    return run_graph(b.graph, {"x": x})["y"]


# -- binary ops ----------------------------------------------------------------------------------
BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}
BROADCASTS = [
    ((7,), (7,)),
    ((1, 5), (1, 5)),            # one row
    ((6, 4), (2, 4)),            # b's 2 rows tile a's 6 (ggml_can_repeat, not numpy broadcasting)
    ((6, 4), (1, 4)),
    ((3, 6, 4), (4,)),           # lower rank b
    ((2, 3, 4, 5), (1, 3, 1, 5)),
    ((2, 6, 3), (2, 3, 3)),
    ((4, 6), (1, 3)),            # the contiguous axis tiles too
    ((3, 9), (3, 9)),
]


def _operands(rng, a_shape, b_shape):
    a = rng.standard_normal(a_shape).astype(f32)
    b = (rng.uniform(0.5, 2.0, b_shape) * rng.choice([-1, 1], b_shape)).astype(f32)  # no division by ~0
    return a, b


@pytest.mark.parametrize("op_name", sorted(BINARY))
@pytest.mark.parametrize("a_shape,b_shape", BROADCASTS)
def test_binary_tiles_b_to_a(op_name, a_shape, b_shape):
    rng = np.random.default_rng(len(a_shape) * 10 + len(b_shape))
    a, b = _operands(rng, a_shape, b_shape)
    g = GraphBuilder("t")
    y = getattr(g, op_name)(g.input("a", a_shape, F32), g.input("b", b_shape, F32))
    g.output("y", y)
    got = run_graph(g.graph, {"a": a, "b": b})["y"]
    want = BINARY[op_name](a, tiled(b, a_shape))  # f32 arithmetic is correctly rounded: exact
    assert got.dtype == f32 and got.shape == a_shape
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("n_tokens", [1, 3, 7])
def test_binary_symbolic_rows(n_tokens):
    rng = np.random.default_rng(n_tokens)
    a, b = _operands(rng, (n_tokens, 6), (1, 3))
    g = GraphBuilder("t", dims=["T"])
    g.output("y", g.input("a", ["T", 6], F32) * g.input("b", [1, 3], F32))
    got = run_graph(g.graph, {"a": a, "b": b}, {"T": n_tokens})["y"]
    np.testing.assert_array_equal(got, a * tiled(b, a.shape))


def test_binary_through_transpose_permute_and_offset_view():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((5, 4)).astype(f32)
    b = rng.standard_normal((3, 4, 5)).astype(f32)
    buf = rng.standard_normal((10, 8)).astype(f32)
    g = GraphBuilder("t")
    at = g.transpose(g.input("a", [5, 4], F32))                                   # [4, 5]
    bp = g.permute(g.input("b", [3, 4, 5], F32), 1, 0, 2)                          # [4, 3, 5]
    v = g.view(g.input("buf", [10, 8], F32), [4, 5], [32, 4], offset=(2 * 8 + 1) * 4)  # buf[2:6, 1:6]
    s = g.add(at, v)                                                               # [4, 5]
    g.output("s", s)
    g.output("y", g.div(bp, g.reshape(g.cont(s), 4, 1, 5)))                        # [4, 3, 5]
    out = run_graph(g.graph, {"a": a, "b": b, "buf": buf})
    s_want = a.T + buf[2:6, 1:6]
    np.testing.assert_array_equal(out["s"], s_want)
    np.testing.assert_array_equal(out["y"], np.transpose(b, (1, 0, 2)) / s_want[:, None, :])


def test_binary_strided_operands_exact():
    rng = np.random.default_rng(2)
    a = rng.standard_normal((2, 3, 6)).astype(f32)
    b = rng.standard_normal((6, 3)).astype(f32)
    g = GraphBuilder("t")
    ap = g.permute(g.input("a", [2, 3, 6], F32), 2, 0, 1)       # [6, 2, 3], non-contiguous
    bt = g.view(g.input("b", [6, 3], F32), [2, 3], [24, 4], offset=12)  # rows 1 and 3 of b
    g.output("y", g.mul(ap, bt))
    got = run_graph(g.graph, {"a": a, "b": b})["y"]
    np.testing.assert_array_equal(got, np.transpose(a, (2, 0, 1)) * tiled(b[1:5:2], (6, 2, 3)))


def test_binary_f16_result_is_rounded_f32_math():
    rng = np.random.default_rng(3)
    a = rng.standard_normal((4, 8)).astype(f16)
    b = rng.standard_normal((1, 8)).astype(f32)
    g = GraphBuilder("t")
    g.output("y", g.add(g.input("a", [4, 8], F16), g.input("b", [1, 8], F32)))
    got = run_graph(g.graph, {"a": a, "b": b})["y"]
    assert got.dtype == f16
    np.testing.assert_array_equal(got, (a.astype(f32) + b).astype(f16))


# -- unary ops -----------------------------------------------------------------------------------
def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


UNARY_REF = {
    "neg": lambda x: -x, "abs": np.abs, "sgn": np.sign, "step": lambda x: (x > 0).astype(f64),
    "tanh": np.tanh, "elu": lambda x: np.where(x > 0, x, np.expm1(x)), "relu": lambda x: np.maximum(x, 0),
    "sigmoid": _sigmoid, "gelu_erf": lambda x: 0.5 * x * (1 + _erf(x / math.sqrt(2))),
    "silu": lambda x: x * _sigmoid(x), "hardsigmoid": lambda x: np.clip((x + 3) / 6, 0, 1),
    "hardswish": lambda x: x * np.clip((x + 3) / 6, 0, 1), "exp": np.exp, "log": np.log,
    "sqr": np.square, "sqrt": np.sqrt, "sin": np.sin, "cos": np.cos,
    "softplus": lambda x: np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20)))),
}
POSITIVE_ONLY = {"log", "sqrt"}


def gelu_table_ref(x: np.ndarray) -> np.ndarray:
    """ggml's CPU gelu on f32: x rounded to f16, gelu (a float result), rounded to f16; +-10 pass/zero."""
    xh = x.astype(f16).astype(f64)
    y = (0.5 * xh * (1 + np.tanh(math.sqrt(2 / math.pi) * xh * (1 + 0.044715 * xh * xh)))).astype(f32).astype(f16)
    return np.where(x <= -10, 0, np.where(x >= 10, x, y.astype(f64)))


def gelu_quick_table_ref(x: np.ndarray) -> np.ndarray:
    """ggml's CPU gelu_quick on f32: always the f16 table (no clamps)."""
    xh = x.astype(f16).astype(f64)
    return (xh * _sigmoid(1.702 * xh)).astype(f16).astype(f64)


def test_every_unary_op_has_a_reference():
    unary = {name for name, cls in ops.OPS.items() if issubclass(cls, ops.Unary)}
    assert unary == set(UNARY_REF) | {"gelu", "gelu_quick"}


def _unary_input(op_name: str, shape, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if op_name in POSITIVE_ONLY:
        return rng.uniform(0.05, 6.0, shape).astype(f32)
    x = rng.uniform(-5, 5, shape).astype(f32)
    x.reshape(-1)[:3] = [0.0, -1.5, 30.0][: x.size]  # 0 for step/sgn, 30 for softplus' linear branch
    return x


@pytest.mark.parametrize("op_name", sorted(UNARY_REF))
@pytest.mark.parametrize("shape", [(1, 1), (1, 9), (3, 5), (2, 3, 7), (2, 1, 3, 4)])
def test_unary_matches_closed_form(op_name, shape, nmse):
    x = _unary_input(op_name, shape, seed=len(shape))
    got = run_unary(op_name, x)
    want = UNARY_REF[op_name](x.astype(f64))
    assert got.dtype == f32 and got.shape == shape
    if op_name in ("neg", "abs", "sgn", "step", "relu", "sqr"):
        np.testing.assert_array_equal(got, want.astype(f32))
    else:
        assert nmse(got, want) < 1e-13
        np.testing.assert_allclose(got, want, rtol=4e-6, atol=1e-6)


@pytest.mark.parametrize("op_name", ["silu", "tanh", "exp", "sqr"])
def test_unary_f16_input_computes_in_f32_and_rounds(op_name):
    x = _unary_input(op_name, (3, 8), seed=4).clip(-4, 4).astype(f16)
    got = run_unary(op_name, x, dtype=F16)
    assert got.dtype == f16
    want = UNARY_REF[op_name](x.astype(f64)).astype(f16)
    ulp = np.spacing(np.abs(want)).astype(f64)
    assert np.all(np.abs(got.astype(f64) - want.astype(f64)) <= ulp)


@pytest.mark.parametrize("n_tokens", [1, 3, 7])
def test_unary_symbolic_and_strided(n_tokens):
    rng = np.random.default_rng(n_tokens)
    buf = rng.uniform(-3, 3, (n_tokens + 2, 8)).astype(f32)
    g = GraphBuilder("t", dims=["T"])
    T = g.dim("T")
    leaf = g.input("buf", ["T", 8], F32)
    v = g.view(leaf, [T, 5], [32, 4], offset=8)                     # buf[:, 2:7]
    g.output("y", g.silu(g.transpose(v)))                            # [5, T]
    got = run_graph(g.graph, {"buf": buf[:n_tokens]}, {"T": n_tokens})["y"]
    x = buf[:n_tokens, 2:7].T.astype(f64)
    np.testing.assert_allclose(got, x * _sigmoid(x), rtol=3e-6, atol=1e-7)


def test_gelu_rounds_input_and_output_to_f16():
    x = np.array([1.0001, -0.7, 2.5003, 9.999, 10.0001, 12.25, -10.0, -10.5, 0.0], dtype=f32)
    got = run_unary("gelu", x)
    np.testing.assert_array_equal(got, gelu_table_ref(x).astype(f32))
    # 1.0001 reads as f16 1.0: the result is gelu(1.0) rounded to f16, not gelu(1.0001)
    assert got[0] == f32(f16(0.5 * (1 + math.tanh(math.sqrt(2 / math.pi) * 1.044715))))
    assert got[4] == f32(10.0001) and got[5] == f32(12.25)   # x >= 10 passes through unrounded
    assert got[6] == 0 and got[7] == 0                        # x <= -10 is exactly 0


def test_gelu_quick_rounds_input_and_output_to_f16():
    x = np.array([1.0001, -0.7, 20.003, -3.3, 0.0], dtype=f32)
    got = run_unary("gelu_quick", x)
    np.testing.assert_array_equal(got, gelu_quick_table_ref(x).astype(f32))
    assert got[2] == f32(20.0)   # no +-10 clamp in gelu_quick: 20.003 reads as f16 20.0


@pytest.mark.parametrize("op_name,ref", [("gelu", gelu_table_ref), ("gelu_quick", gelu_quick_table_ref)])
def test_gelu_tables_on_random_inputs(op_name, ref):
    x = np.random.default_rng(5).uniform(-12, 12, (4, 257)).astype(f32)
    got = run_unary(op_name, x).astype(f64)
    want = ref(x)
    inside = np.abs(x) < 10
    assert np.all(got[inside] == got[inside].astype(f16).astype(f64))    # f16-representable
    # The table holds gelu computed in f32, then rounded to f16: one f16 ulp for the double rounding,
    # plus the f32 cancellation in 1 + tanh(z) ~ 0 for x << 0 (a tanh ulp times x/2).
    tol = np.spacing(np.abs(want).astype(f16)).astype(f64) + np.abs(x) * 2.0**-23
    assert np.all(np.abs(got - want) <= tol)
    assert np.mean((got == want)[x > -3]) > 0.97   # away from the cancellation, nearly all exact


def _bf16_round_bits(x: np.ndarray) -> np.ndarray:
    """float64 -> bf16 bits, round to nearest even through the exact f32 value."""
    u = x.astype(f32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def test_gelu_bf16_is_exact_f32_gelu_rounded_to_bf16():
    from llamir.ir import BF16

    x = np.array([1e-6, -3e-6, 2.5e-5, 0.3, -1.7, 11.0], dtype=f32)
    bits = (x.view(np.uint32) >> 16).astype(np.uint16)             # truncate to bf16 values
    xb = (bits.astype(np.uint32) << 16).view(f32).astype(f64)
    want = _bf16_round_bits(0.5 * xb * (1 + np.tanh(math.sqrt(2 / math.pi) * xb * (1 + 0.044715 * xb**2))))
    got = run_unary("gelu", bits, dtype=BF16)
    assert got.dtype == np.uint16
    assert np.all(np.abs(got.astype(np.int32) - want.astype(np.int32)) <= 1)   # one bf16 ulp


# -- scale, clamp, fill --------------------------------------------------------------------------
@pytest.mark.parametrize("s,bias", [(0.125, 0.0), (-3.0, 0.0), (0.7, 2.5), (1.0, -1.0)])
def test_scale_with_bias(s, bias, nmse):
    x = np.random.default_rng(6).standard_normal((3, 1, 7)).astype(f32)
    g = GraphBuilder("t")
    g.output("y", g.scale(g.input("x", x.shape, F32), s, bias))
    got = run_graph(g.graph, {"x": x})["y"]
    assert nmse(got, x.astype(f64) * s + bias) < 1e-14


@pytest.mark.parametrize("lo,hi", [(-0.5, 0.5), (0.0, float("inf")), (float("-inf"), -1.0)])
def test_clamp(lo, hi):
    x = np.random.default_rng(7).standard_normal((5, 3)).astype(f32)
    g = GraphBuilder("t")
    g.output("y", g.clamp(g.transpose(g.input("x", x.shape, F32)), lo, hi))
    got = run_graph(g.graph, {"x": x})["y"]
    np.testing.assert_array_equal(got, np.minimum(np.maximum(x.T, f32(lo)), f32(hi)))


@pytest.mark.parametrize("dtype,c", [(F32, 0.0), (F32, -2.75), (F16, 1.0 / 3.0)])
def test_fill(dtype, c):
    x = np.random.default_rng(8).standard_normal((2, 3, 4)).astype(dtype.np_dtype)
    g = GraphBuilder("t")
    g.output("y", g.op(ops.Fill(c=c), g.input("x", x.shape, dtype)))
    got = run_graph(g.graph, {"x": x})["y"]
    assert got.dtype == dtype.np_dtype and got.shape == x.shape
    np.testing.assert_array_equal(got, np.full(x.shape, c, dtype=dtype.np_dtype))


# -- GLUs ----------------------------------------------------------------------------------------
GLU_ACT = {
    "swiglu": lambda a: a * _sigmoid(a), "reglu": lambda a: np.maximum(a, 0), "geglu": gelu_table_ref,
    "geglu_erf": UNARY_REF["gelu_erf"], "geglu_quick": gelu_quick_table_ref,
}


def test_every_glu_has_a_reference():
    assert {n for n, c in ops.OPS.items() if issubclass(c, ops.Glu)} == set(GLU_ACT)


def _glu_inputs(shape, seed):
    x = np.random.default_rng(seed).uniform(-4, 4, shape).astype(f32)
    x.reshape(-1)[:2] = [11.5, -10.5]  # geglu's pass/zero branches
    return x


@pytest.mark.parametrize("kind", sorted(GLU_ACT))
@pytest.mark.parametrize("shape", [(1, 6), (3, 10), (2, 3, 4)])
def test_glu_split(kind, shape, nmse):
    a, up = _glu_inputs(shape, 9), _glu_inputs(shape, 10)
    g = GraphBuilder("t")
    g.output("y", g.glu(kind, g.input("a", shape, F32), g.input("b", shape, F32)))
    got = run_graph(g.graph, {"a": a, "b": up})["y"]
    assert nmse(got, GLU_ACT[kind](a.astype(f64)) * up) < 1e-13


@pytest.mark.parametrize("kind", sorted(GLU_ACT))
@pytest.mark.parametrize("swapped", [False, True])
@pytest.mark.parametrize("shape", [(1, 6), (3, 10), (2, 3, 4)])
def test_glu_fused_halves(kind, swapped, shape, nmse):
    x = _glu_inputs(shape, 11)
    g = GraphBuilder("t")
    y = g.glu(kind, g.input("x", shape, F32), swapped=swapped)
    assert y.shape == shape[:-1] + (shape[-1] // 2,)
    g.output("y", y)
    got = run_graph(g.graph, {"x": x})["y"]
    first, second = np.split(x.astype(f64), 2, axis=-1)
    gate, up = (second, first) if swapped else (first, second)
    # the gelu table rounds glibc tanhf's float to f16: the float64 closed form can round one f16
    # ulp the other way (tests/ir/test_ggml_exact.py checks every table entry against ggml itself)
    assert nmse(got, GLU_ACT[kind](gate) * up) < (1e-12 if kind == "geglu" else 1e-13)


def test_glu_fused_through_a_strided_view():
    rng = np.random.default_rng(12)
    buf = rng.standard_normal((4, 12)).astype(f32)
    g = GraphBuilder("t")
    v = g.view(g.input("buf", [4, 12], F32), [3, 8], [48, 4], offset=48 + 8)   # buf[1:4, 2:10]
    g.output("y", g.glu("swiglu", v))
    got = run_graph(g.graph, {"buf": buf})["y"]
    x = buf[1:4, 2:10].astype(f64)
    np.testing.assert_allclose(got, x[:, :4] * _sigmoid(x[:, :4]) * x[:, 4:], rtol=3e-6, atol=1e-7)


def test_glu_split_form_ignores_swapped():
    a, up = _glu_inputs((2, 6), 13), _glu_inputs((2, 6), 14)
    g = GraphBuilder("t")
    # ggml_glu_impl stores `swapped` for the split form too and its kernels ignore it there
    y = g.glu("swiglu", g.input("a", [2, 6], F32), g.input("b", [2, 6], F32), swapped=True)
    g.output("y", y)
    got = run_graph(g.graph, {"a": a, "b": up})["y"]
    np.testing.assert_allclose(got, GLU_ACT["swiglu"](a.astype(f64)) * up, rtol=3e-6, atol=1e-7)


# -- type errors ---------------------------------------------------------------------------------
def test_elementwise_type_errors():
    from llamir.ir import I32

    g = GraphBuilder("t", dims=["T"])
    x = g.input("x", [6, 4], F32)
    with pytest.raises(IRError, match=r"add.*cannot be repeated"):
        g.add(x, g.input("b", [4, 4], F32))           # 4 rows do not tile 6
    with pytest.raises(IRError, match=r"mul.*cannot be repeated"):
        g.mul(x, g.input("c", [2, 6, 4], F32))        # b of higher rank
    with pytest.raises(IRError, match=r"add.*cannot be repeated"):
        g.add(g.input("t", ["T", 4], F32), g.input("d", [2, 4], F32))  # 2 need not divide T
    with pytest.raises(IRError, match=r"sub.*float.*i32"):
        g.sub(x, g.input("i", [4], I32))
    with pytest.raises(IRError, match=r"silu.*float.*i32"):
        g.silu(g.input("j", [4], I32))
    with pytest.raises(IRError, match=r"swiglu.*even"):
        g.glu("swiglu", g.input("odd", [2, 5], F32))
    with pytest.raises(IRError, match=r"geglu.*shapes differ"):
        g.glu("geglu", x, g.input("e", [6, 2], F32))
    with pytest.raises(ValueError, match="not a unary"):
        g.unary("add", x)
