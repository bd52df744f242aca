"""Quantized matmuls of the reference interpreter against llama.cpp's own CPU backend, bit for bit.

ggml computes these through ggml-backend, as llama.cpp does: weights are placed in the first
extra buffer type of the CPU device that supports their op (CPU_REPACK, where setting them
repacks them), else in the CPU buffer, and the graph runs with ggml_backend_graph_compute
(llamir.testing.libggml.BackendGraph). That covers every kernel ggml picks for quantized weights:
vec_dot for one token, tinyBLAS for prompts of Q8_0/Q4_0/Q5_0, the tiled K-quant matmul from 8
rows on, the repacked q4_0/q4_K/q2_K gemv and gemm (the latter for rows in fours, the rest
through the gemv). The reference runs the profile of the installed llama.cpp build
(llama_print_system_info), never the host's.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from llamir.ir import F32, I32, GraphBuilder, quants, quants_k_x86, run_graph
from llamir.ir.dtypes import Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, DType
from llamir.ir.repack_x86 import repack_type
from llamir.testing.libggml import Raw

pytestmark = pytest.mark.llama_cpp
f32 = np.float32
LEGACY = [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0]
K_QUANTS = [Q2_K, Q3_K, Q4_K, Q5_K, Q6_K]
TOKENS = (1, 2, 3, 4, 7, 8, 64)   # 8: the tiled matmul's threshold


@pytest.fixture(scope="module")
def numerics():
    from llamir.testing.llama_cpp import oracle_numerics

    return oracle_numerics()


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20250807)


def quantized_weight(rng: np.random.Generator, dtype: DType, *shape: int) -> np.ndarray:
    """Bytes of a weight as ggml's reference quantizer writes it, from values of model-like scale."""
    w = rng.normal(0, 0.05, shape).astype(f32) * rng.uniform(0.5, 2.0, shape[:-1] + (1,)).astype(f32)
    return quants.quantize(w, dtype)


def activations(rng: np.random.Generator, *shape: int) -> np.ndarray:
    x = rng.normal(0, 1, shape).astype(f32) * (10.0 ** rng.uniform(-1, 1, shape[:-1] + (1,))).astype(f32)
    x.reshape(-1, shape[-1])[0, :5] = [4.0, -4.0, 0.0, 1e-3, -0.5]          # ties of magnitude, zero
    return x


def assert_same_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    want = want.reshape(got.shape)
    differ = got.view(np.uint32) != want.view(np.uint32)
    if np.any(differ):
        at = tuple(int(i) for i in np.argwhere(differ)[0])
        raise AssertionError(f"{what}: {int(differ.sum())} of {got.size} values differ; first at {at}: "
                             f"{got[at]!r} != {want[at]!r}")


def ours_mul_mat(numerics, dtype: DType, w: np.ndarray, x: np.ndarray, m: int, k: int) -> np.ndarray:
    g = GraphBuilder("q")
    wn = g.weight("w", [m, k], dtype)
    xn = g.input("x", list(x.shape), F32)
    g.output("y", g.mul_mat(wn, xn))
    return run_graph(g.graph, {"w": w, "x": x}, numerics=numerics)["y"]


# -- weights: every type, one token and prompts, rows that ggml repacks and rows it cannot -------------
@pytest.mark.parametrize("dtype", LEGACY + K_QUANTS, ids=str)
@pytest.mark.parametrize("m,k", [(64, 256), (60, 768), (32, 2048), (12, 1024)])
def test_mul_mat_weight(ggml, numerics, rng, dtype, m, k):
    w = quantized_weight(rng, dtype, m, k)
    for n in TOKENS:
        x = activations(rng, n, k)
        with ggml.backend_graph() as g:
            wt = g.weight(Raw(w, int(dtype.ggml_type), (m, k)))
            want = g.compute(g.op("ggml_mul_mat", wt, g.tensor(x)))
            placed = g.placement(wt)
        layout = repack_type(dtype, m, numerics)
        assert placed == ("CPU_REPACK" if layout else "CPU"), \
            f"ggml placed a {dtype} [{m}, {k}] weight in {placed}; the {numerics} reference expects {layout}"
        assert_same_bits(ours_mul_mat(numerics, dtype, w, x, m, k), want, f"{dtype} N={n} ({placed})")


