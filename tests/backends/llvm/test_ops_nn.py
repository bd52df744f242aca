"""Multi-op NN graphs on the LLVM backend against the numpy interpreter (the v_trans KV-cache store).
Norms, softmax, rope, rows, matmuls (every weight type) and attention as single ops are
test-backend-ops cases, bit-exact where the kernels follow ggml (test_backend_ops_llvm.py)."""

from __future__ import annotations

import numpy as np

from llamir.ir import F16, F32, I64, GraphBuilder, dims

rng = np.random.default_rng(2)


def _f32(shape, lo=-2.0, hi=2.0):
    return rng.uniform(lo, hi, shape).astype(np.float32)


def test_set_rows_transposed_v_cache(check):
    """The v_trans layout: one element per index, as llama.cpp stores V without flash attention."""
    b = GraphBuilder("g", dims=["T"])
    cache = b.state("v", [1, 8, 32], F16)
    flat = b.reshape(cache, 256, 1)
    t8 = dims.mul(b.dim("T"), 8)
    v = b.reshape(b.input("x", ["T", 8], F32), t8, 1)
    b.set_rows(flat, v, b.input("i", [t8], I64))
    b.output("y", b.scale(b.input("x2", [1], F32), 1.0))
    T = 3
    idx = (np.arange(8)[:, None] * 32 + np.array([4, 9, 1])).T.reshape(-1)
    check(b.graph, {"x": _f32((T, 8)), "i": idx.astype(np.int64), "x2": _f32((1,))}, {"T": T}, exact=True,
          fresh={"v": lambda: np.zeros((1, 8, 32), np.float16)})
