"""The CUDA plugin's element-wise, layout and row kernels on the emulated device, against the
numpy reference (test-backend-ops' cases, plus cases for the storage types and layouts the
plugin claims that those leave out), and their PTX through ptxas."""

from __future__ import annotations

import numpy as np
from cuda_common import assert_assembles, run_ops
from llamir_cuda import kir

from llamir.ir import BF16, F16, F32, I32, I64, ops
from llamir.ir.dtypes import Q4_0, Q4_K, Q5_1, Q6_K, Q8_0, QUANT_DTYPES
from llamir.testing.backend_ops import FAIL, NOT_SUPPORTED, run_backend_ops
from llamir.testing.backend_ops_cases import GLU, UNARY, build, fixed, integers, params


def run_cases(backend, cases):
    """Every one of `cases` is claimed and passes; returns the kernels the run made."""
    before = {k.key for k in kir.defined_kernels()}
    report = run_backend_ops(backend, cases=cases)
    bad = [r for r in report.results if r.status in (FAIL, NOT_SUPPORTED)]
    assert not bad, "\n".join(r.line() for r in bad[:20])
    return [k for k in kir.defined_kernels() if k.key not in before]


def test_binary(cuda):
    kernels, _ = run_ops(cuda, ["add", "sub", "mul", "div"], min_supported=40)
    assert_assembles(kernels, no_spills=True)


def test_unary(cuda):
    kernels, _ = run_ops(cuda, list(UNARY), min_supported=3 * len(UNARY))
    assert_assembles(kernels, no_spills=True)


def test_unary_storage_types(cuda):
    """f16 and bf16 in and out (test-backend-ops has f16 only): exact ops bit for bit."""
    cases = []
    for name, dtype, bound in (("silu", BF16, 5e-3), ("gelu", BF16, 5e-3), ("neg", BF16, 0.0), ("sqr", F16, 0.0),
                               ("tanh", F16, 1e-6)):
        cases.append(build(name, params(type=dtype, ne=(3, 37)), lambda g, n=name, d=dtype: g.output(
            "out", g.unary(n, g.input("x", (3, 37), d))), lo=-5.0, hi=5.0, max_nmse=bound))
    cases.append(build("scale", params(type="bf16", ne=(4, 19), s=0.5, b=0.25), lambda g: g.output(
        "out", g.scale(g.input("x", (4, 19), BF16), 0.5, 0.25))))
    cases.append(build("clamp", params(type="f16", ne=(4, 19), v="transposed"), lambda g: g.output(
        "out", g.clamp(g.transpose(g.input("x", (19, 4), F16)), -0.5, 0.5)), max_nmse=0.0))
    cases.append(build("fill", params(type="bf16", ne=(4, 19), c=-1.5), lambda g: g.output(
        "out", g.op(ops.Fill(c=-1.5), g.input("x", (4, 19), BF16))), max_nmse=0.0))
    assert_assembles(run_cases(cuda, cases), no_spills=True)


def test_scale_clamp_fill(cuda):
    kernels, _ = run_ops(cuda, ["scale", "clamp", "fill"], min_supported=6)
    assert_assembles(kernels, no_spills=True)


def test_glu(cuda):
    kernels, _ = run_ops(cuda, list(GLU), min_supported=3 * len(GLU))

    def f16_glu(kind: str, form: str):
        def fn(g):
            if form == "split":
                g.output("out", g.glu(kind, g.input("a", (3, 20), F16), g.input("b", (3, 20), F16)))
            else:
                g.output("out", g.glu(kind, g.input("a", (3, 40), F16), swapped=form == "swapped"))
        return build(kind, params(type="f16", ne=(3, 20), form=form), fn, lo=-5.0, hi=5.0, max_nmse=1e-6)
    kernels += run_cases(cuda, [f16_glu(kind, form) for kind in ("swiglu", "geglu_erf") for form in ("split", "fused",
                                                                                                      "swapped")])
    assert_assembles(kernels, no_spills=True)


def test_layout(cuda):
    kernels, _ = run_ops(cuda, ["cont", "concat", "repeat", "view", "reshape", "permute", "transpose"],
                         min_supported=18)
    cases = [
        build("concat", params(type="f16", ne_a=(4, 6), ne_b=(4, 6), dim=1, v="transposed"), lambda g: g.output(
            "out", g.concat(g.transpose(g.input("a", (6, 4), F16)), g.input("b", (4, 6), F16), axis=1)),
            max_nmse=0.0),
        build("concat", params(type="i32", ne_a=(2, 3, 5), ne_b=(4, 3, 5), dim=2), lambda g: g.output(
            "out", g.concat(g.input("a", (2, 3, 5), I32), g.input("b", (4, 3, 5), I32), axis=0)),
            values={"a": integers(-9, 9), "b": integers(-9, 9)}, max_nmse=0.0),
        build("repeat", params(type="bf16", ne=(1, 2, 1, 3), nr=(2, 4, 3, 6)), lambda g: g.output(
            "out", g.repeat(g.input("x", (1, 2, 1, 3), BF16), 2, 4, 3, 6)), max_nmse=0.0),
        build("cont", params(type="i32", ne=(4, 6), perm=(1, 0), shape=(2, 12)), lambda g: g.output(
            "out", g.cont(g.transpose(g.input("x", (6, 4), I32)), 2, 12)), values={"x": integers(-9, 9)},
            max_nmse=0.0),
        build("cont", params(type="q8_0", ne=(3, 2, 64), perm=(1, 0, 2)), lambda g: g.output(
            "out", g.cont(g.permute(g.input("x", (2, 3, 64), Q8_0), 1, 0, 2))), max_nmse=0.0),
    ]
    kernels += run_cases(cuda, cases)
    assert_assembles(kernels, no_spills=True)


