"""ssm_conv and ssm_scan in the IR: shapes (symbolic batches included), ggml's shape asserts as
clear errors, the text round trip, and the reference interpreter against float64 closed forms
(the conv sums, the selective-scan recurrence, the rollback snapshots) and ggml's layout asserts."""

from __future__ import annotations

import numpy as np
import pytest

from llamir.ir import F16, F32, I32, GraphBuilder, IRError, dims, parse_graph, print_graph, run_graph, verify
from llamir.ir.dims import sym
from llamir.ir.interp import InterpError

f32, f64 = np.float32, np.float64


def scan_graph(n_rs=3, n_head=4, head_dim=2, d_state=8, n_group=2, n_t=5, n_s=2, a_cols=1, K=1, dims_=()):
    """ssm_scan over inputs of these sizes (strings are symbolic dims)."""
    b = GraphBuilder("scan", dims=list(dims_))
    s = b.input("s", [n_rs, n_head, head_dim, d_state], F32)
    x = b.input("x", [n_s, n_t, n_head, head_dim], F32)
    dt = b.input("dt", [n_s, n_t, n_head], F32)
    A = b.weight("A", [n_head, a_cols], F32)
    B = b.input("B", [n_s, n_t, n_group, d_state], F32)
    C = b.input("C", [n_s, n_t, n_group, d_state], F32)
    y = b.ssm_scan(s, x, dt, A, B, C, b.input("ids", [n_s], I32), K=K)
    b.output("y", y)
    return b.graph, y


# -- shapes ---------------------------------------------------------------------------------------------
def test_ssm_conv_shape():
    b = GraphBuilder("conv", dims=["S"])
    y = b.ssm_conv(b.input("sx", ["S", 6, 3 + 5], F32), b.weight("c", [6, 4], F32))
    assert y.type.shape == (dims.sym("S"), 5, 6) and y.dtype == F32
    one = b.ssm_conv(b.input("sx1", [2, 6, 3], F32), b.weight("c1", [6, 4], F32))
    assert one.type.shape == (2, 0, 6)                   # a window of d_conv - 1 columns holds no token


@pytest.mark.parametrize("a_cols,K,n_t,want", [
    (8, 1, 5, 2 * 5 * 4 * 2 + 2 * 4 * 2 * 8),           # Mamba-1: y, then the last states
    (1, 1, 5, 2 * 5 * 4 * 2 + 2 * 4 * 2 * 8),           # Mamba-2
    (1, 3, 1, 2 * 1 * 4 * 2 + 3 * 2 * 4 * 2 * 8),       # K state blocks
])
def test_ssm_scan_shape(a_cols, K, n_t, want):
    _, y = scan_graph(a_cols=a_cols, K=K, n_t=n_t)
    assert y.type.shape == (want,) and y.dtype == F32


def test_ssm_scan_symbolic_batch_and_slots():
    graph, y = scan_graph(n_rs="R", n_s="S", K=2, dims_=("S", "R"))
    assert str(y.type) == f"f32[{5 * 4 * 2 + 2 * 4 * 2 * 8}*S]"
    verify(graph)


def test_symbolic_tokens_give_sums():
    """A window of T+3 columns holds T tokens; the scan's result is y then the states: 16*T+128."""
    b = GraphBuilder("conv", dims=["T"])
    y = b.ssm_conv(b.input("sx", [2, 6, dims.add(sym("T"), 3)], F32), b.weight("c", [6, 4], F32))
    assert str(y.type) == "f32[2,T,6]"
    b = GraphBuilder("scan", dims=["T"])
    shapes = {"s": [3, 4, 2, 8], "x": [2, "T", 4, 2], "dt": [2, "T", 4], "A": [4, 1], "B": [2, "T", 2, 8],
              "C": [2, "T", 2, 8], "ids": [2]}
    out = b.ssm_scan(*(b.input(n, shape, I32 if n == "ids" else F32) for n, shape in shapes.items()))
    assert str(out.type) == "f32[16*T+128]"


def test_text_round_trip():
    graph, _ = scan_graph(n_rs="R", n_s="S", K=3, dims_=("S", "R"))
    b = GraphBuilder("conv", dims=["S"])
    b.output("y", b.ssm_conv(b.input("sx", ["S", 6, 7], F32), b.weight("c", [6, 4], F32), name=("conv", 2)))
    for g in (graph, b.graph):
        text = print_graph(g)
        parsed = parse_graph(text)
        assert print_graph(parsed) == text and parsed == g
    assert "ssm_scan(%0, %1, %2, %3, %4, %5, %6) {K=3} : f32[" in print_graph(graph)
    assert '= ssm_conv(%0, %1) : f32[S,4,6] "conv-2"' in print_graph(b.graph)


