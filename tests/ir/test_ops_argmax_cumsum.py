"""argmax and cumsum (the ops of greedy and top-p sampling in the graph): types and errors, the
reference interpreter against plain-Python loops of ggml's recurrences, and against llama.cpp's
own libggml bit for bit (ties, -inf and NaN for argmax; long rows for cumsum)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from llamir.ir import F16, F32, I32, GraphBuilder, IRError, dims, ops, run_graph
from llamir.ir.types import TensorType
from llamir.testing.libggml import assert_same_bits

f32 = np.float32
NAN, INF = float("nan"), float("inf")


def run_op(build, x: np.ndarray, bindings: dict | None = None, shape=None) -> np.ndarray:
    """build(g, x) -> node over leaf x (declared with `shape`, default x's), run by the interpreter."""
    g = GraphBuilder("t", dims=[d for d in (shape or ()) if isinstance(d, str)])
    g.output("y", build(g, g.input("x", list(shape or x.shape), F32)))
    return run_graph(g.graph, {"x": x}, bindings or {}, n_threads=2)["y"]


def argmax_loop(row) -> int:
    """ggml_vec_argmax_f32 in plain Python: max = MAX(max, x) (C's `a > b ? a : b`), idx = i when max == x."""
    best, idx = -INF, 0
    for i, v in enumerate(float(v) for v in row):
        best = best if best > v else v
        if best == v:
            idx = i
    return idx


def cumsum_loop(row) -> list[float]:
    """ggml_vec_cumsum_f32 in plain Python, every sum rounded to f32."""
    out = [f32(row[0])]
    for v in row[1:]:
        out.append(f32(out[-1] + f32(v)))
    return out


# -- types and errors ----------------------------------------------------------------------------
def test_argmax_type_is_one_i32_per_row():
    g = GraphBuilder("t", dims=["T"])
    assert g.argmax(g.input("m", ["T", 50], F32)).type == TensorType((dims.sym("T"),), I32)
    assert g.argmax(g.input("v", [50], F32)).type == TensorType((1,), I32)      # ggml: a vector is one row
    assert g.argmax(g.input("s", [3, "T"], F32)).type == TensorType((3,), I32)


def test_cumsum_type_is_its_input_type():
    g = GraphBuilder("t", dims=["T"])
    for shape in ([7], ["T", 9], [2, "T", 3, 5]):
        x = g.input(f"x{len(shape)}", shape, F32)
        assert g.cumsum(x).type == x.type


def test_argmax_and_cumsum_errors():
    g = GraphBuilder("t", dims=["T"])
    with pytest.raises(IRError, match=r"^argmax: expects a matrix \[rows, n\] or a vector \[n\] .* got f32\[2,T,4\]$"):
        g.argmax(g.input("x3", [2, "T", 4], F32))
    with pytest.raises(IRError, match=r"^argmax: expects f32, got f16$"):
        g.argmax(g.input("h", [3, 4], F16))
    with pytest.raises(IRError, match=r"^argmax: rows of 2147483648 values do not fit an i32 index$"):
        g.argmax(g.input("wide", [1, 2**31], F32))
    with pytest.raises(IRError, match=r"^cumsum: expects f32, got i32$"):
        g.cumsum(g.input("i", [3, 4], I32))
    with pytest.raises(IRError, match=r"^cumsum: expects f32, got f16$"):
        g.cumsum(g.input("h2", [3, 4], F16))
    with pytest.raises(IRError, match=r"^argmax takes 1 inputs, got 2$"):
        g.op(ops.Argmax(), g.input("a", [3, 4], F32), g.input("b", [3, 4], F32))


# -- the interpreter against the recurrences ---------------------------------------------------------
ARGMAX_ROWS = [
    ([1, 3, 3, 2], 2),                     # equal maxima: the last
    ([7, 7, 7, 7], 3),
    ([-INF, -INF, -INF], 2),               # all -inf: the last
    ([-INF, -5, -INF], 1),
    ([0.0, -0.0, 0.0, -0.0], 3),           # zeros of both signs are equal
    ([5, NAN, 1, 0], 2),                   # a NaN restarts the maximum: 1 of the last run
    ([NAN, 2, 9, 9, NAN], 3),              # trailing NaN: the last maximum of the last run
    ([NAN, NAN, NAN], 0),                  # nothing to pick
    ([NAN, -INF], 1),
    ([3, INF, 2, INF, NAN], 3),
]


@pytest.mark.parametrize("row,want", ARGMAX_ROWS)
def test_argmax_follows_ggml_on_ties_infinities_and_nan(row, want):
    x = np.array([row], dtype=f32)
    assert argmax_loop(row) == want
    got = run_op(lambda g, a: g.argmax(a), x)
    assert got.dtype == np.int32 and got.tolist() == [want]


def test_argmax_random_rows_with_ties_against_the_loop():
    rng = np.random.default_rng(7)
    x = rng.integers(-3, 4, (40, 57)).astype(f32)
    x[rng.random(x.shape) < 0.2] = -INF
    x[rng.random(x.shape) < 0.05] = NAN
    got = run_op(lambda g, a: g.argmax(a), x, {"T": 40}, shape=("T", 57))
    assert got.tolist() == [argmax_loop(r) for r in x]


def test_argmax_of_a_vector_and_of_a_transposed_matrix():
    x = np.array([4, 9, 1, 9, 2], dtype=f32)
    assert run_op(lambda g, a: g.argmax(a), x).tolist() == [3]
    m = np.array([[1, 5], [5, 2], [5, 2]], dtype=f32)                     # columns become rows
    assert run_op(lambda g, a: g.argmax(g.transpose(a)), m).tolist() == [2, 0]


@pytest.mark.parametrize("shape", [(1,), (9,), (3, 64), (2, 3, 5), (2, 1, 3, 33)])
def test_cumsum_adds_in_order_in_f32(shape):
    x = (np.random.default_rng(len(shape)).standard_normal(shape) * 10).astype(f32)
    got = run_op(lambda g, a: g.cumsum(a), x)
    want = np.array([cumsum_loop(r) for r in x.reshape(-1, shape[-1])], dtype=f32).reshape(shape)
    assert_same_bits(got, want)


def test_cumsum_keeps_f32_rounding_and_the_first_value():
    x = np.array([[-0.0, 0.0, 1e8, 1.0, 1.0, -1e8], [NAN, 1, 2, 3, 4, 5], [INF, -INF, 1, 1, 1, 1]], dtype=f32)
    got = run_op(lambda g, a: g.cumsum(a), x)
    assert math.copysign(1.0, got[0, 0]) == -1.0                      # y[0] = x[0], not 0 + x[0]
    assert got[0, 4] == f32(1e8)                                      # 1e8 + 1 rounds back to 1e8 in f32
    assert got[0, 5] == 0.0
    assert np.isnan(got[1]).all() and got[2, 0] == INF and np.isnan(got[2, 1:]).all()


def test_cumsum_of_a_transposed_view_with_symbolic_rows():
    x = (np.random.default_rng(3).standard_normal((11, 4))).astype(f32)
    got = run_op(lambda g, a: g.cumsum(g.transpose(a)), x, {"T": 11}, shape=("T", 4))
    assert_same_bits(got, np.array([cumsum_loop(r) for r in x.T], dtype=f32))


# -- against llama.cpp's libggml --------------------------------------------------------------------
def _theirs(ggml, name: str, x: np.ndarray, n_threads: int = 2) -> np.ndarray:
    with ggml.graph(256 << 20) as g:
        return g.compute(g.op(name, g.tensor(x)), n_threads)


def logits_with_ties(rng, rows: int, n: int) -> np.ndarray:
    """Logits quantized to a few values (ties everywhere), some masked to -inf, one row all -inf,
    one all equal, NaNs sprinkled into the last rows."""
    x = np.round(rng.normal(0, 2, (rows, n))).astype(f32)
    x[rng.random(x.shape) < 0.25] = -INF
    x[0] = -INF
    x[1] = 3.0
    x[-3:][rng.random((3, n)) < 0.1] = NAN
    x[-1, -1] = NAN
    return x


@pytest.mark.llama_cpp
@pytest.mark.parametrize("rows,n", [(1, 32), (9, 301), (12, 1024), (3, 32000)])
def test_argmax_equals_ggml(ggml, rows, n):
    x = logits_with_ties(np.random.default_rng(n), rows, n) if rows > 2 else \
        np.round(np.random.default_rng(n).normal(0, 1, (rows, n))).astype(f32)
    want = _theirs(ggml, "ggml_argmax", x)
    got = run_op(lambda g, a: g.argmax(a), x, {"T": rows}, shape=("T", n))
    assert got.dtype == want.dtype == np.int32
    np.testing.assert_array_equal(got, want)


@pytest.mark.llama_cpp
@pytest.mark.parametrize("row,_", ARGMAX_ROWS)
def test_argmax_edge_rows_equal_ggml(ggml, row, _):
    x = np.array([row], dtype=f32)
    np.testing.assert_array_equal(run_op(lambda g, a: g.argmax(a), x), _theirs(ggml, "ggml_argmax", x))


@pytest.mark.llama_cpp
def test_argmax_of_a_vector_equals_ggml(ggml):
    x = np.round(np.random.default_rng(1).normal(0, 1, 77)).astype(f32)
    want = _theirs(ggml, "ggml_argmax", x)
    assert want.shape == (1,)
    np.testing.assert_array_equal(run_op(lambda g, a: g.argmax(a), x), want)


@pytest.mark.llama_cpp
@pytest.mark.parametrize("shape", [(3, 4, 5, 10), (2, 3, 4, 127), (7, 1024), (4, 20481), (201 * 1204,)])
def test_cumsum_equals_ggml(ggml, shape):
    """Softmax-like positive rows (top-p's cumulative probabilities) and signed ones, long rows
    where f32 rounding of the running sum shows."""
    rng = np.random.default_rng(sum(shape))
    for x in (rng.uniform(-1, 1, shape).astype(f32), (rng.exponential(1, shape) / shape[-1]).astype(f32)):
        assert_same_bits(run_op(lambda g, a: g.cumsum(a), x), _theirs(ggml, "ggml_cumsum", x, n_threads=3))


@pytest.mark.llama_cpp
def test_cumsum_specials_equal_ggml(ggml):
    x = np.array([[-0.0, 0.0, 1e8, 1.0, 1.0, -1e8], [NAN, 1, 2, 3, 4, 5], [INF, -INF, 1, 1, 1, 1],
                  [1e-45, 1e-45, -1e-45, 3e38, 3e38, -INF]], dtype=f32)
    got, want = run_op(lambda g, a: g.cumsum(a), x), _theirs(ggml, "ggml_cumsum", x)
    assert_same_bits(got, want)                 # NaN bits too: the input's quiet NaN, inf - inf's default NaN
    assert math.copysign(1.0, want[0, 0]) == -1.0
