"""The matmuls whose threads claim chunks of the work (Kernel.shares_work, Emitter.claims) against
the numpy reference, bit for bit, at thread counts other than two: one thread (it claims every
chunk), and more threads than some weights have chunks. The K-quant kernels run several claimed
loops in one call (planes of a batched activation, the repacked gemm and gemv modes), which share
one counter; every call runs twice, since the counters must start from zero each run."""

from __future__ import annotations

import numpy as np
import pytest
from shared_backends import shared_backend

from llamir.backends.llvm import LLVMBackend
from llamir.backends.llvm.codegen import FrameLayout
from llamir.backends.llvm.target import Target, avx2_only_target, host_target, restricted_target
from llamir.ir import F16, F32, GraphBuilder, dtype_named, quants, run_graph

pytestmark = pytest.mark.slow
f32 = np.float32


def other_family_target() -> Target:
    """The host's features tuned for the other CPU family (AMD Zen on Intel, Intel on Zen): the
    weight streams get that family's prefetch distance, so both distances run on any host."""
    host = host_target()
    return Target(host.triple, "sapphirerapids" if host.cpu.startswith("znver") else "znver4", host.features)


def backend(n_threads: int, target: str) -> LLVMBackend:
    if target == "other-family":
        return shared_backend(None, other_family_target(), n_threads)
    if target == "avx2-only":
        return shared_backend("avx2", restricted_target(host_target(), ("avx512", "avxvnni")), n_threads)
    return shared_backend(n_threads=n_threads)


def _weight(rng, name: str, m: int, k: int) -> np.ndarray:
    w = rng.normal(0, 0.05, (m, k)).astype(f32)
    if name == "f16":
        return w.astype(np.float16)
    return quants.quantize(w, dtype_named(name))


def test_the_prefetch_distance_follows_the_cpu_family():
    host, other = host_target(), other_family_target()
    assert {host.prefetch_distance, other.prefetch_distance} == {1024, 4096}
    assert restricted_target(other, ("avx512",)).prefetch_distance == 1024     # x86-64-v3: no family
    zen3 = avx2_only_target(other)                                              # the emulated Zen 3
    assert zen3.cpu == "znver3" and zen3.prefetch_distance == 4096 and not zen3.avx512


# the other family's prefetch distance at one thread count
CASES = [(n, target) for target in ("host", "avx2-only") for n in (1, 3, 4)] + [(3, "other-family")]


@pytest.mark.parametrize(("n_threads", "target"), CASES)
@pytest.mark.parametrize("name", ["q4_0", "q8_0", "q4_1", "q4_k", "q6_k", "f16"])
def test_claimed_chunks_cover_every_row_once(n_threads, target, name):
    rng = np.random.default_rng(3)
    k = 256
    b = backend(n_threads, target)
    for m, batch in [(16, 0), (208, 2), (1000, 0)]:    # 1, 13 and 63 groups of 16 rows
        g = GraphBuilder("g", dims=["T"])
        x_shape = [batch, "T", k] if batch else ["T", k]
        wtype = F16 if name == "f16" else dtype_named(name)
        g.output("y", g.mul_mat(g.weight("w", [m, k], wtype), g.input("x", x_shape, F32)))
        w = _weight(rng, name, m, k)
        run = b.compile(g.graph)
        assert FrameLayout.of(run.plan).counters, "the matmul should claim its chunks"
        for n in (1, 5, 9):      # token generation; repacked gemm in fours + gemv; tiled
            x = rng.normal(0, 1, [batch, n, k] if batch else [n, k]).astype(f32)
            want = run_graph(g.graph, {"w": w, "x": x}, {"T": n}, numerics=b.numerics)["y"]
            for again in range(2):
                got = run({"w": w, "x": x}, {"T": n})["y"]
                differ = got.view(np.uint32) != want.view(np.uint32)
                assert not differ.any(), (f"{name} [{m}, {k}] batch {batch} N={n} on {n_threads} threads "
                                          f"(run {again + 1}): {int(differ.sum())} of {got.size} values differ")