# -- ggml's asserts as errors ----------------------------------------------------------------------------
@pytest.mark.parametrize("sx,c,message", [
    (([2, 6, 8], F16), ([6, 4], F32), r"sx must be f32, got f16\[2,6,8\]"),
    (([6, 8], F32), ([6, 4], F32), r"sx must be \[n_s, d_inner, d_conv - 1 \+ n_t\], got f32\[6,8\]"),
    (([2, 6, 8], F32), ([1, 6, 4], F32), r"c must be \[d_inner, d_conv\], got f32\[1,6,4\]"),
    (([2, 5, 8], F32), ([6, 4], F32), r"sx f32\[2,5,8\] has 5 channels but c f32\[6,4\] has 6"),
    (([2, 6, 2], F32), ([6, 4], F32), r"a window of 2 columns is shorter than d_conv - 1 = 3"),
    (([2, 6, "T"], F32), ([6, 4], F32), r"a window of T columns holds n_t = T-3 tokens, which is not a size"),
])
def test_ssm_conv_rejects(sx, c, message):
    b = GraphBuilder("conv", dims=["T"])
    with pytest.raises(IRError, match="ssm_conv: " + message):
        b.ssm_conv(b.input("sx", *sx), b.weight("c", *c))


def _bad_scan(**change):
    shapes = {"s": [3, 4, 2, 8], "x": [2, 5, 4, 2], "dt": [2, 5, 4], "A": [4, 1], "B": [2, 5, 2, 8],
              "C": [2, 5, 2, 8], "ids": [2]}
    dtypes = {name: (I32 if name == "ids" else F32) for name in shapes}
    K = change.pop("K", 1)
    for name, value in change.items():
        shapes[name], dtypes[name] = value if isinstance(value, tuple) else (value, dtypes[name])
    b = GraphBuilder("scan", dims=["T"])
    b.ssm_scan(*(b.input(name, shapes[name], dtypes[name]) for name in shapes), K=K)


@pytest.mark.parametrize("change,message", [
    ({"K": 0}, r"K = 0 must be in \[1, 2147483647\]"),
    ({"x": ([2, 5, 4, 2], F16)}, r"x must be f32, got f16\[2,5,4,2\]"),
    ({"s": [3, 4, 8]}, r"s must be \[n_rs, n_head, head_dim, d_state\], got f32\[3,4,8\]"),
    ({"s": [3, 4, 3, 8]}, r"s f32\[3,4,3,8\] does not hold states of x's heads f32\[2,5,4,2\]"),
    ({"dt": [2, 4, 4]}, r"dt must be \[n_s, n_t, n_head\] = \[2,5,4\], got f32\[2,4,4\]"),
    ({"B": [2, 5, 1, 8]}, r"B f32\[2,5,1,8\] and C f32\[2,5,2,8\] differ"),
    ({"B": [2, 5, 2, 4], "C": [2, 5, 2, 4]}, r"B and C must be \[n_s, n_t, n_group, d_state\] = \[2,5,n_group,8\]"),
    ({"B": [2, 5, 3, 8], "C": [2, 5, 3, 8]}, r"n_group 3 does not divide n_head 4"),
    ({"ids": ([2], F32)}, r"ids must be i32 \[2\], got f32\[2\]"),
    ({"ids": [3]}, r"ids must be i32 \[2\], got i32\[3\]"),
    ({"A": [4, 4]}, r"A f32\[4,4\] must be \[4, 8\] \(Mamba-1\) or \[4, 1\] \(Mamba-2\)"),
    ({"A": [8]}, r"A must be \[n_head, d_state\] or \[n_head, 1\], got f32\[8\]"),
    ({"A": [4, 8], "K": 2}, r"K = 2: state snapshots need Mamba-2's A \[n_head, 1\]"),
])
def test_ssm_scan_rejects(change, message):
    with pytest.raises(IRError, match="ssm_scan: " + message):
        _bad_scan(**change)


# -- the reference against closed forms -------------------------------------------------------------------
def test_ssm_conv_against_the_sums():
    rng = np.random.default_rng(1)
    sx, c = rng.standard_normal((3, 7, 4 + 6)).astype(f32), rng.standard_normal((7, 5)).astype(f32)
    b = GraphBuilder("conv")
    b.output("y", b.ssm_conv(b.input("sx", [3, 7, 10], F32), b.weight("c", [7, 5], F32)))
    got = run_graph(b.graph, {"sx": sx, "c": c})["y"]
    want = np.stack([np.einsum("sik,ik->si", sx[:, :, t:t + 5].astype(f64), c.astype(f64)) for t in range(6)], 1)
    assert got.shape == (3, 6, 7)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def scan_float64(s, x, dt, A, B, C, ids, K):
    """The selective scan in float64, state by state (the closed form of ssm_scan's docstring)."""
    n_s, n_t, n_head, head_dim = x.shape
    group = np.arange(n_head) // (n_head // B.shape[2])
    h = s[ids].astype(f64)
    y = np.zeros(x.shape)
    blocks = np.zeros((K,) + h.shape)
    for t in range(n_t):
        d = np.where(dt[:, t] > 20, dt[:, t], np.log1p(np.exp(dt[:, t].astype(f64))))          # [n_s, H]
        decay = np.exp(d[:, :, None, None] * A[None, :, None, :])
        h = h * decay + B[:, t][:, group, None, :] * (x[:, t] * d[:, :, None])[..., None]
        y[:, t] = np.einsum("shik,shk->shi", h, C[:, t][:, group])
        if 0 < n_t - 1 - t < K:
            blocks[n_t - 1 - t] = h
    blocks[0] = h
    return np.concatenate([y.ravel(), blocks.ravel()])


