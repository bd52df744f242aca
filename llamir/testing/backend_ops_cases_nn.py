"""test-backend-ops cases for layout ops, copies, rows, matmuls, rope, softmax and attention
(the element-wise, norm and reduction cases are in backend_ops_cases)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from llamir.ir import BF16, F16, F32, I32, I64, ops
from llamir.ir.dtypes import Q4_0, Q5_1, Q8_0, QUANT_DTYPES, DType
from llamir.testing.backend_ops_cases import (
    LEGACY_QUANTS,
    WEIGHT_TYPES,
    Case,
    build,
    fixed,
    integers,
    params,
    quant_nmse_estimate,
    uniform,
)


def _k_for(dtype: DType, k: int = 256) -> int:
    """Row length that is whole blocks of `dtype` (256 for K-quants)."""
    return max(k, dtype.block_size) // dtype.block_size * dtype.block_size


# -- layout ---------------------------------------------------------------------------------------
def layout_cases() -> Iterator[Case]:
    yield build("cont", params(type="f32", ne=(2, 3, 4, 8), perm=(0, 2, 1, 3)), lambda g: g.output(
        "out", g.cont(g.permute(g.input("x", (2, 4, 3, 8), F32), 0, 2, 1, 3))), max_nmse=0.0)
    yield build("cont", params(type="f32", ne=(6, 4, 8), perm=(0, 2, 1, 3)), lambda g: g.output(
        "out", g.cont(g.permute(g.input("x", (2, "T", 3, 8), F32), 0, 2, 1, 3), 6, g.dim("T"), 8)), ("T",),
        bindings={"T": 4}, max_nmse=0.0)
    yield build("cont", params(type="f16", ne=(7, 5), v="transposed"), lambda g: g.output(
        "out", g.cont(g.transpose(g.input("x", (5, 7), F16)))), max_nmse=0.0)
    for axis in range(4):
        shape_b = tuple(3 if i == axis else s for i, s in enumerate((2, 4, 3, 8)))
        text = params(type="f32", ne_a=(2, 4, 3, 8), ne_b=shape_b, dim=axis)
        yield build("concat", text, lambda g, a=axis, sb=shape_b: g.output(
            "out", g.concat(g.input("a", (2, 4, 3, 8), F32), g.input("b", sb, F32), axis=a)), max_nmse=0.0)
    yield build("concat", params(type="f32", ne_a=(4, 6), ne_b=(4, 6), dim=1, v="transposed"), lambda g: g.output(
        "out", g.concat(g.transpose(g.input("a", (6, 4), F32)), g.input("b", (4, 6), F32), axis=1)), max_nmse=0.0)
    for src, target in (((1, 3, 1), (2, 6, 4)), ((5, 7), (10, 7)), ((3,), (2, 2, 3))):
        yield build("repeat", params(type="f32", ne=src, nr=target), lambda g, s=src, t=target: g.output(
            "out", g.repeat(g.input("x", s, F32), *t)), max_nmse=0.0)
    yield build("view", params(type="f32", ne=(3, 10), nb=(96, 4), offset=8), lambda g: g.output(
        "out", g.cont(g.view(g.input("x", (8, 12), F32), [3, 10], [96, 4], 8))), max_nmse=0.0)
    yield build("view", params(type="f32", ne=(12, 4), nb=(16, 4), v="strided"), lambda g: g.output(
        "out", g.add(g.view(g.input("x", (8, 12), F32), [12, 4], [16, 4], 0), g.input("y", (4,), F32))))
    yield build("reshape", params(type="f32", ne=(4, 6), shape=(2, 12)), lambda g: g.output(
        "out", g.cont(g.reshape(g.input("x", (4, 6), F32), 2, 12))), max_nmse=0.0)
    for axes in ((0, 2, 1, 3), (1, 0, 2, 3), (2, 1, 0, 3)):
        yield build("permute", params(type="f32", ne=(2, 3, 4, 5), axes=axes), lambda g, ax=axes: g.output(
            "out", g.cont(g.permute(g.input("x", (2, 3, 4, 5), F32), *ax))), max_nmse=0.0)
    yield build("transpose", params(type="f32", ne=(3, 5, 7)), lambda g: g.output(
        "out", g.cont(g.transpose(g.input("x", (3, 5, 7), F32)))), max_nmse=0.0)


def cpy_cases() -> Iterator[Case]:
    plain = [(F32, F16), (F32, BF16), (F16, F32), (BF16, F32), (F32, I32), (I32, F32), (F16, F16), (F32, F32)]
    for src, dst in plain:
        bound = 0.0 if src == dst else 1e-6
        values = {"x": integers(-50, 50)} if src == I32 else {}
        yield build("cpy", params(type_src=src, type_dst=dst, ne=(3, 1, 29)), lambda g, s=src, d=dst: g.output(
            "out", g.cast(g.input("x", (3, 1, 29), s), d)), lo=-150.0, hi=150.0, max_nmse=bound, values=values)
    yield build("cpy", params(type_src="f32", type_dst="f16", ne=(6, 4), v="transposed"), lambda g: g.output(
        "out", g.cast(g.transpose(g.input("x", (4, 6), F32)), F16)), lo=-150.0, hi=150.0, max_nmse=1e-6)
    for dst in QUANT_DTYPES:
        if dst.name in ("q8_1", "q8_k"):
            continue
        n = 3 * _k_for(dst, 64)
        bound = quant_nmse_estimate(dst, n, 150.0) if dst in LEGACY_QUANTS else 1e-6
        yield build("cpy", params(type_src="f32", type_dst=dst, ne=(3, _k_for(dst, 64))), lambda g, d=dst: g.output(
            "out", g.cast(g.input("x", (3, _k_for(d, 64)), F32), d)), lo=-150.0, hi=150.0, max_nmse=bound)
        for back in (F32, F16):
            yield build("cpy", params(type_src=dst, type_dst=back, ne=(3, _k_for(dst, 64))),
                        lambda g, d=dst, back=back: g.output("out", g.cast(g.input("x", (3, _k_for(d, 64)), d), back)),
                        lo=-150.0, hi=150.0, max_nmse=1e-6)


# -- rows ---------------------------------------------------------------------------------------------
def rows_cases() -> Iterator[Case]:
    idx = fixed(np.array([3, 0, 9, 3], np.int32))
    for dtype in WEIGHT_TYPES:
        n = _k_for(dtype, 64)
        yield build("get_rows", params(type=dtype, n=n, m=10, r=4), lambda g, d=dtype, n=n: g.output(
            "out", g.get_rows(g.weight("w", (10, n), d), g.input("i", ("T",), I32))), ("T",), bindings={"T": 4},
            values={"i": idx})
    yield build("get_rows", params(type="f32", ne=(2, 5, 6), r=3, b=2), lambda g: g.output(
        "out", g.get_rows(g.input("a", (2, 5, 6), F32), g.input("i", (2, 3), I32))),
        values={"i": fixed(np.array([[4, 0, 4], [1, 2, 3]], np.int32))})
    yield build("get_rows", params(type="i32", n=3, m=7, r=2), lambda g: g.output(
        "out", g.get_rows(g.input("a", (7, 3), I32), g.input("i", (2,), I32))), max_nmse=0.0,
        values={"a": integers(-9, 9), "i": fixed(np.array([6, 1], np.int32))})
    for dtype in (F32, F16, BF16) + LEGACY_QUANTS:
        for idx_dtype in (I32, I64):
            bound = quant_nmse_estimate(dtype, 3 * 64, 1.0) if dtype.is_quantized else 1e-7
            rows = fixed(np.array([5, 2, 7], idx_dtype.np_dtype))
            yield build("set_rows", params(type=dtype, type_idx=idx_dtype, ne=(16, 64), r=3),
                        lambda g, d=dtype, i=idx_dtype: g.output("out", g.set_rows(
                            g.state("c", (16, 64), d), g.input("s", ("T", 64), F32), g.input("i", ("T",), i))),
                        ("T",), bindings={"T": 3}, values={"i": rows}, state=("c",), max_nmse=bound)


# -- matmuls ------------------------------------------------------------------------------------------
FLOAT_SHAPES = [(1, 64, 128), (7, 64, 128), (5, 30, 100), (13, 36, 70), (1, 5, 33), (40, 128, 64)]
QUANT_SHAPES = [(1, 64), (7, 48), (3, 40), (13, 20), (33, 24)]


def _mul_mat(dtype: DType, n: int, m: int, k: int, **extra) -> Case:
    return build("mul_mat", params(type_a=dtype, type_b="f32", m=m, n=n, k=k, **extra), lambda g: g.output(
        "out", g.mul_mat(g.weight("a", (m, k), dtype), g.input("b", ("T", k), F32))), ("T",), bindings={"T": n},
        max_nmse=5e-4, flops=2 * m * n * k)


def mul_mat_cases() -> Iterator[Case]:
    for dtype in WEIGHT_TYPES:                      # ggml's every-type cases
        for n in (1, 16):
            yield _mul_mat(dtype, n, 16, _k_for(dtype))
    for dtype in (F32, F16, BF16):
        for n, m, k in FLOAT_SHAPES:
            yield _mul_mat(dtype, n, m, k)
    for dtype in WEIGHT_TYPES[3:]:
        for n, m in QUANT_SHAPES:
            yield _mul_mat(dtype, n, m, 512 if dtype.block_size == 256 else 96)
    for kv in (F32, F16) + LEGACY_QUANTS:           # k.q with GQA and a permuted q (ggml's bs/nr/per)
        for n_kv in (37, 40):
            def kq(g, kv=kv):
                q = g.permute(g.input("q", (1, "T", 4, 64), F32), 0, 2, 1, 3)     # [1, 4, T, 64]
                g.output("out", g.mul_mat(g.input("k", (1, 2, "n", 64), kv), q))
            yield build("mul_mat", params(type_a=kv, type_b="f32", m=n_kv, n=5, k=64, bs=(1, 2), nr=(1, 2),
                                          per=(0, 2, 1, 3)), kq, ("T", "n"), bindings={"T": 5, "n": n_kv},
                        max_nmse=5e-4, flops=2 * n_kv * 5 * 64 * 4)
    for kv in (F32, F16):                           # v.kq over a transposed (v_trans) cache
        yield build("mul_mat", params(type_a=kv, type_b="f32", m=64, n=5, k=37, bs=(1, 2), nr=(1, 2)), lambda g, kv=kv:
                    g.output("out", g.mul_mat(g.input("v", (1, 2, 64, 37), kv), g.input("p", (1, 4, 5, 37), F32))),
                    max_nmse=5e-4, flops=2 * 64 * 5 * 37 * 4)
    yield build("mul_mat", params(type_a="f32", type_b="f32", m=16, n=9, k=32, bs=(2, 3), nr=(1, 1), v="transposed_b"),
                lambda g: g.output("out", g.mul_mat(g.input("a", (2, 3, 16, 32), F32),
                                                    g.transpose(g.input("b", (2, 3, 32, 9), F32)))), max_nmse=5e-4,
                flops=2 * 16 * 9 * 32 * 6)


def mul_mat_id_cases() -> Iterator[Case]:
    n_mats, n_used, m, n_tokens = 4, 2, 16, 5
    for dtype in WEIGHT_TYPES:
        k = _k_for(dtype)
        for n_b in (1, 2):
            def fn(g, dtype=dtype, k=k, n_b=n_b):
                g.output("out", g.mul_mat_id(g.weight("as", (n_mats, m, k), dtype),
                                             g.input("b", ("T", n_b, k), F32), g.input("ids", ("T", n_used), I32)))
            yield build("mul_mat_id", params(type_a=dtype, type_b="f32", n_mats=n_mats, n_used=n_used, b=int(n_b > 1),
                                             m=m, n=n_tokens, k=k), fn, ("T",), bindings={"T": n_tokens},
                        values={"ids": integers(0, n_mats)}, max_nmse=5e-4, flops=2 * m * k * n_tokens * n_used)


# -- rope, softmax, attention ----------------------------------------------------------------------
POSITIONS = np.array([0, 1, 17, 300, 4000], np.int32)


def rope_cases() -> Iterator[Case]:
    for mode in (ops.ROPE_NORM, ops.ROPE_NEOX):
        for n_dims, ext_factor, factors in ((64, 0.0, False), (32, 1.0, False), (64, 0.0, True)):
            for dtype in (F32, F16):
                def fn(g, mode=mode, n_dims=n_dims, ext=ext_factor, factors=factors, dtype=dtype):
                    ff = g.weight("ff", (32,), F32) if factors else None
                    g.output("out", g.rope_ext(g.input("x", ("T", 3, 64), dtype), g.input("p", ("T",), I32), ff,
                                               n_dims=n_dims, mode=mode, n_ctx_orig=4096, freq_base=10000.0,
                                               freq_scale=0.25 if ext else 1.0, ext_factor=ext))
                text = params(type=dtype, ne=(5, 3, 64), n_dims=n_dims, mode=mode, ext_factor=ext_factor,
                              ff=int(factors))
                yield build("rope_ext", text, fn, ("T",), bindings={"T": 5},
                            values={"p": fixed(POSITIONS), "ff": uniform(0.9, 1.1)})


def _causal_tail(start: int, dtype: DType):
    def make(rng, shape):
        m = np.zeros(shape, np.float32)
        m[..., start:] = -np.inf
        return m.astype(dtype.np_dtype)
    return make


def soft_max_cases() -> Iterator[Case]:
    for mask in (None, F32, F16):
        for max_bias, sinks in ((0.0, False), (8.0, False), (0.0, True)):
            if mask is None and max_bias:
                continue                            # ALiBi slopes scale the mask
            def fn(g, mask=mask, max_bias=max_bias, sinks=sinks):
                m = g.input("m", (1, 1, "T", "n"), mask) if mask else None
                s = g.input("s", (4,), F32) if sinks else None
                g.output("out", g.soft_max_ext(g.input("x", (1, 4, "T", "n"), F32), m, 0.125, max_bias, s))
            yield build("soft_max_ext", params(type="f32", ne=(1, 4, 5, 37), mask=mask or 0, scale=0.125,
                                               max_bias=max_bias, sinks=int(sinks)), fn, ("T", "n"),
                        bindings={"T": 5, "n": 37}, lo=-6.0, hi=6.0, max_nmse=1e-6,
                        values={"m": _causal_tail(30, mask or F32), "s": uniform(-1.0, 1.0)})
    yield build("soft_max_ext", params(type="f32", ne=(3, 1024), mask=0, scale=1.0), lambda g: g.output(
        "out", g.soft_max_ext(g.input("x", (3, 1024), F32), None, 1.0)), max_nmse=1e-6)


def _attn(op: str, kv: DType, T: int, n: int, dv: int = 64, max_bias=0.0, softcap=0.0, sinks=False,
          tail: int | None = None) -> Case:
    def fn(g):
        q = g.input("q", (1, 4, "T", 64), F32)
        k = g.input("k", (1, 2, "n", 64), kv)
        m = g.input("m", (1, 1, "T", "n"), F16)
        s = g.input("s", (4,), F32) if sinks else None
        if op == "flash_attn_ext":
            v = g.input("v", (1, 2, "n", dv), kv)
            g.output("out", g.flash_attn_ext(q, k, v, m, 0.125, max_bias=max_bias, logit_softcap=softcap, sinks=s))
        else:
            v = g.input("v", (1, 2, dv, "n"), kv)
            attn = ops.SoftMaxAttn(scale=0.125, max_bias=max_bias, mask=True, sinks=sinks)
            g.output("out", g.op(attn, q, k, v, m, *([s] if sinks else [])))

    def mask(rng, shape):
        out = np.zeros(shape, np.float32)
        for t in range(shape[-2]):                  # causal over a history of n - T (or `tail`) cells
            out[..., t, (tail if tail is not None else n - T) + t + 1:] = -np.inf
        return out.astype(np.float16)

    text = params(hsk=64, hsv=dv, nh=2, nr23=(2, 1), kv=n, nb=T, mask=1, sinks=int(sinks), max_bias=max_bias,
                  logit_softcap=softcap, type_KV=kv)
    return build(op, text, fn, ("T", "n"), bindings={"T": T, "n": n}, values={"m": mask}, max_nmse=5e-4,
                 flops=2 * 4 * T * (64 + dv) * n)


def attention_cases() -> Iterator[Case]:
    for kv in (F16, F32):
        for max_bias, softcap, sinks in ((0.0, 0.0, False), (8.0, 30.0, False), (0.0, 0.0, True)):
            for T in (1, 5):
                yield _attn("flash_attn_ext", kv, T, 37, dv=48, max_bias=max_bias, softcap=softcap, sinks=sinks,
                            tail=29)
        for softcap, sinks in ((0.0, False), (20.0, True)):
            yield _attn("flash_attn_ext", kv, 70, 150, softcap=softcap, sinks=sinks, tail=79)   # ggml's tiled path
    for kv in (Q8_0, Q4_0, Q5_1):                   # quantized caches, dequantized rows
        yield _attn("flash_attn_ext", kv, 3, 40, tail=32)
    for kv in (F16, F32):
        for max_bias, sinks in ((0.0, False), (8.0, True)):
            yield _attn("soft_max_attn", kv, 5, 37, max_bias=max_bias, sinks=sinks, tail=29)
