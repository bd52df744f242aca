"""The CUDA plugin's norm, reduction, sort, rope and softmax kernels on the emulated device,
against the numpy reference (test-backend-ops' cases, then cases for what those do not reach:
1024-thread blocks, f16/bf16 storage, tiled weights, sort keys at the edges of f32, large rope
positions, ALiBi slopes on a graded mask, softmax rows past the register cache), and their PTX
through ptxas."""

from __future__ import annotations

import numpy as np
from cuda_common import assert_assembles, run_ops
from llamir_cuda import kir

from llamir.ir import BF16, F16, F32, I32, ops
from llamir.testing.backend_ops import OK, run_backend_ops
from llamir.testing.backend_ops_cases import build, fixed, params, uniform


def run_cases(backend, cases):
    """Every case runs on the backend (none unclaimed) and matches the reference; returns the
    kernels the run made."""
    before = {k.key for k in kir.defined_kernels()}
    report = run_backend_ops(backend, cases=cases)
    bad = [r for r in report.results if r.status != OK]
    assert not bad, "\n".join(r.line() + " " + r.message for r in bad)
    return [k for k in kir.defined_kernels() if k.key not in before]


def _unary(op_name, op, shape, dtype=F32, **kw):
    return build(op_name, params(type=dtype, ne=shape), lambda g: g.output("out", g.op(op, g.input("x", shape, dtype))),
                 lo=-4.0, hi=4.0, **kw)


def _fused(op, x_shape, w_shape, x_dtype, w_dtype, bias: bool):
    def fn(g):
        x, w = g.input("x", x_shape, x_dtype), g.weight("w", w_shape, w_dtype)
        extra = (g.weight("b", w_shape, w_dtype),) if bias else ()
        g.output("out", g.op(op, x, w, *extra))
    return build(op.name, params(type=x_dtype, ne=x_shape, w=w_shape, type_w=w_dtype), fn, lo=-4.0, hi=4.0,
                 max_nmse=1e-7 if x_dtype != BF16 else 1e-6)  # the roundings of the composition, as the reference


def test_norms(cuda):
    kernels, _ = run_ops(cuda, ["rms_norm", "norm", "l2_norm", "group_norm", "rms_norm_mul", "norm_mul_add"],
                         min_supported=28)
    kernels += run_cases(cuda, [
        _unary("rms_norm", ops.RmsNorm(eps=1e-6), (2, 1500)),                       # 1024 threads a row
        _unary("norm", ops.Norm(eps=1e-5), (3, 1100)),
        _unary("l2_norm", ops.L2Norm(eps=1e-12), (2, 4096)),
        _unary("rms_norm", ops.RmsNorm(eps=1e-6), (3, 40), F16),
        _unary("norm", ops.Norm(eps=1e-5), (3, 40), BF16, max_nmse=1e-5),
        _unary("group_norm", ops.GroupNorm(n_groups=3, eps=1e-5), (2, 7, 16, 40)),  # a short last group
        _unary("group_norm", ops.GroupNorm(n_groups=2, eps=1e-6), (5, 3, 4), F16),
        _fused(ops.RmsNormMul(eps=1e-6), (4, 6, 32), (2, 1, 32), F32, F32, bias=False),  # w tiled on rows
        _fused(ops.RmsNormMul(eps=1e-6), (3, 32), (16,), F16, F32, bias=False),         # and along the row
        _fused(ops.NormMulAdd(eps=1e-5, bias=True), (3, 1200), (1200,), BF16, F16, bias=True),
        _fused(ops.NormMulAdd(eps=1e-5, bias=True), (4, 24), (2, 24), F16, BF16, bias=True),
    ])
    assert_assembles(kernels, no_spills=True)


def _edges(rng, shape):
    """Ties, signed zeros and infinities, NaNs of either sign: numpy's stable argsort counts -0
    equal to +0 and puts every NaN last."""
    x = np.round(rng.uniform(-3, 3, shape), 0).astype(np.float32)
    pick = rng.uniform(size=shape)
    x[pick < 0.1] = -0.0
    x[(pick >= 0.1) & (pick < 0.15)] = np.inf
    x[(pick >= 0.15) & (pick < 0.2)] = -np.inf
    x[(pick >= 0.2) & (pick < 0.25)] = np.nan
    x[(pick >= 0.25) & (pick < 0.3)] = np.copysign(np.float32(np.nan), np.float32(-1))
    return x


