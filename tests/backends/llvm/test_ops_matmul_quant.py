"""The LLVM backend's quantized matmuls against the numpy reference, bit for bit, per numerics profile.

The reference reproduces ggml's kernels for each weight type and row count (vec_dot, tinyBLAS,
the tiled K-quant matmul from 8 rows, the CPU_REPACK gemv/gemm for q4_0, q4_K and, in the avx512
profile, q2_K; checked against libggml in tests/ir/test_ggml_exact_quant.py). Both profiles run
here on the host's vectors and on an AVX2-only target (no AVX-512, no VNNI: vpmaddubsw instead of
vpdpbusd), so each order is checked with either instruction set. One compile per graph serves
every row count (T is a run-time dim).
"""

from __future__ import annotations

import numpy as np
import pytest
from shared_backends import shared_backend

from llamir.backends.llvm import LLVMBackend
from llamir.backends.llvm.target import host_target, restricted_target
from llamir.ir import F32, I32, GraphBuilder, dtype_named, quants, run_graph

f32 = np.float32
LEGACY = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"]
K_QUANTS = ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]
ROWS = (1, 2, 3, 4, 5, 7, 8, 13, 64)     # vec_dot / gemv, gemm in fours + leftovers, tiled from 8


def backend(profile: str, avx2_only: bool) -> LLVMBackend:
    return shared_backend(profile, restricted_target(host_target(), ("avx512", "avxvnni")) if avx2_only else None)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(7)


def weight(rng, name: str, *shape: int) -> np.ndarray:
    w = rng.normal(0, 0.05, shape).astype(f32) * rng.uniform(0.5, 2, shape[:-1] + (1,)).astype(f32)
    return quants.quantize(w, dtype_named(name))


def rows(rng, *shape: int) -> np.ndarray:
    return (rng.normal(0, 1, shape) * 10.0 ** rng.uniform(-1, 1, shape[:-1] + (1,))).astype(f32)


def assert_same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape)
    differ = got.view(np.uint32) != want.view(np.uint32)
    assert not differ.any(), f"{what}: {int(differ.sum())} of {got.size} values differ, max " \
                             f"{float(np.abs(got - want).max()):.3g}"


def check_weight_matmul(profile: str, avx2_only: bool, name: str, m: int, k: int, rng, batch: int = 0) -> None:
    dtype = dtype_named(name)
    g = GraphBuilder("q", dims=["T"])
    x_shape = [batch, "T", k] if batch else ["T", k]
    g.output("y", g.mul_mat(g.weight("w", [m, k], dtype), g.input("x", x_shape, F32)))
    w = weight(rng, name, m, k)
    run = backend(profile, avx2_only).compile(g.graph)
    for n in ROWS:
        x = rows(rng, *([batch, n, k] if batch else [n, k]))
        want = run_graph(g.graph, {"w": w, "x": x}, {"T": n}, numerics=profile)["y"]
        got = run({"w": w, "x": x}, {"T": n})["y"]
        assert_same(got, want, f"{profile}{' avx2-only' if avx2_only else ''} {name} [{m}, {k}] N={n}")


@pytest.mark.parametrize("profile", ["avx512", "avx2"])
@pytest.mark.parametrize("name", LEGACY + K_QUANTS)
@pytest.mark.parametrize("m,k", [(64, 512), (40, 256)])     # M % 8 == 0 (ggml repacks) and not
def test_weight_matmul(rng, profile, name, m, k):
    check_weight_matmul(profile, False, name, m, k, rng)


@pytest.mark.parametrize("profile", ["avx512", "avx2"])
@pytest.mark.parametrize("name", ["q4_0", *K_QUANTS])
def test_weight_matmul_avx2_target(rng, profile, name):
    """The same orders from AVX2 code: 256-bit halves, no vpdpbusd."""
    check_weight_matmul(profile, True, name, 48, 512, rng)


