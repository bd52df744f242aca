"""Float matmul tiles per ISA: every tile shape and remainder gives the profile's bits.

The register tiles, the parts of an accumulator wider than the target's vectors, the rows
that share a b load in the vec_dot order and the n-blocks are chosen from the target
(FloatTiles). Each profile is compiled for the host and for an AVX2-only target, with shapes
that reach every remainder (rn = 6 or 3 b rows per tile, 4/2/1 rows per vec_dot group, K
leftovers, several n-blocks) and compared with the numpy reference bit for bit. The
inner loops are also checked to keep their accumulators in registers.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from llamir.ir import BF16, F16, F32, I32, GraphBuilder, run_graph
from llamir.ir.numerics import PROFILES

rng = np.random.default_rng(21)
COMBOS = [(p, t) for p in sorted(PROFILES) for t in ("host", "avx2-only")]


def _target(name: str):
    from llamir.backends.llvm.target import host_target, restricted_target

    return host_target() if name == "host" else restricted_target(host_target(), ("avx512",))


@pytest.fixture(scope="module", params=COMBOS, ids=[f"{p}-{t}" for p, t in COMBOS])
def backend(request):
    from llamir.backends.llvm import LLVMBackend

    profile, target = request.param
    b = LLVMBackend(n_threads=2, target=_target(target), disk_cache=False, numerics=profile)
    b.precompile([_tile_graph(dtype, *shape) for shape in SHAPES for dtype in (F32, F16, BF16)])   # in parallel
    yield b
    b.close()


def _same(backend, graph, values, bindings=None):
    want = run_graph(graph, dict(values), bindings, numerics=backend.numerics, n_threads=backend.n_threads)
    got = backend.compile(graph)(dict(values), bindings or {})
    for name, w in want.items():
        g = got[name]
        assert g.shape == w.shape and g.dtype == w.dtype, name
        equal = (g.view(np.uint32) == w.view(np.uint32)) | (np.isnan(g) & np.isnan(w))
        assert equal.all(), f"{name}: {int((~equal).sum())} of {equal.size} values differ"


def _weight(x: np.ndarray, dtype):
    return {F32: x, F16: x.astype(np.float16), BF16: (x.view(np.uint32) >> 16).astype(np.uint16)}[dtype]


# (M, N, K): N = 2..13 reaches each remainder of 6 and of 3 b rows; M = 4, 8, 20 gives whole
# and partial 16-row units; M = 7, 21, 30 go to vec_dot (M % 4 != 0) with 4/2/1-row remainders;
# K = 96 and 160 are whole 32-steps, K = 200 leaves a tail; N = 1 is the vec_dot order.
SHAPES = [(20, n, 64) for n in range(2, 14)] + [
    (8, 7, 96), (4, 5, 160), (16, 9, 200), (7, 3, 64), (21, 5, 128), (30, 1, 200), (33, 1, 71), (48, 1, 256),
    (64, 40, 32), (12, 7, 800),
]


def _tile_graph(dtype, m: int, n: int, k: int):
    g = GraphBuilder("g")
    g.output("y", g.mul_mat(g.weight("a", [m, k], dtype), g.input("b", [n, k], F32)))
    return g.graph


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_tiles_and_remainders(backend, dtype, m, n, k):
    _same(backend, _tile_graph(dtype, m, n, k), {"a": _weight(rng.standard_normal((m, k)).astype(np.float32), dtype),
                             "b": rng.standard_normal((n, k)).astype(np.float32)})


@pytest.mark.parametrize("dtype", [F32, F16], ids=str)
def test_many_n_blocks(backend, dtype):
    """K = 2048 makes n-blocks of ~30 (AVX2) or ~126 (AVX-512) b rows: N = 300 crosses several,
    the last one partial, as ffn_down of a 110M model in prompt processing."""
    m, n, k = 32, 300, 2048
    g = GraphBuilder("g")
    g.output("y", g.mul_mat(g.weight("a", [m, k], dtype), g.input("b", [n, k], F32)))
    _same(backend, g.graph, {"a": _weight(rng.standard_normal((m, k)).astype(np.float32), dtype),
                             "b": rng.standard_normal((n, k)).astype(np.float32)})


def test_batched_strided(backend):
    """Broadcast batches (a [2, 1, M, K] against b [2, 3, N, K]) through the same tiles."""
    m, n, k = 12, 5, 96
    g = GraphBuilder("g")
    a = g.weight("a", [2, 1, m, k], F16)
    b = g.input("b", [2, 3, n, k], F32)
    g.output("y", g.mul_mat(a, b))
    _same(backend, g.graph, {"a": rng.standard_normal((2, 1, m, k)).astype(np.float16),
                             "b": rng.standard_normal((2, 3, n, k)).astype(np.float32)})


@pytest.mark.parametrize("dtype", [F32, F16], ids=str)
@pytest.mark.parametrize("m", [24, 23])
def test_mul_mat_id(backend, dtype, m):
    n_expert, k, T, used = 4, 200, 5, 2
    g = GraphBuilder("g", dims=["T"])
    w = g.weight("w", [n_expert, m, k], dtype)
    x = g.input("x", ["T", 1, k], F32)
    ids = g.input("ids", ["T", used], I32)
    g.output("y", g.mul_mat_id(w, x, ids))
    _same(backend, g.graph, {"w": _weight(rng.standard_normal((n_expert, m, k)).astype(np.float32), dtype),
                             "x": rng.standard_normal((T, 1, k)).astype(np.float32),
                             "ids": rng.integers(0, n_expert, (T, used)).astype(np.int32)}, {"T": T})


# -- the inner loops keep their accumulators in registers ---------------------------------------
def _kernel_asm(target, profile: str, dtype, m: int, n: int, k: int) -> str:
    import llvmlite.binding as llvm

    import llamir.backends.llvm.backend as backend_mod
    from llamir.backends.llvm import LLVMBackend
    from llamir.backends.llvm.compiler import parse_and_verify

    texts = []
    real = backend_mod.optimize_and_emit

    def spy(module, tgt, *args, **kwargs):
        if module.name.startswith("llamir_MatMulFloat"):
            ref = parse_and_verify(module, llvm.create_context())
            machine = tgt.machine()
            ref.triple, ref.data_layout = tgt.triple, str(machine.target_data)
            pto = llvm.create_pipeline_tuning_options(speed_level=3)
            pto.loop_vectorization = pto.slp_vectorization = pto.loop_unrolling = True
            pb = llvm.create_pass_builder(machine, pto)
            pb.getModulePassManager().run(ref, pb)
            texts.append(machine.emit_assembly(ref))
        return real(module, tgt, *args, **kwargs)

    backend_mod.optimize_and_emit = spy
    try:
        be = LLVMBackend(n_threads=1, target=target, disk_cache=False, numerics=profile, compile_workers=1)
        g = GraphBuilder("g")
        g.output("y", g.mul_mat(g.weight("a", [m, k], dtype), g.input("b", [n, k], F32)))
        be.compile(g.graph)
        be.close()
    finally:
        backend_mod.optimize_and_emit = real
    assert texts, "no MatMulFloat module was compiled"
    return "\n".join(texts)


def _hot_loops(asm: str) -> list[list[str]]:
    """Bodies of the loops (a label to the backward branch to it) holding at least 4 fmas (one
    row's vec_dot step: an f16 gemv on AVX2 takes its rows one at a time)."""
    lines = asm.splitlines()
    loops = []
    for i, line in enumerate(lines):
        label = re.match(r"^(\.LBB\d+_\d+):", line)
        if not label:
            continue
        for j in range(i + 1, min(len(lines), i + 400)):
            if re.match(r"^\.LBB\d+_\d+:", lines[j]):
                break
            if re.search(rf"\bj\w+\s+{re.escape(label.group(1))}$", lines[j]):
                body = lines[i:j + 1]
                if sum("vfmadd" in x for x in body) >= 4:
                    loops.append(body)
                break
    return loops


@pytest.mark.parametrize("profile,target", COMBOS)
@pytest.mark.parametrize("n", [1, 64], ids=["vec_dot", "tinyblas"])
def test_inner_loops_do_not_spill(profile, target, n):
    """No stack access in the hot loops of f32 and f16 matmuls (the 4 x 6 tile of 16-lane
    accumulators spilled on AVX2's 16 registers, as did four rows of vec_dot accumulators)."""
    tgt = _target(target)
    if target == "avx2-only" and not tgt.has("avx2"):
        pytest.skip("host without AVX2")
    for dtype in (F32, F16):
        loops = _hot_loops(_kernel_asm(tgt, profile, dtype, 64, n, 768))
        assert loops, f"{dtype}: no vectorised inner loop found"
        for body in loops:
            spills = [x for x in body if "rsp" in x]
            assert not spills, f"{dtype} {profile} on {target}: {len(spills)} stack accesses in a hot loop"


@pytest.mark.parametrize("n", [1, 6], ids=["vec_dot", "tinyblas"])
def test_bf16_denormals_and_specials(backend, n):
    """vdpbf16ps flushes denormal inputs and results (DAZ, FTZ): denormal weights, products that
    underflow, sums that cancel to denormals, infinities and NaNs give the reference's bits
    whether the instruction is emulated or native (AVX512_BF16 hosts with the avx512 profile)."""
    m, k = 8, 128
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[0, ::3] = 3e-39                       # denormal weights
    x[1] = 1e-20                            # products 1e-40: denormal
    x[2, :64] = 1.5e-38
    x[2, 64:] = -1.5e-38                    # sums cancelling near the smallest normal
    x[3, 5] = np.inf
    x[4, 7] = np.nan
    b = rng.standard_normal((n, k)).astype(np.float32)
    b[:, 1::2] *= 1e-20
    b[:, 0] = 2e-39
    g = GraphBuilder("g")
    g.output("y", g.mul_mat(g.weight("a", [m, k], BF16), g.input("b", [n, k], F32)))
    _same(backend, g.graph, {"a": _weight(x, BF16), "b": b})


@pytest.mark.parametrize("k", [96, 1088, 1100])
def test_run_time_k(backend, k):
    """K known only at run time (as n_kv in attention's kq @ v): chunks computed per call; 1100 is
    not a multiple of 32, so the avx512 profile's bf16 and other lane counts may leave tinyBLAS."""
    m, n = 8, 7
    g = GraphBuilder("g", dims=["K"])
    g.output("y", g.mul_mat(g.input("a", [m, "K"], F16), g.input("b", [n, "K"], F32)))
    _same(backend, g.graph, {"a": rng.standard_normal((m, k)).astype(np.float16),
                             "b": rng.standard_normal((n, k)).astype(np.float32)}, {"K": k})