def test_mul_mat_batched_activations(ggml, numerics, rng):
    """A 2-D weight times a 3-D activation: ggml quantizes and groups rows per plane (4-row gemm
    groups, the tiled threshold), so planes of 5 rows each split 4 + 1."""
    for dtype in (Q4_K, Q6_K, Q4_0):
        w = quantized_weight(rng, dtype, 32, 512)
        x = activations(rng, 3, 5, 512)
        with ggml.backend_graph() as g:
            wt = g.weight(Raw(w, int(dtype.ggml_type), (32, 512)))
            want = g.compute(g.op("ggml_mul_mat", wt, g.tensor(x)))
        assert_same_bits(ours_mul_mat(numerics, dtype, w, x, 32, 512), want, f"{dtype} batched")


@pytest.mark.parametrize("dtype", [Q4_1, Q5_1, Q4_K, Q6_K], ids=str)
def test_mul_mat_with_nan_and_inf_activations(ggml, numerics, rng, dtype):
    """Non-finite activations go through ggml's quantizers as x86 does: maxps keeps a NaN only as its
    second operand, a NaN product converts to the integer indefinite (-128 packed, -2^31 in q8_1's
    sum), q8_K's nearest_int makes it 0; the outputs (NaN or not) are ggml's bit for bit. (Weights
    whose dots use _mm256_sign_epi8 (q8_0, q4_0, q5_0) wrap a -128 activation against a negative
    weight value, and the repacked gemm's ggml_quantize_mat_q8_K_4x8 has its own NaN rules; llamir
    reproduces neither (see the README's exceptions), so these weights have 60 rows: not repacked.)"""
    w = quantized_weight(rng, dtype, 60, 512)
    for n in (1, 4, 9):
        x = activations(rng, n, 512)
        for r in range(n):
            x[r, rng.integers(0, 512, 1 + r % 3)] = (np.nan, np.inf, -np.inf)[r % 3]
        with ggml.backend_graph() as g:
            wt = g.weight(Raw(w, int(dtype.ggml_type), (60, 512)))
            want = g.compute(g.op("ggml_mul_mat", wt, g.tensor(x)))
        got = ours_mul_mat(numerics, dtype, w, x, 60, 512)
        assert_same_bits(np.where(np.isnan(got), np.float32(np.nan), got),
                         np.where(np.isnan(want), np.float32(np.nan), want).astype(f32), f"{dtype} N={n} NaN/inf")


# -- the activation quantizers --------------------------------------------------------------------------
def test_q8_k_quantizers_match_ggml(ggml, rng):
    """quantize_row_q8_K (vec_dot, gemv, tiled) keeps the sign of the first value of largest
    magnitude; ggml_quantize_mat_q8_K_4x8 (the repacked gemm's four rows) takes +amax when it
    occurs anywhere. Rows with -amax before +amax tell them apart."""
    x = np.clip(activations(rng, 4, 512), -7, 7)
    x[0, 10], x[0, 200] = -7.5, 7.5          # -amax first: the two quantizers disagree
    x[1, 300], x[1, 20] = 7.5, -7.5          # +amax first: they agree
    x[2, 256:] = 0.0                          # an all-zero super-block
    x[3, 3] = -9.0                            # only -amax
    row = quants_k_x86.quantize_q8_k(x)
    expected_ref = np.concatenate([row.d.view(np.uint8).reshape(4, 2, 4), row.q.astype(np.int8).view(np.uint8),
                                   row.sums(16).astype(np.int16).view(np.uint8).reshape(4, 2, 32)], axis=-1)
    got_ref = np.zeros((4, 2 * 292), np.uint8)
    for r in range(4):
        ggml.cpu.quantize_row_q8_K(x[r].ctypes.data_as(ctypes.c_void_p), got_ref[r].ctypes.data_as(ctypes.c_void_p),
                                   ctypes.c_int64(512))
    np.testing.assert_array_equal(got_ref.reshape(4, 2, 292), expected_ref)

    mat = quants_k_x86.quantize_q8_k(x, positive_ties=True)
    out = np.zeros(2 * (16 + 1024 + 128), np.uint8)                  # block_q8_Kx4 per super-block
    ggml.cpu.ggml_quantize_mat_q8_K_4x8(x.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p),
                                        ctypes.c_int64(512))
    blocks = out.reshape(2, -1)
    d = np.ascontiguousarray(blocks[:, :16]).view(f32)               # [sblk, row]
    np.testing.assert_array_equal(d.T.view(np.uint32), mat.d.view(np.uint32))
    qs = blocks[:, 16:16 + 1024].view(np.int8).reshape(2, 32, 4, 8)  # [sblk, chunk of 8, row, 8]
    np.testing.assert_array_equal(qs.transpose(2, 0, 1, 3).reshape(4, 2, 256), mat.q)
    assert mat.d[0, 0] == -row.d[0, 0] and mat.d[1, 0] == row.d[1, 0] and mat.d[3, 0] == row.d[3, 0]


