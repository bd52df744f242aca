"""Element-wise ops, copies and norms reading views whose last stride is not the element size
(transpose, permute, a strided view), on the host target and on the AVX2-only one, bit-exact
against the numpy interpreter in the backend's numerics profile. Rows of a whole vector or more
(16 f32 lanes on AVX-512, 8 on AVX2) once took a contiguous vector load from such a view."""

from __future__ import annotations

import numpy as np
import pytest
from shared_backends import shared_backend

from llamir.backends.llvm.target import avx2_only_target
from llamir.ir import BF16, F16, F32, GraphBuilder, run_graph

# (numerics profile, target): the host's AVX-512 code, and AVX2-only code with ggml's 8-lane chunks
TARGETS = {"host": (None, None), "avx2": ("avx2", "avx2")}
# the transposed view's rows: shorter than both vector widths, then spanning one or more vectors
SHAPES = [(3, 5), (5, 3), (9, 4), (2, 6, 19), (19, 6), (2, 19, 6), (17, 16), (16, 17), (40, 9)]


def _backend(target: str):
    numerics, isa = TARGETS[target]
    return shared_backend(numerics, avx2_only_target() if isa == "avx2" else None)


def _values(shape, dtype, seed: int, lo: float = -3.0, hi: float = 3.0) -> np.ndarray:
    x = np.random.default_rng(seed).uniform(lo, hi, shape).astype(np.float32)
    if dtype == F16:
        return x.astype(np.float16)
    if dtype == BF16:
        return (x.view(np.uint32) >> 16).astype(np.uint16)
    return x


def _check(target: str, b: GraphBuilder, values: dict, bindings: dict | None = None) -> None:
    """Every output bit-identical to the reference's (NaNs where it has NaNs)."""
    numerics = TARGETS[target][0]
    want = run_graph(b.graph, dict(values), bindings, numerics=numerics)
    got = _backend(target).compile(b.graph)(dict(values), bindings or {})
    for name, w in want.items():
        g = got[name]
        assert g.shape == w.shape and g.dtype == w.dtype, (name, g.shape, w.shape, g.dtype, w.dtype)
        same = (g == w) | (np.isnan(g) & np.isnan(w)) if g.dtype.kind == "f" else g == w
        assert same.all(), f"{name}: {int((~same).sum())} of {same.size} values differ"


@pytest.fixture(params=list(TARGETS))
def target(request) -> str:
    return request.param


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("op", ["neg", "exp", "silu", "sqr", "abs"])
def test_unary_of_transpose(target, op, shape):
    b = GraphBuilder("g")
    x = b.input("x", shape, F32)
    b.output("y", b.unary(op, b.transpose(x)))
    _check(target, b, {"x": _values(shape, F32, 1)})


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_scale_cont_and_sub_of_transpose(target, shape):
    """scale, a plain copy (cont) and sub with a transposed and a contiguous operand."""
    t_shape = shape[:-2] + (shape[-1], shape[-2])
    b = GraphBuilder("g")
    x, y = b.input("x", shape, F32), b.input("y", t_shape, F32)
    t = b.transpose(x)
    b.output("scale", b.scale(t, 0.5, 0.25))
    b.output("cont", b.cont(t))
    b.output("sub", b.sub(t, y))
    b.output("rsub", b.sub(y, t))
    _check(target, b, {"x": _values(shape, F32, 2), "y": _values(t_shape, F32, 3)})


@pytest.mark.parametrize("shape", [(19, 6), (17, 16), (40, 9)], ids=str)
def test_binary_of_transpose_broadcasts(target, shape):
    """A transposed operand against a row, a column, a tiled (ggml repeat) operand, and itself;
    and a transposed operand that is the one broadcast."""
    rows, cols = shape[1], shape[0]
    b = GraphBuilder("g")
    x = b.input("x", shape, F32)
    t = b.transpose(x)                                          # [rows, cols]
    row, col = b.input("row", [cols], F32), b.input("col", [rows, 1], F32)
    tile = b.input("tile", [1, cols // 2 if cols % 2 == 0 else cols], F32)
    b.output("add_row", b.add(t, row))
    b.output("mul_col", b.mul(t, col))
    b.output("div_tile", b.div(t, tile))
    b.output("both", b.mul(t, b.transpose(b.scale(x, 2.0))))
    wide = b.input("wide", [2 * rows, cols], F32)
    b.output("tiled_t", b.add(wide, t))                          # t repeats along the rows
    _check(target, b, {"x": _values(shape, F32, 4), "row": _values((cols,), F32, 5),
                       "col": _values((rows, 1), F32, 6),
                       "tile": _values((1, cols // 2 if cols % 2 == 0 else cols), F32, 7, 0.5, 3.0),
                       "wide": _values((2 * rows, cols), F32, 8)})


@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
@pytest.mark.parametrize("shape", [(9, 4), (19, 6), (17, 16), (2, 19, 6)], ids=str)
def test_half_types_of_transpose(target, dtype, shape):
    """f16 / bf16 views: element-wise in the view's type, casts to f32, and copies."""
    b = GraphBuilder("g")
    x = b.input("x", shape, dtype)
    t = b.transpose(x)
    b.output("neg", b.unary("neg", t))
    b.output("silu", b.silu(t))
    b.output("f32", b.cast(t, F32))
    b.output("cont", b.cont(t))
    _check(target, b, {"x": _values(shape, dtype, 9)})


def test_permute_and_strided_view(target):
    """A permute whose last axis is an outer one, and the transpose of a view with gaps between its
    rows and an offset (a view's own last stride is the element size)."""
    b = GraphBuilder("g")
    x = b.input("x", [2, 17, 3, 5], F32)
    p = b.permute(x, 0, 2, 3, 1)                               # last axis strides over x's 17
    b.output("p_neg", b.unary("neg", p))
    b.output("p_add", b.add(p, b.input("r", [17], F32)))
    b.output("p_cont", b.cont(p))
    v = b.input("v", [20, 40], F32)
    gaps = b.transpose(b.view(v, [20, 6], [160, 4], 12))       # [6, 20], inner stride 160
    b.output("v_scale", b.scale(gaps, 3.0))
    b.output("v_mul", b.mul(gaps, gaps))
    _check(target, b, {"x": _values((2, 17, 3, 5), F32, 10), "r": _values((17,), F32, 11),
                       "v": _values((20, 40), F32, 12)})


@pytest.mark.parametrize("dims", ["rows", "cols"])
def test_transpose_of_dynamic_shape(target, dims):
    """A run-time dim as the transposed rows (a static inner stride) or as its stride."""
    b = GraphBuilder("g", dims=["T"])
    shape = ["T", 16] if dims == "rows" else [16, "T"]
    x = b.input("x", shape, F32)
    b.output("y", b.silu(b.scale(b.transpose(x), 2.0)))
    concrete = tuple(19 if d == "T" else d for d in shape)
    _check(target, b, {"x": _values(concrete, F32, 13)}, {"T": 19})


@pytest.mark.parametrize("shape", [(19, 6), (17, 16), (40, 9)], ids=str)
def test_norms_of_transpose(target, shape):
    """norm's vector-chunked variance reads its rows in vectors too."""
    b = GraphBuilder("g")
    t = b.transpose(b.input("x", shape, F32))
    b.output("norm", b.norm(t, 1e-5))
    b.output("rms", b.rms_norm(t, 1e-6))
    _check(target, b, {"x": _values(shape, F32, 14)})
