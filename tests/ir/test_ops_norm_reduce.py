"""Normalisations, reductions and orderings of the reference interpreter against closed-form
numpy (float64) formulas and plain-Python sorts."""

from __future__ import annotations

import numpy as np
import pytest

from llamir.ir import F16, F32, I32, GraphBuilder, IRError, ops, run_graph

f32, f64 = np.float32, np.float64
SHAPES = [(1, 1), (1, 7), (3, 64), (2, 3, 5), (2, 1, 3, 33)]


def run_op(op: ops.Op, x: np.ndarray, dtype=F32, permute: tuple[int, ...] | None = None) -> np.ndarray:
    """Apply `op` to leaf x (optionally through a permute view)."""
    b = GraphBuilder("t")
    v = b.input("x", x.shape, dtype)
    if permute is not None:
        v = b.permute(v, *permute)
    b.output("y", b.op(op, v))
    return run_graph(b.graph, {"x": x})["y"]


def _x(shape, seed, offset=0.0):
    return (np.random.default_rng(seed).standard_normal(shape) * 2 + offset).astype(f32)


# -- row normalisations --------------------------------------------------------------------------
def rms_norm_ref(x, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def norm_ref(x, eps):
    centred = x - x.mean(axis=-1, keepdims=True)
    return centred / np.sqrt(np.mean(centred**2, axis=-1, keepdims=True) + eps)


def l2_norm_ref(x, eps):
    return x / np.maximum(np.sqrt(np.sum(x * x, axis=-1, keepdims=True)), eps)


ROW_NORMS = [(ops.RmsNorm, rms_norm_ref), (ops.Norm, norm_ref), (ops.L2Norm, l2_norm_ref)]


@pytest.mark.parametrize("cls,ref", ROW_NORMS, ids=lambda v: getattr(v, "name", ""))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("eps", [1e-6, 0.5])
def test_row_norms(cls, ref, shape, eps, nmse):
    x = _x(shape, len(shape), offset=0.7)
    got = run_op(cls(eps=eps), x)
    want = ref(x.astype(f64), eps)
    assert got.dtype == f32 and got.shape == shape
    if shape[-1] == 1 and cls is ops.Norm:
        np.testing.assert_array_equal(got, 0)   # a one-element row is all mean
    else:
        assert nmse(got, want) < 1e-12


@pytest.mark.parametrize("cls,ref", ROW_NORMS, ids=lambda v: getattr(v, "name", ""))
@pytest.mark.parametrize("n_tokens", [1, 3, 7])
def test_row_norms_symbolic_and_permuted(cls, ref, n_tokens, nmse):
    x = _x((5, n_tokens, 9), n_tokens)
    g = GraphBuilder("t", dims=["T"])
    v = g.permute(g.input("x", [5, "T", 9], F32), 1, 0, 2)    # [T, 5, 9], strided
    g.output("y", g.op(cls(eps=1e-5), v))
    got = run_graph(g.graph, {"x": x}, {"T": n_tokens})["y"]
    assert nmse(got, ref(np.transpose(x, (1, 0, 2)).astype(f64), 1e-5)) < 1e-12


def test_l2_norm_eps_floor_and_zero_row():
    x = np.array([[0.0, 0.0, 0.0], [3e-3, 4e-3, 0.0], [3.0, 4.0, 0.0]], dtype=f32)
    got = run_op(ops.L2Norm(eps=0.01), x)
    # row 1 has norm 5e-3 < eps: divided by eps, not normalised to unit length
    np.testing.assert_allclose(got, [[0, 0, 0], [0.3, 0.4, 0], [0.6, 0.8, 0]], rtol=1e-6)


def test_norm_of_f16_input_rounds_result(nmse):
    x = _x((3, 16), 3).astype(np.float16)
    got = run_op(ops.RmsNorm(eps=1e-6), x, dtype=F16)
    assert got.dtype == np.float16
    assert nmse(got, rms_norm_ref(x.astype(f64), 1e-6)) < 1e-6   # f16 output: ~2^-11 relative


def group_norm_ref(x, n_groups, eps):
    """ggml_group_norm: groups of ceil(C / n_groups) channels (axis -3), each normalised over
    (its channels, L, W), separately for every outer batch index."""
    channels = x.shape[-3]
    per_group = -(-channels // n_groups)
    y = np.empty_like(x)
    for group in range(n_groups):
        lo, hi = group * per_group, min((group + 1) * per_group, channels)
        if lo >= hi:
            continue
        part = x[..., lo:hi, :, :]
        mean = part.mean(axis=(-3, -2, -1), keepdims=True)
        var = ((part - mean) ** 2).mean(axis=(-3, -2, -1), keepdims=True)
        y[..., lo:hi, :, :] = (part - mean) / np.sqrt(var + eps)
    return y


@pytest.mark.parametrize("shape,n_groups", [((6, 2, 3), 3), ((5, 3, 4), 2), ((2, 5, 1, 7), 4),
                                            ((1, 4, 3, 3), 1), ((2, 3, 2, 2), 3)])
def test_group_norm(shape, n_groups, nmse):
    x = _x(shape, sum(shape), offset=1.5)
    got = run_op(ops.GroupNorm(n_groups=n_groups, eps=1e-5), x)
    assert nmse(got, group_norm_ref(x.astype(f64), n_groups, 1e-5)) < 1e-12


def test_group_norm_through_permute(nmse):
    x = _x((4, 3, 6, 2), 21)                   # [B, L, C, W] read as [B, C, L, W]
    got = run_op(ops.GroupNorm(n_groups=2, eps=1e-6), x, permute=(0, 2, 1, 3))
    assert nmse(got, group_norm_ref(np.transpose(x, (0, 2, 1, 3)).astype(f64), 2, 1e-6)) < 1e-12


# -- reductions ----------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES)
def test_sum_rows_mean_sum(shape, nmse):
    x = _x(shape, len(shape) + 30, offset=0.3)
    x64 = x.astype(f64)
    got_rows = run_op(ops.SumRows(), x)
    got_mean = run_op(ops.Mean(), x)
    got_sum = run_op(ops.Sum(), x)
    assert got_rows.shape == got_mean.shape == shape[:-1] + (1,)
    assert got_sum.shape == (1,)
    assert nmse(got_rows, x64.sum(axis=-1, keepdims=True)) < 1e-13
    assert nmse(got_mean, x64.mean(axis=-1, keepdims=True)) < 1e-13
    assert nmse(got_sum, np.array([x64.sum()])) < 1e-13


@pytest.mark.parametrize("n_tokens", [1, 3, 7])
def test_reductions_symbolic_transposed(n_tokens, nmse):
    x = _x((6, n_tokens), n_tokens)
    g = GraphBuilder("t", dims=["T"])
    xt = g.transpose(g.input("x", [6, "T"], F32))        # [T, 6]
    g.output("rows", g.sum_rows(xt))
    g.output("mean", g.mean(xt))
    g.output("sum", g.op(ops.Sum(), xt))
    out = run_graph(g.graph, {"x": x}, {"T": n_tokens})
    assert nmse(out["rows"], x.T.astype(f64).sum(-1, keepdims=True)) < 1e-13
    assert nmse(out["mean"], x.T.astype(f64).mean(-1, keepdims=True)) < 1e-13
    assert nmse(out["sum"], [x.astype(f64).sum()]) < 1e-13


def test_sum_is_accurate_on_cancelling_values():
    x = np.array([[1e8, 1.0, -1e8, 1.0, 0.5]], dtype=f32)   # an f32 running sum gets 0.5 or 1.5
    assert run_op(ops.SumRows(), x)[0, 0] == 2.5
    assert run_op(ops.Sum(), x)[0] == 2.5


# -- orderings -----------------------------------------------------------------------------------
def stable_argsort_rows(x: np.ndarray, descending: bool) -> np.ndarray:
    """Plain-Python stable sort of each row's indices (ties keep index order)."""
    rows = x.reshape(-1, x.shape[-1])
    out = [sorted(range(len(r)), key=lambda i, r=r: (-r[i] if descending else r[i], i)) for r in rows]
    return np.array(out, dtype=np.int32).reshape(x.shape)


@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("shape", [(1, 1), (1, 9), (4, 17), (2, 3, 6), (2, 2, 2, 5)])
def test_argsort(descending, shape):
    rng = np.random.default_rng(len(shape))
    x = rng.integers(-4, 5, shape).astype(f32)          # many ties
    x += (rng.random(shape) < 0.5) * f32(0.25)
    got = run_op(ops.Argsort(descending=descending), x)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, stable_argsort_rows(x, descending))


def test_argsort_of_transposed_input():
    x = _x((7, 3), 40)
    got = run_op(ops.Argsort(descending=True), x, permute=(1, 0))
    np.testing.assert_array_equal(got, stable_argsort_rows(x.T, True))


@pytest.mark.parametrize("k", [1, 2, 5, 9])
@pytest.mark.parametrize("shape", [(1, 9), (3, 9), (2, 2, 9)])
def test_top_k_distinct_values(k, shape):
    x = np.random.default_rng(k).permutation(np.prod(shape)).astype(f32).reshape(shape)
    got = run_op(ops.TopK(k=k), x)
    assert got.dtype == np.int32 and got.shape == shape[:-1] + (k,)
    want = stable_argsort_rows(x, descending=True)[..., :k]
    np.testing.assert_array_equal(got, want)


def test_top_k_with_ties_returns_the_largest_values():
    x = np.array([[1, 3, 3, 2, 3, 0], [5, 5, 5, 5, 5, 5]], dtype=f32)
    got = run_op(ops.TopK(k=3), x)
    np.testing.assert_array_equal(np.take_along_axis(x, got, -1), [[3, 3, 3], [5, 5, 5]])
    assert all(len(set(row)) == 3 for row in got.tolist())


# -- type errors ---------------------------------------------------------------------------------
def test_norm_reduce_type_errors():
    g = GraphBuilder("t", dims=["T"])
    ints = g.input("i", [3, 4], I32)
    with pytest.raises(IRError, match=r"rms_norm.*float.*i32"):
        g.rms_norm(ints, 1e-6)
    with pytest.raises(IRError, match=r"group_norm.*rank >= 3"):
        g.op(ops.GroupNorm(n_groups=2), g.input("x", [4, 6], F32))
    with pytest.raises(IRError, match=r"sum_rows.*float"):
        g.sum_rows(ints)
    with pytest.raises(IRError, match=r"argsort.*f32.*f16"):
        g.argsort(g.input("h", [3, 4], F16))
    with pytest.raises(IRError, match=r"top_k.*k=5 outside 1..4"):
        g.top_k(g.input("s", [3, 4], F32), 5)
    with pytest.raises(IRError, match=r"top_k.*k=0"):
        g.top_k(g.input("s2", ["T", 4], F32), 0)