# -- quantized KV caches: views, heads broadcast, never repacked ------------------------------------------
@pytest.mark.parametrize("dtype", LEGACY, ids=str)
@pytest.mark.parametrize("n_tokens,head_dim", [(1, 64), (7, 128), (32, 64)])
def test_mul_mat_kv_cache_view(ggml, numerics, rng, dtype, n_tokens, head_dim):
    """k.q as llama.cpp builds it: a view of the first n_kv cells of a [n_ctx, n_head_kv, d] cache
    (row stride n_head_kv * row bytes) times q permuted to heads first, 2 KV heads for 4 heads."""
    n_ctx, n_kv, n_head_kv, n_head = 96, 80, 2, 4
    cache = quantized_weight(rng, dtype, n_ctx, n_head_kv, head_dim)
    q = activations(rng, n_tokens, n_head, head_dim)
    row = dtype.row_bytes(head_dim)

    g = GraphBuilder("kq")
    kn = g.input("k", [n_ctx, n_head_kv, head_dim], dtype)
    qn = g.input("q", [n_tokens, n_head, head_dim], F32)
    k_view = g.view(kn, [n_head_kv, n_kv, head_dim], [row, n_head_kv * row, dtype.type_size])
    g.output("y", g.mul_mat(k_view, g.permute(qn, 1, 0, 2)))
    got = run_graph(g.graph, {"k": cache, "q": q}, numerics=numerics)["y"]

    with ggml.graph(64 << 20) as gg:
        kt = gg.tensor(Raw(cache, int(dtype.ggml_type), (n_ctx, n_head_kv, head_dim)))
        view = gg.op("ggml_view_3d", kt, ctypes.c_int64(head_dim), ctypes.c_int64(n_kv), ctypes.c_int64(n_head_kv),
                     ctypes.c_size_t(n_head_kv * row), ctypes.c_size_t(row), ctypes.c_size_t(0))
        qt = gg.op("ggml_permute", gg.tensor(q), 0, 2, 1, 3)
        want = gg.compute(gg.op("ggml_mul_mat", view, qt), n_threads=2)
    assert_same_bits(got, want, f"{dtype} kq, {n_tokens} tokens")


# -- mixture of experts ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [Q4_0, Q8_0, Q4_K, Q2_K, Q6_K, Q5_K], ids=str)
@pytest.mark.parametrize("m", [32, 20])
def test_mul_mat_id(ggml, numerics, rng, dtype, m):
    """Experts as a 3-D weight, placed for mul_mat_id: repacked experts take every row through the
    gemv; the others take vec_dot, or the tiled matmul for an expert that gets 8 rows or more."""
    n_expert, n_used, n_tokens, k = 4, 2, 12, 512
    experts = quantized_weight(rng, dtype, n_expert, m, k)
    x = activations(rng, n_tokens, 1, k)
    ids = np.stack([np.zeros(n_tokens, np.int32), rng.integers(1, n_expert, n_tokens).astype(np.int32)], axis=1)
    ids[::3, 1] = 3                                  # expert 0: 12 rows (tiled), the others fewer
    g = GraphBuilder("moe")
    en = g.weight("experts", [n_expert, m, k], dtype)
    xn, idn = g.input("x", [n_tokens, 1, k], F32), g.input("ids", [n_tokens, n_used], I32)
    g.output("y", g.mul_mat_id(en, xn, idn))
    got = run_graph(g.graph, {"experts": experts, "x": x, "ids": ids}, numerics=numerics)["y"]

    with ggml.backend_graph() as gg:
        et = gg.weight(Raw(experts, int(dtype.ggml_type), (n_expert, m, k)), op="mul_mat_id", n_expert_used=n_used)
        want = gg.compute(gg.op("ggml_mul_mat_id", et, gg.tensor(x), gg.tensor(ids)))
        placed = gg.placement(et)
    assert placed == ("CPU_REPACK" if repack_type(dtype, m, numerics) else "CPU")
    assert_same_bits(got, want, f"{dtype} mul_mat_id ({placed})")
