"""ssm_conv and ssm_scan of the reference interpreter against libggml's CPU backend, bit for bit.

Both of ggml's scan paths are met: Mamba-1 (A [n_head, d_state], libm's expf per state, sequential
dots) and Mamba-2 (A [n_head, 1]: the profile's four vector accumulators over whole steps, then a
scalar tail), with groups, ids picking states out of more slots, one token and many, x/B/C as
views of one projection (llama.cpp's layouts), and K > 1 rollback snapshots (the blocks ggml
writes: those of fewer than n_t tokens back). The interpreter runs the oracle build's profile.
"""

from __future__ import annotations

import numpy as np
import pytest

from llamir.ir import F32, I32, GraphBuilder, run_graph
from llamir.testing.libggml import assert_same_bits
from llamir.testing.llama_cpp import oracle_numerics

pytestmark = pytest.mark.llama_cpp
f32 = np.float32


# -- ssm_conv ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("d_conv,d_inner,n_t,n_s", [(4, 64, 1, 1), (4, 64, 7, 3), (3, 37, 64, 2), (9, 16, 5, 4),
                                                   (20, 8, 3, 2)])
def test_ssm_conv_matches_ggml(ggml, d_conv, d_inner, n_t, n_s):
    rng = np.random.default_rng(d_conv * n_t)
    sx = rng.uniform(-1, 1, (n_s, d_inner, d_conv - 1 + n_t)).astype(f32)
    c = rng.uniform(-1, 1, (d_inner, d_conv)).astype(f32)
    b = GraphBuilder("conv")
    b.output("y", b.ssm_conv(b.input("sx", list(sx.shape), F32), b.weight("c", list(c.shape), F32)))
    got = run_graph(b.graph, {"sx": sx, "c": c})["y"]
    with ggml.graph() as g:
        want = g.compute(g.op("ggml_ssm_conv", g.tensor(sx), g.tensor(c)), n_threads=2)
    assert got.shape == (n_s, n_t, d_inner)
    assert_same_bits(got, want)                        # (ggml's read drops outer axes of 1)


def test_ssm_conv_of_a_strided_window_matches_ggml(ggml):
    """Sequences of sx two windows apart in memory (ggml reads sx by its nb[2])."""
    rng = np.random.default_rng(5)
    big = rng.uniform(-1, 1, (6, 24, 3 + 6)).astype(f32)
    c = rng.uniform(-1, 1, (24, 4)).astype(f32)
    seq, chan = 24 * 9 * 4, 9 * 4
    b = GraphBuilder("conv")
    sx = b.view(b.input("big", list(big.shape), F32), [3, 24, 9], [2 * seq, chan, 4], seq)
    b.output("y", b.ssm_conv(sx, b.weight("c", [24, 4], F32)))
    got = run_graph(b.graph, {"big": big, "c": c})["y"]
    with ggml.graph() as g:
        view = g.op("ggml_view_3d", g.tensor(big), g.i64(9), g.i64(24), g.i64(3), g.size(chan), g.size(2 * seq),
                    g.size(seq))
        want = g.compute(g.op("ggml_ssm_conv", view, g.tensor(c)), n_threads=2)
    assert_same_bits(got, want)


# -- ssm_scan ------------------------------------------------------------------------------------------
def scan_inputs(rng, n_rs, n_head, head_dim, d_state, n_group, n_t, n_s, mamba2, ids):
    return {"s": rng.uniform(-1, 1, (n_rs, n_head, head_dim, d_state)).astype(f32),
            "x": rng.uniform(-1, 1, (n_s, n_t, n_head, head_dim)).astype(f32),
            "dt": rng.uniform(-4, 24, (n_s, n_t, n_head)).astype(f32),
            "A": rng.uniform(-1, -0.5, (n_head, 1 if mamba2 else d_state)).astype(f32),
            "B": rng.uniform(-1, 1, (n_s, n_t, n_group, d_state)).astype(f32),
            "C": rng.uniform(-1, 1, (n_s, n_t, n_group, d_state)).astype(f32),
            "ids": np.array(ids, np.int32)}


def ours(values: dict, K: int) -> np.ndarray:
    b = GraphBuilder("scan")
    nodes = [b.input(name, list(v.shape), I32 if name == "ids" else F32) for name, v in values.items()]
    b.output("y", b.ssm_scan(*nodes, K=K))
    return run_graph(b.graph, values, numerics=oracle_numerics(), n_threads=2)["y"]


def theirs(ggml, values: dict, K: int, n_threads: int = 2) -> np.ndarray:
    with ggml.graph() as g:
        out = g.op("ggml_ssm_scan", *(g.tensor(v) for v in values.values()), g.i64(K))
        return g.compute(out, n_threads=n_threads)


def written(values: dict, K: int) -> int:
    """How many leading values of the result ggml writes: y and min(K, n_t) state blocks."""
    x, s = values["x"], values["s"]
    n_s, n_t = x.shape[:2]
    return x.size + min(K, n_t) * n_s * s[0].size