def test_cpy(cuda):
    """f32, f16, bf16 and i32 among themselves, floats to every block type and back."""
    kernels, report = run_ops(cuda, ["cpy"], min_supported=39)
    pairs = [(F16, BF16), (BF16, I32), (I32, F16), (F16, I32)]
    cases = [build("cpy", params(type_src=s, type_dst=d, ne=(3, 29)), lambda g, s=s, d=d: g.output(
        "out", g.cast(g.input("x", (3, 29), s), d)), values={"x": integers(-50, 50)} if s == I32 else {},
        lo=-150.0, hi=150.0, max_nmse=0.0) for s, d in pairs]
    cases += [build("cpy", params(type_src=s, type_dst=d, ne=(2, 3, 256), v="permuted"), lambda g, s=s, d=d: g.output(
        "out", g.cast(g.permute(g.input("x", (3, 2, 256), s), 1, 0, 2), d)), max_nmse=1e-6)
        for s, d in ((F16, Q4_0), (BF16, Q4_K), (F32, Q6_K), (Q5_1, BF16), (Q4_K, F16))]
    kernels += run_cases(cuda, cases)
    assert_assembles([k for k in kernels if k.key[0] != "quantize"], no_spills=True)
    assert_assembles([k for k in kernels if k.key[0] == "quantize"])


def _set_rows_tiled(dst, idx: np.ndarray):
    """set_rows of bf16 rows into a [2, 3, 8, 256] dst, the indices `idx` tiled over its batch axes."""
    idx_type = I64 if idx.dtype == np.int64 else I32

    def fn(g):
        g.output("out", g.set_rows(g.state("c", (2, 3, 8, 256), dst), g.input("s", (2, 3, 2, 256), BF16),
                                   g.input("i", idx.shape, idx_type)))
    return build("set_rows", params(type=dst, type_idx=idx_type, ne=(2, 3, 8, 256), idx=idx.shape), fn,
                 values={"i": fixed(idx)}, state=("c",), max_nmse=1e-6)


def test_rows(cuda):
    """get_rows of every type test-backend-ops gives (floats, every block type, i32); set_rows
    into floats and the 32-value block types, i32 and i64 indices; and set_rows into K-quants
    with indices tiled over the batch axes, get_rows of a batch of block-typed matrices."""
    kernels, _ = run_ops(cuda, ["get_rows", "set_rows"], min_supported=31)
    both = np.array([[[5, 2], [0, 7], [3, 1]], [[1, 6], [4, 4], [7, 0]]])
    cases = [_set_rows_tiled(Q4_K, both[:1].astype(np.int64)), _set_rows_tiled(Q6_K, both.astype(np.int32)),
             _set_rows_tiled(F16, both[0, :1].astype(np.int64))]
    cases.append(build("get_rows", params(type="q4_k", ne=(2, 5, 256), r=3, b=2), lambda g: g.output(
        "out", g.get_rows(g.weight("a", (2, 5, 256), Q4_K), g.input("i", (2, 3), I32))),
        values={"i": fixed(np.array([[4, 0, 4], [1, 2, 3]], np.int32))}))
    kernels += run_cases(cuda, cases)
    encoders = [k for k in kernels if k.key[0] == "set_rows" and k.key[3] in {q.name for q in QUANT_DTYPES}]
    assert_assembles([k for k in kernels if k not in encoders], no_spills=True)
    assert_assembles(encoders)


def _varied(rng, shape):
    """Normal values at a different magnitude per row (2^-11 .. 2^11); a row of zeros and one of
    a single value (the encoders' early outs); half-integers up to a largest 127 (q8_0's scale
    is then 1: ties, which x86's round-half-even and the reference's roundf break apart); and
    small integers from -8 (levels q4_0 holds exactly)."""
    x = rng.normal(size=shape) * np.exp2(rng.uniform(-11, 11, (*shape[:-1], 1)))
    x[0], x[1] = 0.0, 0.75
    x[2] = rng.integers(-100, 100, shape[-1]) + 0.5
    x[2, ::32] = 127.0
    x[3] = rng.integers(-8, 8, shape[-1])
    x[3, ::32] = -8.0
    return x


def _cast(src, dst, shape):
    def fn(g):
        g.output("out", g.cast(g.input("x", shape, src), dst))
    return build("cpy", params(type_src=src, type_dst=dst, ne=shape, v="varied"), fn, values={"x": _varied},
                 max_nmse=0.0)


def test_block_types_bit_exact(cuda):
    """Every block type encodes as the reference quantizer and decodes as its dequantizer, value
    for value (bound 0), over rows of varied magnitude."""
    cases = []
    for dtype in QUANT_DTYPES:
        if dtype.name not in ("q8_1", "q8_k"):  # vec_dot types: no cpy claimed, as Vulkan
            shape = (12, 512 if dtype.block_size == 256 else 64)
            cases += [_cast(F32, dtype, shape), _cast(dtype, F32, shape)]
    run_cases(cuda, cases)