def scan_values(rng, n_rs, n_head, head_dim, d_state, n_group, n_t, n_s, a_cols, ids):
    return {"s": rng.standard_normal((n_rs, n_head, head_dim, d_state)).astype(f32),
            "x": rng.standard_normal((n_s, n_t, n_head, head_dim)).astype(f32),
            "dt": rng.uniform(-3, 25, (n_s, n_t, n_head)).astype(f32),       # both sides of softplus' 20
            "A": rng.uniform(-1, -0.5, (n_head, a_cols)).astype(f32),
            "B": rng.standard_normal((n_s, n_t, n_group, d_state)).astype(f32),
            "C": rng.standard_normal((n_s, n_t, n_group, d_state)).astype(f32),
            "ids": np.array(ids, np.int32)}


@pytest.mark.parametrize("d_state,head_dim,a_cols,K,n_t", [
    (16, 1, 16, 1, 6),        # Mamba-1
    (80, 4, 1, 1, 6),         # Mamba-2: a vector step and a scalar tail
    (16, 4, 1, 3, 6),         # snapshots 1 and 2 tokens back
    (16, 4, 1, 4, 2),         # more blocks than tokens: blocks 2 and 3 stay zero
])
def test_ssm_scan_against_the_recurrence(nmse, d_state, head_dim, a_cols, K, n_t):
    rng = np.random.default_rng(d_state + K)
    sizes = dict(n_rs=4, n_head=6, head_dim=head_dim, d_state=d_state, n_group=3, n_t=n_t, n_s=3)
    graph, _ = scan_graph(a_cols=a_cols, K=K, **sizes)
    values = scan_values(rng, a_cols=a_cols, ids=[2, 0, 3], **sizes)
    got = run_graph(graph, values)["y"]
    want = scan_float64(*values.values(), K=K)
    assert got.shape == want.shape
    assert nmse(got, want) < 1e-12
    n_state = 3 * 6 * head_dim * d_state
    if K > n_t:
        assert not got[-(K - n_t) * n_state:].any()


# -- ggml's layout asserts, where the interpreter sees the strides -------------------------------------------
def test_ssm_scan_refuses_x_with_strided_rows():
    b = GraphBuilder("scan")
    xt = b.transpose(b.input("xt", [2, 5, 2, 4], F32))                      # [2, 5, 4, 2], heads not packed
    ins = {n: b.input(n, shape, F32) for n, shape in (("s", [3, 4, 2, 8]), ("dt", [2, 5, 4]), ("B", [2, 5, 2, 8]),
                                                        ("C", [2, 5, 2, 8]))}
    A = b.weight("A", [4, 1], F32)
    b.output("y", b.ssm_scan(ins["s"], xt, ins["dt"], A, ins["B"], ins["C"], b.input("ids", [2], I32)))
    values = scan_values(np.random.default_rng(0), 3, 4, 2, 8, 2, 5, 2, 1, [0, 1])
    values["xt"] = np.ascontiguousarray(values.pop("x").swapaxes(-1, -2))
    with pytest.raises(InterpError, match=r"ssm_scan's x needs its last 2 axes contiguous \(ggml's stride asserts\)"):
        run_graph(b.graph, values)


def test_ssm_conv_refuses_unpacked_channel_rows():
    b = GraphBuilder("conv")
    sx = b.view(b.input("big", [2, 6, 10], F32), [2, 6, 8], [240, 40, 4], 0)   # rows of 8 in rows of 10
    b.output("y", b.ssm_conv(sx, b.weight("c", [6, 4], F32)))
    values = {"big": np.zeros((2, 6, 10), f32), "c": np.zeros((6, 4), f32)}
    with pytest.raises(InterpError, match=r"ssm_conv's sx needs its last 2 axes contiguous"):
        run_graph(b.graph, values)


def test_ssm_scan_refuses_a_state_id_out_of_range():
    graph, _ = scan_graph()
    values = scan_values(np.random.default_rng(0), 3, 4, 2, 8, 2, 5, 2, 1, [1, 3])
    with pytest.raises(InterpError, match=r"ssm_scan state id 3 at \[1\] is outside \[0, 3\)"):
        run_graph(graph, values)