def test_reductions_and_sorts(cuda):
    kernels, _ = run_ops(cuda, ["sum_rows", "mean", "sum", "argsort", "top_k"], min_supported=21)
    cases = [
        _unary("sum_rows", ops.SumRows(), (2, 3000)),
        _unary("mean", ops.Mean(), (4, 5, 33), F16),
        _unary("sum", ops.Sum(), (3, 700), BF16, max_nmse=5e-3),                    # 2100 values, one block
    ]
    for descending in (False, True):
        for n in (1, 4096):
            cases.append(build("argsort", params(type="f32", ne=(2, n), order=descending, v="edges"),
                               lambda g, n=n, d=descending: g.output("out", g.argsort(g.input("x", (2, n), F32), d)),
                               max_nmse=0.0, values={"x": _edges}))
    cases.append(build("top_k", params(type="f32", ne=(3, 77), k=77, v="edges"), lambda g: g.output(
        "out", g.top_k(g.permute(g.input("x", (77, 3), F32), 1, 0), 77)), max_nmse=0.0, values={"x": _edges}))
    kernels += run_cases(cuda, cases)
    assert_assembles(kernels, no_spills=True)


FAR = np.array([0, 7, 4096, 100_000, 524_287], np.int32)


def _rope(mode, dtype, n_dims, head, ext_factor=0.0, freq_base=10000.0, permuted=False):
    def fn(g):
        if permuted:  # x a strided view: [H, T, d] seen as [T, H, d]
            x = g.permute(g.input("x", (3, "T", head), dtype), 1, 0, 2)
        else:
            x = g.input("x", ("T", 3, head), dtype)
        g.output("out", g.rope_ext(x, g.input("p", ("T",), I32), n_dims=n_dims, mode=mode, n_ctx_orig=32768,
                                   freq_base=freq_base, freq_scale=0.125 if ext_factor else 1.0,
                                   ext_factor=ext_factor, attn_factor=0.9))
    text = params(type=dtype, ne=(5, 3, head), n_dims=n_dims, mode=mode, ext_factor=ext_factor, base=freq_base,
                  v="far,permuted" if permuted else "far")
    return build("rope_ext", text, fn, ("T",), bindings={"T": 5}, values={"p": fixed(FAR)})


def test_rope(cuda):
    kernels, _ = run_ops(cuda, ["rope_ext"], min_supported=12)
    kernels += run_cases(cuda, [
        _rope(ops.ROPE_NORM, F32, 128, 128),
        _rope(ops.ROPE_NEOX, F32, 64, 128, freq_base=1e6),
        _rope(ops.ROPE_NEOX, F16, 32, 70, ext_factor=1.0, permuted=True),   # pass-through past n_dims
        _rope(ops.ROPE_NORM, F32, 64, 80, ext_factor=0.5, permuted=True),
    ])
    assert_assembles(kernels, no_spills=True)


def _graded(rng, shape):
    """An ALiBi-style mask: -distance to the row's position, -inf past it."""
    n, rows = shape[-1], shape[-2]
    m = -np.abs(np.arange(n)[None, :] - np.arange(rows)[:, None] * 7).astype(np.float32)
    m[:, n - 3:] = -np.inf
    return np.broadcast_to(m, shape).copy()


def _soft_max(x_shape, m_shape=None, m_dtype=F32, max_bias=0.0, sinks=False, values=None):
    def fn(g):
        m = g.input("m", m_shape, m_dtype) if m_shape else None
        s = g.input("s", (x_shape[-3],), F32) if sinks else None
        g.output("out", g.soft_max_ext(g.input("x", x_shape, F32), m, 0.3, max_bias, s))
    text = params(type="f32", ne=x_shape, mask=m_shape or 0, type_m=m_dtype, max_bias=max_bias, sinks=int(sinks))
    return build("soft_max_ext", text, fn, lo=-6.0, hi=6.0, max_nmse=1e-6, values=values or {})


def test_soft_max(cuda):
    kernels, _ = run_ops(cuda, ["soft_max_ext"], min_supported=9)
    kernels += run_cases(cuda, [
        _soft_max((2, 8, 3, 50), (1, 1, 4, 50), F16, max_bias=8.0, values={"m": _graded}),   # 8 slopes
        _soft_max((1, 6, 3, 40), (1, 1, 3, 40), F32, max_bias=4.0, values={"m": _graded}),   # n_head not 2^k
        _soft_max((2, 4, 2, 64), (1, 2, 2, 64), F16, sinks=True, values={"s": uniform(-2.0, 2.0)}),  # heads % H'
        _soft_max((2, 3000), (2, 3000), F32),          # a block of 1024, 3 logits a thread cached
        _soft_max((1, 9000)),       # past the register cache: three passes over x
    ])
    assert_assembles(kernels, no_spills=True)
