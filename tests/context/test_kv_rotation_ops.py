"""The two ops a rotated quantized KV cache adds, checked one at a time against libggml's CPU backend
(the library llama-cpp-python 0.3.36 runs), on the numpy reference and the LLVM backend.

- llama_mul_mat_hadamard: a mul_mat tagged GGML_HINT_SRC0_IS_HADAMARD, which ggml-cpu computes
  as a fast Walsh-Hadamard transform (ggml_compute_forward_fwht), not as a matmul;
- storing f32 rows into a q8_0 cache (set_rows, and the cpy of the K-shift): ggml-cpu's
  from_float, whose q8_0 quantizer rounds halves to even where the reference one rounds away.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from llamir.backends.llvm import LLVMBackend
from llamir.frontend.graph_kv import mul_mat_hadamard
from llamir.ir import F32, I64, Q8_0, GraphBuilder, run_graph
from llamir.ir.interp import storage_shape
from llamir.testing.libggml import Raw
from llamir.testing.llama_cpp import oracle_numerics

pytestmark = pytest.mark.llama_cpp

GGML_HINT_SRC0_IS_HADAMARD, GGML_TYPE_Q8_0, GGML_TYPE_I64 = 1, 8, 27


@pytest.fixture(scope="module")
def llvm():
    backend = LLVMBackend(n_threads=2, disk_cache=False, numerics=oracle_numerics())
    yield backend
    backend.close()


def run_both(graph, values, llvm) -> list[dict[str, np.ndarray]]:
    return [run_graph(graph, dict(values), numerics=oracle_numerics()), llvm.compile(graph)(dict(values), {})]


def ggml_gen_hadamard(n: int) -> np.ndarray:
    """llama-kv-cache.cpp's ggml_gen_hadamard: the orthonormal Sylvester matrix."""
    h = np.zeros((n, n), np.float32)
    h[0, 0] = 1.0 / np.sqrt(np.float32(n))
    s = 1
    while s < n:
        h[s:2 * s, :s], h[:s, s:2 * s], h[s:2 * s, s:2 * s] = h[:s, :s], h[:s, :s], -h[:s, :s]
        s *= 2
    return h


def ggml_hadamard(gg, x: np.ndarray, n: int, hint: bool) -> np.ndarray:
    """llama_mul_mat_hadamard(x, rot[n, n]) on ggml-cpu through ggml-backend, as llama.cpp runs it."""
    with gg.backend_graph() as g:
        cur = g.tensor(x)
        rows = g.op("ggml_reshape_2d", cur, n, x.size // n)
        res = g.op("ggml_mul_mat", g.tensor(ggml_gen_hadamard(n)), rows)
        if hint:
            res.contents.op_params[1] = GGML_HINT_SRC0_IS_HADAMARD    # ggml_mul_mat_set_hint
        res = g.op("ggml_reshape_3d", res, x.shape[2], x.shape[1], x.shape[0])
        return g.compute(res, n_threads=2)


@pytest.mark.parametrize("n, d", [(64, 64), (64, 128), (128, 128), (256, 256)])
def test_hadamard_rotation_is_ggml_cpus_bit_for_bit(ggml, llvm, n, d):
    """q/k [T, H, d] (d = n for K; V rotates each 64 of a 128 head), values of mixed scales."""
    rng = np.random.default_rng(n + d)
    x = (rng.standard_normal((5, 3, d)) * np.exp(rng.uniform(-6, 6, (5, 3, d)))).astype(np.float32)
    b = GraphBuilder("hadamard")
    b.output("y", mul_mat_hadamard(b, b.input("x", [5, 3, d], F32), n))
    want = ggml_hadamard(ggml, x, n, hint=True)
    for got in run_both(b.graph, {"x": x}, llvm):
        np.testing.assert_array_equal(got["y"], want)
    # the hint is what makes it exact: ggml's plain mul_mat by the same matrix rounds differently
    assert not np.array_equal(ggml_hadamard(ggml, x, n, hint=False), want)


def q8_0_rows_with_ties(n_rows: int) -> np.ndarray:
    """Rows of two q8_0 blocks: random ones, and one whose amax is 127 so x * 127/amax = x holds
    exact halves (44.5, -44.5, 2.5, ...), where round-half-even and roundf disagree."""
    rng = np.random.default_rng(5)
    x = rng.uniform(-3, 3, (n_rows, 64)).astype(np.float32)
    x[1, :32] = np.concatenate([[127.0, 44.5, -44.5, 2.5, -3.5, 0.5, -0.5, 126.5], rng.uniform(-9, 9, 24)])
    return x


def ggml_set_rows_q8_0(gg, dst: np.ndarray, src: np.ndarray, idx: np.ndarray) -> np.ndarray:
    with gg.graph() as g:
        cache = g.tensor(Raw(dst, GGML_TYPE_Q8_0, (dst.shape[0], 64)))
        rows = g.tensor(Raw(idx.view(np.uint8), GGML_TYPE_I64, idx.shape))
        out = g.op("ggml_set_rows", cache, g.tensor(src), rows)
        graph = gg.base.ggml_new_graph(g.ctx)                  # g.compute reads back float types only
        gg.base.ggml_build_forward_expand(graph, out)
        assert gg.cpu.ggml_graph_compute_with_ctx(g.ctx, graph, 2) == 0
        return np.frombuffer(ctypes.string_at(out.contents.data, dst.nbytes), np.uint8).reshape(dst.shape).copy()


def test_q8_0_cache_store_is_ggml_cpus_from_float(ggml, llvm):
    """set_rows f32 -> q8_0 (the K/V store) and the cast of the K-shift: ties round to even."""
    src, idx = q8_0_rows_with_ties(4), np.array([6, 1, 3, 0], np.int64)
    dst = np.zeros(storage_shape((8, 64), Q8_0), np.uint8)
    want = ggml_set_rows_q8_0(ggml, dst, src, idx)
    q = want[1].view(np.int8)                                  # cache row 1 holds src row 1
    assert q[2:10].tolist() == [127, 44, -44, 2, -4, 0, 0, 126]   # ggml: half to even
    b = GraphBuilder("store")
    cache = b.state("cache", [8, 64], Q8_0)
    b.output("stored", b.set_rows(cache, b.input("src", [4, 64], F32), b.input("idx", [4], I64)))
    b.output("cast", b.cast(b.input("src2", [4, 64], F32), Q8_0))
    for got in run_both(b.graph, {"cache": dst.copy(), "src": src, "idx": idx, "src2": src}, llvm):
        np.testing.assert_array_equal(got["stored"], want)
        np.testing.assert_array_equal(got["cast"], want[idx])