@pytest.mark.parametrize("name", ["q4_k", "q6_k", "q2_k", "q4_0"])
def test_batched_activations(rng, name):
    """A 2-D weight times [3, T, K]: ggml takes each plane's rows on their own (the gemm's fours,
    the tiled threshold), so planes of 5 split 4 + 1 and planes of 8 go tiled."""
    check_weight_matmul("avx512", False, name, 32, 512, rng, batch=3)


@pytest.mark.parametrize("profile", ["avx512", "avx2"])
def test_q4_0_kv_cache_is_not_repacked(rng, profile):
    """A q4_0 K cache with n_kv % 8 == 0 is not a weight: vec_dot's lanes, not the repacked order."""
    g = GraphBuilder("kq", dims=["T"])
    k = g.input("k", [2, 64, 128], dtype_named("q4_0"))
    q = g.permute(g.input("q", ["T", 4, 128], F32), 1, 0, 2)
    g.output("y", g.mul_mat(k, q))
    cache = weight(rng, "q4_0", 2, 64, 128)
    run = backend(profile, False).compile(g.graph)
    for n in (1, 7):
        x = rows(rng, n, 4, 128)
        want = run_graph(g.graph, {"k": cache, "q": x}, {"T": n}, numerics=profile)["y"]
        assert_same(run({"k": cache, "q": x}, {"T": n})["y"], want, f"q4_0 cache, {n} tokens")


@pytest.mark.parametrize("kind", ["weight", "input"])
@pytest.mark.parametrize("name", ["q4_0", "q8_0"])
def test_mul_mat_id_experts(rng, kind, name):
    """q4_0 experts that are a model weight sit in CPU_REPACK (gemv order for every row); as a
    plain input they take vec_dot's lanes."""
    n_expert, m, k, n_tokens = 4, 32, 256, 9
    dtype = dtype_named(name)
    g = GraphBuilder("moe")
    leaf = g.weight if kind == "weight" else g.input
    e = leaf("e", [n_expert, m, k], dtype)
    g.output("y", g.mul_mat_id(e, g.input("x", [n_tokens, 1, k], F32), g.input("ids", [n_tokens, 2], I32)))
    values = {"e": weight(rng, name, n_expert, m, k), "x": rows(rng, n_tokens, 1, k),
              "ids": rng.integers(0, n_expert, (n_tokens, 2)).astype(np.int32)}
    want = run_graph(g.graph, values, numerics="avx512")["y"]
    assert_same(backend("avx512", False).compile(g.graph)(values, {})["y"], want, f"{name} experts ({kind})")


@pytest.mark.parametrize("profile", ["avx512", "avx2"])
@pytest.mark.parametrize("name", ["q8_0", "q4_1", "q5_0", "q4_k", "q6_k"])
def test_nan_and_inf_activations(rng, profile, name):
    """The activation quantizers treat NaN/inf as the reference does (x86 maxps order for q8_0/q8_1's
    amax, -128 and the integer indefinite in q8_1's sum, q8_K's nearest_int(NaN) = 0): same bits,
    NaN positions included, for vec_dot and tiled row counts."""
    dtype = dtype_named(name)
    g = GraphBuilder("q", dims=["T"])
    g.output("y", g.mul_mat(g.weight("w", [40, 512], dtype), g.input("x", ["T", 512], F32)))
    w = weight(rng, name, 40, 512)
    run = backend(profile, False).compile(g.graph)
    for n in (1, 3, 9):
        x = rows(rng, n, 512)
        for r in range(n):
            x[r, rng.integers(0, 512, 1 + r % 3)] = (np.nan, np.inf, -np.inf)[r % 3]
        want = run_graph(g.graph, {"w": w, "x": x}, {"T": n}, numerics=profile)["y"]
        got = run({"w": w, "x": x}, {"T": n})["y"]
        canon = np.float32(np.nan)
        assert_same(np.where(np.isnan(got), canon, got), np.where(np.isnan(want), canon, want), f"{name} N={n}")