@pytest.mark.parametrize("n_rs,n_head,head_dim,d_state,n_group,n_t,n_s,mamba2,ids", [
    (4, 48, 1, 16, 1, 6, 3, False, [2, 0, 3]),         # Mamba-1, 3 of 4 slots
    (2, 64, 1, 16, 1, 1, 2, False, [1, 0]),            # Mamba-1 decode
    (3, 8, 16, 128, 2, 5, 3, True, [1, 2, 0]),         # Mamba-2: whole vector steps
    (2, 6, 8, 96, 3, 4, 2, True, [1, 0]),              # 96: a partial AVX-512 step
    (2, 4, 16, 80, 1, 3, 1, True, [1]),                # 80: a scalar tail of 16
    (5, 8, 4, 16, 4, 7, 2, True, [4, 1]),              # no whole step: all scalar
    (2, 4, 8, 256, 2, 2, 2, True, [0, 1]),
])
def test_ssm_scan_matches_ggml(ggml, n_rs, n_head, head_dim, d_state, n_group, n_t, n_s, mamba2, ids):
    values = scan_inputs(np.random.default_rng(d_state + n_t), n_rs, n_head, head_dim, d_state, n_group, n_t,
                         n_s, mamba2, ids)
    got, want = ours(values, 1), theirs(ggml, values, 1)
    assert got.shape == want.shape
    assert_same_bits(got, want)


@pytest.mark.parametrize("n_threads", [1, 3])
def test_ssm_scan_is_the_same_for_any_thread_count(ggml, n_threads):
    values = scan_inputs(np.random.default_rng(9), 3, 6, 8, 128, 2, 3, 2, True, [2, 0])
    assert_same_bits(ours(values, 1), theirs(ggml, values, 1, n_threads))


@pytest.mark.parametrize("K,n_t", [(3, 8), (4, 4), (4, 2)])
def test_ssm_scan_snapshots_match_ggml(ggml, K, n_t):
    values = scan_inputs(np.random.default_rng(K * n_t), 2, 8, 16, 128, 2, n_t, 2, True, [1, 0])
    got, want = ours(values, K), theirs(ggml, values, K)
    n = written(values, K)
    assert got.shape == want.shape
    assert_same_bits(got[:n], want[:n])
    assert not got[n:].any()                           # the blocks no token reaches are zero


def test_ssm_scan_of_llama_cpp_views_matches_ggml(ggml):
    """Mamba-2's x, B and C as views of one conv output [n_s, n_t, d_inner + 2*G*ds], as
    llm_build_mamba_base::build_mamba2_layer makes them."""
    n_s, n_t, n_head, head_dim, n_group, d_state = 2, 4, 4, 8, 2, 64
    d_inner = n_head * head_dim
    row = d_inner + 2 * n_group * d_state
    rng = np.random.default_rng(11)
    xbc = rng.uniform(-1, 1, (n_s, n_t, row)).astype(f32)
    rest = scan_inputs(rng, 3, n_head, head_dim, d_state, n_group, n_t, n_s, True, [2, 1])
    seq, tok = n_t * row * 4, row * 4
    b = GraphBuilder("scan")
    src = b.input("xBC", [n_s, n_t, row], F32)
    x = b.view(src, [n_s, n_t, n_head, head_dim], [seq, tok, head_dim * 4, 4], 0)
    B = b.view(src, [n_s, n_t, n_group, d_state], [seq, tok, d_state * 4, 4], d_inner * 4)
    C = b.view(src, [n_s, n_t, n_group, d_state], [seq, tok, d_state * 4, 4], (d_inner + n_group * d_state) * 4)
    leaf = {name: b.input(name, list(rest[name].shape), I32 if name == "ids" else F32)
            for name in ("s", "dt", "A", "ids")}
    b.output("y", b.ssm_scan(leaf["s"], x, leaf["dt"], leaf["A"], B, C, leaf["ids"]))
    values = {"xBC": xbc} | {name: rest[name] for name in leaf}
    got = run_graph(b.graph, values, numerics=oracle_numerics())["y"]
    with ggml.graph() as g:
        t = g.tensor(xbc)

        def view(ne0, ne1, offset):
            return g.op("ggml_view_4d", t, g.i64(ne0), g.i64(ne1), g.i64(n_t), g.i64(n_s), g.size(ne0 * 4),
                        g.size(tok), g.size(seq), g.size(offset))

        out = g.op("ggml_ssm_scan", g.tensor(rest["s"]), view(head_dim, n_head, 0), g.tensor(rest["dt"]),
                   g.tensor(rest["A"]), view(d_state, n_group, d_inner * 4),
                   view(d_state, n_group, (d_inner + n_group * d_state) * 4), g.tensor(rest["ids"]), g.i64(1))
        want = g.compute(out, n_threads=2)
    assert_same_bits(got, want)
