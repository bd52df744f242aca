"""The CUDA plugin's mul_mat and mul_mat_id with float weights on the emulated device, against the
numpy reference (test-backend-ops' cases, then cases that take each kernel path), and their PTX
through ptxas (no spills).

The direct cases bound the error at 1e-10 (NMSE): every product is exact once b is rounded to the
weight's vec_dot_type, so only the order of the f32 sums differs from ggml's CPU; leaving b
unrounded would cost ~1e-8 for f16 weights and ~1e-6 for bf16."""

from __future__ import annotations

import pytest
from cuda_common import assert_assembles, run_ops
from llamir_cuda import kir
from llamir_cuda.lowering import Lowering

from llamir.ir import BF16, F16, F32, I32, DType
from llamir.testing.backend_ops import OK, run_backend_ops
from llamir.testing.backend_ops_cases import Case, build, integers, params

EXACT = 1e-10
FLOATS = ("type_a=f32,", "type_a=f16,", "type_a=bf16,")


@pytest.fixture
def launched(monkeypatch) -> list[kir.Kernel]:
    """The kernels every lowering of the test launches (kernels are made once per process, so
    a test sees the ones it ran whichever test made them first)."""
    kernels: list[kir.Kernel] = []
    launch = Lowering.launch

    def record(self, kernel, grid, args, name=""):
        kernels.append(kernel)
        launch(self, kernel, grid, args, name)

    monkeypatch.setattr(Lowering, "launch", record)
    return kernels


def _run(backend, cases: list[Case]) -> None:
    report = run_backend_ops(backend, cases=cases)
    bad = [r for r in report.results if r.status != OK]
    assert not bad, "\n".join(f"{r.line()} {r.message}" for r in bad)


def _names(kernels: list[kir.Kernel]) -> set[str]:
    return {k.key[0] for k in kernels}


def _mul_mat(a_shape, a_dtype: DType, b_shape, b_dtype: DType = F32, b_view=None, what: str = "") -> Case:
    """d = mul_mat(a, b) of an input a and an input b, b seen through `b_view(g, b)` if given."""
    def fn(g):
        b = g.input("b", b_shape, b_dtype)
        g.output("out", g.mul_mat(g.input("a", a_shape, a_dtype), b_view(g, b) if b_view else b))
    text = params(type_a=a_dtype, type_b=b_dtype, a=a_shape, b=b_shape, v=what)
    return build("mul_mat", text, fn, max_nmse=EXACT)


def _mul_mat_id(dtype: DType, n_experts: int, n_used: int, m: int, k: int, n_tokens: int, n_b: int,
                chosen: int) -> Case:
    """mul_mat_id with ids drawn from the first `chosen` experts."""
    def fn(g):
        g.output("out", g.mul_mat_id(g.weight("as", (n_experts, m, k), dtype), g.input("b", (n_tokens, n_b, k), F32),
                                     g.input("ids", (n_tokens, n_used), I32)))
    text = params(type_a=dtype, n_mats=n_experts, n_used=n_used, m=m, k=k, n=n_tokens, b=n_b, chosen=chosen)
    return build("mul_mat_id", text, fn, values={"ids": integers(0, chosen)}, max_nmse=EXACT)


# -- test-backend-ops ------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["mul_mat", "mul_mat_id"])
def test_backend_ops(cuda, launched, op):
    _, report = run_ops(cuda, [op])
    unclaimed = [r.name for r in report.results if r.params.startswith(FLOATS) and r.status != OK]
    assert not unclaimed, f"float cases not claimed: {unclaimed}"
    paths = {"mul_mv", "mul_mm_fma", "mul_mm_mma"} if op == "mul_mat" else {"mul_mv_id"}
    assert {n for n in _names(launched) if not n.startswith("mmq")} == paths  # mmq: kernels_quant's
    assert_assembles(set(launched), no_spills=True)


# -- each path -------------------------------------------------------------------------------------
def test_matrix_vector(cuda, launched):
    """mul_mv: vector loads (K a multiple of 8), element loads (K = 45), an f16 b, broadcast batches."""
    _run(cuda, [
        _mul_mat((70, 256), F16, (3, 256)), _mul_mat((70, 256), BF16, (8, 256)), _mul_mat((33, 45), F32, (2, 45)),
        _mul_mat((40, 64), F16, (5, 64), F16), _mul_mat((40, 64), BF16, (5, 64), F16),
        _mul_mat((1, 2, 24, 64), F16, (3, 4, 2, 64)), _mul_mat((2, 1, 24, 40), F32, (2, 3, 1, 40)),
    ])
    assert _names(launched) == {"mul_mv"}
    assert {1, 4, 8} <= {k.key[5] for k in launched}  # (name, ta, tb, vdt, n_cols, width, ...)
    assert_assembles(set(launched), no_spills=True)


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_mma_tiles(cuda, launched, dtype):
    """mul_mm_mma over tiles cut by M, N and K (K odd: element staging; K = 72: vector staging with a
    partial stage), an f16 b, broadcast batches and a permuted b (GQA's q)."""
    permuted = lambda g, b: g.permute(b, 0, 2, 1, 3)  # noqa: E731 - [1, T, 4, 64] -> [1, 4, T, 64]
    _run(cuda, [
        _mul_mat((70, 37), dtype, (75, 37)), _mul_mat((130, 72), dtype, (65, 72)),
        _mul_mat((40, 64), dtype, (20, 64), F16),
        _mul_mat((1, 2, 40, 64), dtype, (3, 4, 17, 64)),
        _mul_mat((1, 2, 40, 64), dtype, (1, 20, 4, 64), b_view=permuted, what="permuted"),
    ])
    assert _names(launched) == {"mul_mm_mma"}
    assert {(1, 1), (8, 4)} <= {k.key[4] for k in launched}
    assert_assembles(set(launched), no_spills=True)


def test_fma_tiles(cuda, launched):
    """mul_mm_fma (f32 weights) over ragged tiles, an f16 b, broadcast batches and a transposed b."""
    transposed = lambda g, b: g.transpose(b)  # noqa: E731 - b [64, 20] read as [20, 64]
    _run(cuda, [
        _mul_mat((67, 19), F32, (70, 19)), _mul_mat((33, 40), F32, (100, 40)),
        _mul_mat((40, 64), F32, (20, 64), F16),
        _mul_mat((2, 1, 24, 32), F32, (2, 3, 9, 32)),
        _mul_mat((40, 64), F32, (64, 20), b_view=transposed, what="transposed"),
    ])
    assert _names(launched) == {"mul_mm_fma"}
    assert_assembles(set(launched), no_spills=True)


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_mul_mat_id_tiles(cuda, launched, dtype):
    """More than MV_MAX_COLS tokens: mul_mat_id_pairs, then the tiles per expert; b per token or per
    slot, and 300 pairs (more than one block's scan) that leave expert 3 unchosen."""
    _run(cuda, [
        _mul_mat_id(dtype, 4, 2, 40, 64, 20, 1, 4), _mul_mat_id(dtype, 4, 2, 40, 64, 20, 2, 4),
        _mul_mat_id(dtype, 4, 2, 16, 32, 150, 1, 3),
    ])
    assert _names(launched) == {"mul_mat_id_pairs", "mul_mm_fma" if dtype == F32 else "mul_mm_mma"}
    assert_assembles(set(launched), no_spills=True)
