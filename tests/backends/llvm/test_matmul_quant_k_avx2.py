"""The K-quant matmuls' 256-bit code (8-row halves, matmul_quant_k8.py) against the numpy reference,
bit for bit, in both numerics profiles: an AVX2-only target (vpmaddubsw int16 sums) and an AVX2 +
AVX-VNNI one (vpdpbusd / vpdpwssd), every mode: vec_dot lanes (< 8 rows), tiled (8 and more), the
repacked gemv/gemm (q4_K, and q2_K in the avx512 profile), M not a multiple of 16 or of 8."""

from __future__ import annotations

import numpy as np
import pytest
from shared_backends import shared_backend

from llamir.backends.llvm import LLVMBackend
from llamir.backends.llvm.target import host_target, restricted_target
from llamir.ir import F32, GraphBuilder, dtype_named, quants, run_graph

f32 = np.float32
K_QUANTS = ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]
ROWS = (1, 3, 4, 6, 8, 9, 13, 21)
ISAS = {"avx2": ("avx512", "avxvnni"), "avxvnni": ("avx512",)}


def backend(profile: str, isa: str) -> LLVMBackend:
    return shared_backend(profile, restricted_target(host_target(), ISAS[isa]))


def weight(rng, name: str, m: int, k: int) -> np.ndarray:
    w = rng.normal(0, 0.05, (m, k)).astype(f32) * rng.uniform(0.5, 2, (m, 1)).astype(f32)
    return quants.quantize(w, dtype_named(name))


def saturated_weight(rng, name: str, m: int, k: int) -> np.ndarray:
    """Weights whose quantized values mostly sit at the top of their range: with activations of one
    sign, the int16 sums of vpmaddubsw results reach their largest values."""
    w = np.where(rng.uniform(0, 1, (m, k)) < 0.9, 1.0, -1.0).astype(f32)
    return quants.quantize(w, dtype_named(name))


def activations(rng, n: int, k: int) -> np.ndarray:
    return (rng.normal(0, 1, (n, k)) * 10.0 ** rng.uniform(-1, 1, (n, 1))).astype(f32)


def assert_same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    differ = got.view(np.uint32) != want.view(np.uint32)
    assert not differ.any(), f"{what}: {int(differ.sum())} of {got.size} values differ"


@pytest.mark.parametrize("isa", list(ISAS))
@pytest.mark.parametrize("profile", ["avx2", "avx512"])
@pytest.mark.parametrize("name", K_QUANTS)
@pytest.mark.parametrize("m", [56, 44])          # a lone half group at the end; M % 8 != 0
def test_k_quant_matmul_256(isa, profile, name, m):
    rng = np.random.default_rng(11)
    k = 512
    g = GraphBuilder("q", dims=["T"])
    g.output("y", g.mul_mat(g.weight("w", [m, k], dtype_named(name)), g.input("x", ["T", k], F32)))
    run = backend(profile, isa).compile(g.graph)
    for w, one_sign in ((weight(rng, name, m, k), False), (saturated_weight(rng, name, m, k), True)):
        for n in ROWS:
            x = activations(rng, n, k)
            x = np.abs(x) if one_sign else x
            want = run_graph(g.graph, {"w": w, "x": x}, {"T": n}, numerics=profile)["y"]
            got = run({"w": w, "x": x}, {"T": n})["y"]
            assert_same(got, want, f"{isa} {profile} {name} M={m} N={n}{' saturated' if one_sign else ''}")
