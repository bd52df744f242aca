"""Both numerics profiles on the LLVM backend, on this host's target and on an AVX2-only one.

The ops whose bits differ between ggml's AVX-512 and AVX2 builds (v_expf/silu/softmax chunks,
the variance sum, float matmuls with tinyBLAS and vec_dot, bf16 dots, flash attention's three
paths) are compiled for each profile and compared with the numpy reference running the same
profile, bit for bit. The restricted target (no AVX-512) makes an AVX-512 host run the code
an AVX2-only machine gets; on an AVX2 host both targets are the same code.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from llamir.ir import BF16, F16, F32, GraphBuilder, dtype_named, quants, run_graph
from llamir.ir.numerics import PROFILES

pytestmark = pytest.mark.slow
rng = np.random.default_rng(8)
COMBOS = [(p, t) for p in sorted(PROFILES) for t in ("host", "avx2-only")]


@pytest.fixture(scope="module", params=COMBOS, ids=[f"{p}-{t}" for p, t in COMBOS])
def backend(request):
    from llamir.backends.llvm import LLVMBackend
    from llamir.backends.llvm.target import host_target, restricted_target

    profile, target = request.param
    tgt = host_target() if target == "host" else restricted_target(host_target(), ("avx512",))
    b = LLVMBackend(n_threads=2, target=tgt, disk_cache=False, numerics=profile)
    b.precompile([_matmul_graph(dtype, *shape) for shape in MATMULS for dtype in (F32, F16, BF16)]
                 + [_flash_graph(*case) for case in FLASH_CASES]
                 + [_flash_rows_graph(*case) for case in FLASH_ROWS_CASES])  # the tests' kernels, in parallel
    yield b
    b.close()


def same(backend, graph, values, bindings=None):
    want = run_graph(graph, dict(values), bindings, numerics=backend.numerics, n_threads=backend.n_threads)
    got = backend.compile(graph)(dict(values), bindings or {})
    for name, w in want.items():
        g = got[name]
        assert g.shape == w.shape and g.dtype == w.dtype, name
        equal = (g.view(np.uint32) == w.view(np.uint32)) | (np.isnan(g) & np.isnan(w))
        assert equal.all(), f"{name}: {int((~equal).sum())} of {equal.size} values differ"


def _f32(shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


@pytest.mark.parametrize("n,scale", [(37, 6), (250, 6), (256, 6), (256, 60)])
def test_soft_max_silu_norm(backend, n, scale):
    """scale 60 puts some lanes of v_expf's vectors past |n| > 126 and 192 (the far path, taken
    when any lane needs it) and leaves the others near."""
    b = GraphBuilder("g")
    x = b.input("x", [1, 4, 5, n], F32)
    mask = b.input("m", [1, 1, 5, n], F16)
    sinks = b.input("s", [4], F32)
    b.output("soft_max", b.soft_max_ext(x, mask, 0.125))
    b.output("alibi_sinks", b.soft_max_ext(x, mask, 0.125, max_bias=8.0, sinks=sinks))
    b.output("silu", b.silu(x))
    b.output("swiglu", b.swiglu(x, b.scale(x, 0.5)))
    b.output("norm", b.norm(x, 1e-5))
    m = np.zeros((1, 1, 5, n), np.float32)
    m[..., n - 3:] = -np.inf
    same(backend, b.graph, {"x": _f32((1, 4, 5, n), scale), "m": m.astype(np.float16), "s": _f32((4,))})


MATMULS = [(256, 1, 64), (96, 1, 200), (40, 1, 71), (40, 1, 125), (256, 7, 64), (250, 7, 64), (64, 3, 72),
           (64, 5, 256), (48, 2, 96)]


def _matmul_graph(dtype, m: int, n: int, k: int):
    b = GraphBuilder("g")
    b.output("y", b.mul_mat(b.weight("a", [m, k], dtype), b.input("b", [n, k], F32)))
    return b.graph


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
@pytest.mark.parametrize("m,n,k", MATMULS)
def test_float_matmul(backend, dtype, m, n, k):
    x = _f32((m, k))
    a = {F32: x, F16: x.astype(np.float16), BF16: (x.view(np.uint32) >> 16).astype(np.uint16)}[dtype]
    same(backend, _matmul_graph(dtype, m, n, k), {"a": a, "b": _f32((n, k))})


def _kv(shape, dtype: str):
    x = _f32(shape)
    return {"f32": x, "f16": x.astype(np.float16)}.get(dtype) if dtype in ("f32", "f16") else \
        quants.quantize(x, dtype_named(dtype))


FLASH_CASES = [
    (1, 256, "f16", "f16", 64), (7, 256, "f32", "f32", 64), (70, 200, "f16", "f16", 64), (64, 128, "f32", "f32", 64),
    (1, 600, "f16", "f16", 64), (1, 512, "f32", "f32", 64), (9, 256, "q8_0", "q8_0", 64), (3, 256, "q4_0", "f16", 64),
    (67, 130, "f16", "f16", 128), (64, 70, "f32", "f32", 80),     # the tiled kernel's other register blocks
]


def _flash_graph(n_tok: int, n_kv: int, k_type: str, v_type: str, dk: int):
    b = GraphBuilder("g")
    q = b.input("q", [1, 4, n_tok, dk], F32)
    k = b.input("k", [1, 2, n_kv, dk], dtype_named(k_type))
    v = b.input("v", [1, 2, n_kv, dk], dtype_named(v_type))
    mask = b.input("m", [1, 1, n_tok, n_kv], F16)
    sinks = b.input("s", [4], F32)
    b.output("y", b.flash_attn_ext(q, k, v, mask, 1 / math.sqrt(dk), sinks=sinks))
    return b.graph


@pytest.mark.parametrize("n_tok,n_kv,k_type,v_type,dk", FLASH_CASES)
def test_flash_attn(backend, n_tok, n_kv, k_type, v_type, dk):
    m = np.zeros((n_tok, n_kv), np.float32)
    for t in range(n_tok):
        m[t, n_kv - n_tok + t + 1:] = -np.inf
    same(backend, _flash_graph(n_tok, n_kv, k_type, v_type, dk),
         {"q": _f32((1, 4, n_tok, dk)), "k": _kv((1, 2, n_kv, dk), k_type), "v": _kv((1, 2, n_kv, dk), v_type),
          "m": m.astype(np.float16)[None, None], "s": _f32((4,), 2) + 2})


FLASH_ROWS_CASES = [
    (0.0, 0.0, True, "f16"), (30.0, 8.0, True, "f16"), (0.0, 0.0, False, "f16"), (0.0, 0.0, True, "f32"),
    (0.0, 0.0, True, "q8_0"),
]


def _flash_rows_graph(softcap: float, max_bias: float, masked: bool, v_type: str):
    n_tok, n_kv = 5, 600
    dk = 64 if v_type == "q8_0" else 72   # q8_0 rows are whole 32-element blocks
    b = GraphBuilder("g")
    q = b.input("q", [1, 4, n_tok, dk], F32)
    k = b.input("k", [1, 2, n_kv, dk], dtype_named(v_type))
    v = b.input("v", [1, 2, n_kv, dk], dtype_named(v_type))
    mask = b.input("m", [1, 1, n_tok, n_kv], F16) if masked else None
    b.output("y", b.flash_attn_ext(q, k, v, mask, 1 / math.sqrt(dk), max_bias=max_bias, logit_softcap=softcap))
    return b.graph


@pytest.mark.parametrize("softcap,max_bias,masked,v_type", FLASH_ROWS_CASES)
def test_flash_attn_rows(backend, softcap, max_bias, masked, v_type):
    """The row path's live-cell list over several blocks of cells: holes in the mask, a row
    with no live cell, late new maxima, a head size with a 16-lane tail, softcap and ALiBi, no
    mask, an f32 and a quantized V."""
    n_tok, n_kv = 5, 600
    dk = 64 if v_type == "q8_0" else 72
    k_type = v_type
    graph = _flash_rows_graph(softcap, max_bias, masked, v_type)
    m = np.where(rng.random((n_tok, n_kv)) < 0.3, -np.inf, rng.standard_normal((n_tok, n_kv))).astype(np.float32)
    m[2] = -np.inf                      # no live cell: y is 0
    m[3, 500:] = 4.0                    # a new maximum late in the row, past the first block
    values = {"q": _f32((1, 4, n_tok, dk), 2), "k": _kv((1, 2, n_kv, dk), k_type), "v": _kv((1, 2, n_kv, dk), v_type)}
    if masked:
        values["m"] = m.astype(np.float16)[None, None]
    same(backend, graph, values)
