"""Multi-op element-wise graphs on the LLVM backend against the numpy interpreter: fused chains,
views feeding several ops, layout chains, one row and zero tokens. Single ops over shapes, dtypes,
broadcasts and views are test-backend-ops cases (test_backend_ops_llvm.py)."""

from __future__ import annotations

import numpy as np

from llamir.ir import BF16, F16, F32, GraphBuilder

rng = np.random.default_rng(1)


def _values(shape, dtype, lo=-3.0, hi=3.0):
    x = rng.uniform(lo, hi, shape).astype(np.float32)
    if dtype == F16:
        return x.astype(np.float16)
    if dtype == BF16:
        return (x.view(np.uint32) >> 16).astype(np.uint16)
    return x


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


