"""The CUDA plugin's quantized-weight mul_mat / mul_mat_id (kernels_quant.py) on the emulated device,
against the numpy reference (test-backend-ops, and cases aimed at each kernel path), and their PTX
through ptxas for sm_80 and sm_90, without spills."""

from __future__ import annotations

import pytest
from cuda_common import assert_assembles, run_ops
from llamir_cuda import kernels_quant
from llamir_cuda.kernels_quant import BM, MV_MAX_COLS, SPECS, BLayout

from llamir.ir import F16, F32, I32, GraphBuilder
from llamir.ir.dtypes import BF16, dtype_named
from llamir.testing.backend_ops import OK, run_backend_ops
from llamir.testing.backend_ops_cases import build, integers, params

TYPES = sorted(SPECS)
# test-backend-ops's quantized cases: mul_mat 10 types x 2 + 5 types x 10 shapes... (every one claimed)
N_MUL_MAT_QUANT = 2 * len(TYPES) + 5 * len(TYPES) + 2 * 5
N_MUL_MAT_ID_QUANT = 2 * len(TYPES)
# far below any wrong scale or level; the kernels see b exactly as the reference converts it, so
# only the order of float sums differs
MAX_NMSE = 1e-9


def _k(type_name: str) -> int:
    """A K of two tile steps, the second partial for the 32-element types (9 chunks)."""
    return 512 if SPECS[type_name].qk == 256 else 288


def _mul_mat_case(type_name: str, m: int, n: int, b_dtype=F32):
    dtype, k = dtype_named(type_name), _k(type_name)
    return build("mul_mat", params(type_a=type_name, type_b=b_dtype.name, m=m, n=n, k=k), lambda g: g.output(
        "out", g.mul_mat(g.weight("a", (m, k), dtype), g.input("b", ("T", k), b_dtype))), ("T",),
        bindings={"T": n}, max_nmse=MAX_NMSE)


def _mul_mat_id_case(type_name: str, m: int, n_tokens: int, n_b: int):
    dtype, k, n_mats, n_used = dtype_named(type_name), _k(type_name), 4, 2

    def fn(g):
        g.output("out", g.mul_mat_id(g.weight("as", (n_mats, m, k), dtype), g.input("b", ("T", n_b, k), F32),
                                     g.input("ids", ("T", n_used), I32)))

    text = params(type_a=type_name, n_mats=n_mats, n_used=n_used, b=n_b, m=m, n=n_tokens, k=k)
    return build("mul_mat_id", text, fn, ("T",), bindings={"T": n_tokens}, values={"ids": integers(0, n_mats)},
                 max_nmse=MAX_NMSE)


def _run(cuda, cases):
    report = run_backend_ops(cuda, cases=cases)
    bad = [r for r in report.results if r.status != OK]
    assert not bad, "\n".join(r.line() for r in bad)


def test_backend_ops_mul_mat(cuda):
    kernels, report = run_ops(cuda, ["mul_mat"], min_supported=N_MUL_MAT_QUANT)
    quantized = [r for r in report.results if "type_a=q" in r.params]
    assert len(quantized) == N_MUL_MAT_QUANT and all(r.status == OK for r in quantized)
    assert_assembles(kernels, no_spills=True)


def test_backend_ops_mul_mat_id(cuda):
    kernels, report = run_ops(cuda, ["mul_mat_id"], min_supported=N_MUL_MAT_ID_QUANT)
    assert all(r.status == OK for r in report.results if "type_a=q" in r.params)
    assert_assembles(kernels, no_spills=True)


@pytest.mark.parametrize("type_name", TYPES)
def test_paths(cuda, type_name):
    """Matrix-vector with one column and with MV_MAX_COLS, tiles with 40 columns (a partial column
    tile) and BM + 8 rows (a partial row tile); mul_mat_id per pair and tiled over 40 tokens."""
    cases = [_mul_mat_case(type_name, 20, 1), _mul_mat_case(type_name, 20, MV_MAX_COLS),
             _mul_mat_case(type_name, BM + 8, 40),
             _mul_mat_id_case(type_name, 20, 3, 1), _mul_mat_id_case(type_name, BM + 8, 40, 1),
             _mul_mat_id_case(type_name, 24, 40, 2)]
    _run(cuda, cases)


def test_f16_activations(cuda):
    _run(cuda, [_mul_mat_case(name, 24, n, F16) for name in ("q4_0", "q4_1", "q4_k") for n in (1, 40)])


def test_supports():
    """Every type of SPECS with f32 / f16 activations; not float weights, not bf16 activations."""
    g = GraphBuilder("t")

    def mul_mat(a_dtype, b_dtype):
        return g.mul_mat(g.weight(f"a{len(g.graph.nodes)}", (8, 256), a_dtype), g.input(f"b{len(g.graph.nodes)}",
                                                                                         (3, 256), b_dtype))

    assert all(kernels_quant.supports(mul_mat(dtype_named(name), b)) for name in TYPES for b in (F32, F16))
    assert not kernels_quant.supports(mul_mat(F16, F32))
    assert not kernels_quant.supports(mul_mat(dtype_named("q4_0"), BF16))


@pytest.mark.parametrize("type_name", TYPES)
def test_assembles(type_name):
    spec = SPECS[type_name]
    align = 16 if spec.size % 16 == 0 else 4 if spec.size % 4 == 0 else 2
    kernels = [kernels_quant._matvec_kernel(type_name, n, align, False) for n in (1, MV_MAX_COLS)]
    kernels += [kernels_quant._matvec_kernel(type_name, 1, align, True),
                kernels_quant._tile_kernel(type_name, align, False), kernels_quant._tile_kernel(type_name, align, True)]
    assert_assembles(kernels, no_spills=True)


@pytest.mark.parametrize("vdt", ["q8_0", "q8_1", "q8_k"])
def test_b_layout(vdt):
    """The kernels read b's converted qs as 16-byte vectors and q8_K's bsums as 8-byte pairs (a
    misaligned vector load faults on a GPU, not on the emulator): a row's fields start 16-aligned
    and do not overlap (qs n_k bytes, d 4 per block, sums 4 per chunk, q8_K 8)."""
    block = 256 if vdt == "q8_k" else 32
    for n_k in range(block, 8 * 1024 + 1, block):
        layout = BLayout.of(vdt, n_k)
        assert layout.sums_at % 16 == 0 and layout.pitch % 16 == 0, (n_k, layout)
        assert layout.sums_at >= n_k + 4 * (n_k // block), (n_k, layout)
        assert layout.pitch >= layout.sums_at + 4 * (n_k // 32) * (2 if vdt == "q8_k" else 1), (n_k, layout)
