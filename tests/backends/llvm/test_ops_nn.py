"""Norms, softmax, rope, rows, matmuls and attention on the LLVM backend against the numpy
interpreter: every weight type, odd and one-row shapes, GQA broadcasts, permuted operands,
masks, ALiBi, sinks. Where the reference follows ggml's x86 arithmetic, the kernel does too
and results are bit-exact; elsewhere (bf16 matmuls, flash attention) an NMSE bound."""

from __future__ import annotations

import numpy as np
import pytest

from llamir.ir import BF16, F16, F32, I32, I64, GraphBuilder, dims, dtype_named, ops, quants

rng = np.random.default_rng(2)


def _f32(shape, lo=-2.0, hi=2.0):
    return rng.uniform(lo, hi, shape).astype(np.float32)


def _weight(shape, dtype):
    x = rng.standard_normal(shape).astype(np.float32)
    if dtype == F32:
        return x
    if dtype == F16:
        return x.astype(np.float16)
    if dtype == BF16:
        return (x.view(np.uint32) >> 16).astype(np.uint16)
    return quants.quantize(x, dtype)


# -- norms, softmax, reductions ----------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 16, 37, 576])
def test_norms(check, n):
    b = GraphBuilder("g", dims=["T"])
    x, w, bias = b.input("x", ["T", n], F32), b.weight("w", [n], F32), b.weight("b", [n], F32)
    b.output("rms", b.rms_norm(x, 1e-5))
    b.output("rms_mul", b.op(ops.RmsNormMul(eps=1e-6), x, w))
    b.output("norm", b.norm(x, 1e-5))
    b.output("ln", b.op(ops.NormMulAdd(eps=1e-5, bias=True), x, w, bias))
    b.output("l2", b.op(ops.L2Norm(eps=1e-12), x))
    b.output("sum", b.sum_rows(x))
    b.output("mean", b.mean(x))
    b.output("total", b.op(ops.Sum(), x))
    check(b.graph, {"x": _f32((3, n)), "w": _f32((n,)), "b": _f32((n,))}, {"T": 3}, exact=True)


def test_group_norm(check):
    b = GraphBuilder("g")
    x = b.input("x", [2, 6, 3, 5], F32)
    b.output("y", b.op(ops.GroupNorm(n_groups=4, eps=1e-5), x))
    check(b.graph, {"x": _f32((2, 6, 3, 5))}, exact=True)


_SOFT_MAX_CASES = [(mask_dtype, max_bias, sinks)
                   for mask_dtype in (None, F32, F16)
                   for max_bias, sinks in ((0.0, False), (8.0, False), (0.0, True))
                   if mask_dtype is not None or not max_bias]  # ALiBi slopes scale the mask


@pytest.mark.parametrize("mask_dtype,max_bias,sinks", _SOFT_MAX_CASES)
def test_soft_max(check, mask_dtype, max_bias, sinks):
    b = GraphBuilder("g", dims=["T", "n"])
    x = b.input("x", [1, 4, "T", "n"], F32)
    mask = b.input("m", [1, 1, "T", "n"], mask_dtype) if mask_dtype else None
    s = b.input("s", [4], F32) if sinks else None
    b.output("y", b.soft_max_ext(x, mask, 0.125, max_bias=max_bias, sinks=s))
    T, n = 5, 37
    values = {"x": _f32((1, 4, T, n), -6, 6)}
    if mask_dtype:
        m = np.zeros((1, 1, T, n), np.float32)
        m[..., 30:] = -np.inf
        values["m"] = m.astype(mask_dtype.np_dtype)
    if sinks:
        values["s"] = _f32((4,))
    check(b.graph, values, {"T": T, "n": n}, exact=True)


@pytest.mark.parametrize("descending", [False, True])
def test_argsort_and_top_k(check, descending):
    b = GraphBuilder("g")
    x = b.input("x", [3, 45], F32)
    b.output("order", b.argsort(x, descending=descending))
    b.output("top", b.top_k(x, 7))
    values = np.round(_f32((3, 45), -3, 3), 1)      # ties: the sort must be stable
    check(b.graph, {"x": values}, exact=True)


# -- rope ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", [ops.ROPE_NORM, ops.ROPE_NEOX])
@pytest.mark.parametrize("n_dims,ext_factor,factors", [(64, 0.0, False), (32, 1.0, False), (64, 0.0, True)])
@pytest.mark.parametrize("dtype", [F32, F16])
def test_rope(check, mode, n_dims, ext_factor, factors, dtype):
    b = GraphBuilder("g", dims=["T"])
    x = b.input("x", ["T", 3, 64], dtype)
    pos = b.input("p", ["T"], I32)
    ff = b.weight("ff", [32], F32) if factors else None
    b.output("y", b.rope_ext(x, pos, ff, n_dims=n_dims, mode=mode, n_ctx_orig=4096, freq_base=10000.0,
                             freq_scale=0.25 if ext_factor else 1.0, ext_factor=ext_factor))
    values = {"x": _f32((5, 3, 64)).astype(dtype.np_dtype), "p": np.array([0, 1, 17, 300, 4000], np.int32)}
    if factors:
        values["ff"] = _f32((32,), 1.0, 4.0)
    check(b.graph, values, {"T": 5}, exact=True)


# -- rows ------------------------------------------------------------------------------------------
ROW_TYPES = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]


@pytest.mark.parametrize("name", ROW_TYPES)
def test_get_rows(check, name):
    dtype = dtype_named(name)
    n = 256 if name.endswith("_k") else 64
    b = GraphBuilder("g", dims=["T"])
    w = b.weight("w", [10, n], dtype)
    b.output("y", b.get_rows(w, b.input("i", ["T"], I32)))
    check(b.graph, {"w": _weight((10, n), dtype), "i": np.array([3, 0, 9, 3], np.int32)}, {"T": 4}, exact=True)


def test_get_rows_batched_and_i32(check):
    b = GraphBuilder("g")
    a = b.input("a", [2, 5, 6], F32)
    ai = b.input("ai", [7, 3], I32)
    b.output("y", b.get_rows(a, b.input("i", [2, 3], I32)))
    b.output("z", b.get_rows(ai, b.input("j", [2], I32)))
    check(b.graph, {"a": _f32((2, 5, 6)), "i": np.array([[4, 0, 4], [1, 2, 3]], np.int32),
                    "ai": rng.integers(-9, 9, (7, 3)).astype(np.int32), "j": np.array([6, 1], np.int32)},
          exact=True)


@pytest.mark.parametrize("name", ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
@pytest.mark.parametrize("idx_dtype", [I32, I64])
def test_set_rows_into_state(check, name, idx_dtype):
    dtype = dtype_named(name)
    b = GraphBuilder("g", dims=["T"])
    cache = b.state("c", [16, 64], dtype)
    stored = b.set_rows(cache, b.input("s", ["T", 64], F32), b.input("i", ["T"], idx_dtype))
    b.output("y", b.get_rows(stored, b.input("o", [2], I32)))
    shape = (16, dtype.row_bytes(64)) if dtype.is_quantized else (16, 64)
    storage = np.uint8 if dtype.is_quantized else (np.uint16 if dtype == BF16 else dtype.np_dtype)
    check(b.graph, {"s": _f32((3, 64)), "i": np.array([5, 2, 7], idx_dtype.np_dtype),
                    "o": np.array([5, 7], np.int32)}, {"T": 3}, exact=True,
          fresh={"c": lambda: np.zeros(shape, storage)})


def test_set_rows_transposed_v_cache(check):
    """The v_trans layout: one element per index, as llama.cpp stores V without flash attention."""
    b = GraphBuilder("g", dims=["T"])
    cache = b.state("v", [1, 8, 32], F16)
    flat = b.reshape(cache, 256, 1)
    t8 = dims.mul(b.dim("T"), 8)
    v = b.reshape(b.input("x", ["T", 8], F32), t8, 1)
    b.set_rows(flat, v, b.input("i", [t8], I64))
    b.output("y", b.scale(b.input("x2", [1], F32), 1.0))
    T = 3
    idx = (np.arange(8)[:, None] * 32 + np.array([4, 9, 1])).T.reshape(-1)
    check(b.graph, {"x": _f32((T, 8)), "i": idx.astype(np.int64), "x2": _f32((1,))}, {"T": T}, exact=True,
          fresh={"v": lambda: np.zeros((1, 8, 32), np.float16)})


# -- matmuls -----------------------------------------------------------------------------------------
FLOAT_SHAPES = [(1, 64, 128), (7, 64, 128), (5, 30, 100), (13, 36, 70), (1, 5, 33), (40, 128, 64)]


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("n,m,k", FLOAT_SHAPES)
def test_mul_mat_float_weights(check, dtype, n, m, k):
    b = GraphBuilder("g", dims=["T"])
    b.output("y", b.mul_mat(b.weight("w", [m, k], dtype), b.input("x", ["T", k], F32)))
    check(b.graph, {"w": _weight((m, k), dtype), "x": _f32((n, k))}, {"T": n}, exact=dtype != BF16, tol=1e-12)


QUANT_TYPES = ["q4_0", "q8_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]


@pytest.mark.parametrize("name", QUANT_TYPES)
@pytest.mark.parametrize("n,m", [(1, 64), (7, 48), (3, 40), (13, 20), (33, 24)])
def test_mul_mat_quantized_weights(check, name, n, m):
    dtype = dtype_named(name)
    k = 512 if name.endswith("_k") else 96
    b = GraphBuilder("g", dims=["T"])
    b.output("y", b.mul_mat(b.weight("w", [m, k], dtype), b.input("x", ["T", k], F32)))
    check(b.graph, {"w": _weight((m, k), dtype), "x": _f32((n, k))}, {"T": n}, exact=True)


@pytest.mark.parametrize("kv", [F16, F32])
@pytest.mark.parametrize("n_kv", [37, 40])
def test_mul_mat_attention_shapes(check, kv, n_kv):
    """k.q with GQA broadcast and permuted q, then v.kq over a transposed cache view."""
    b = GraphBuilder("g", dims=["T", "n"])
    k = b.input("k", [1, 2, "n", 64], kv)
    q = b.permute(b.input("q", [1, "T", 4, 64], F32), 0, 2, 1, 3)
    kq = b.mul_mat(k, q)
    b.output("kq", kq)
    v = b.input("v", [1, 2, 64, "n"], kv)
    b.output("kqv", b.mul_mat(v, b.soft_max_ext(kq, None, 0.125)))
    T = 5
    check(b.graph, {"k": _f32((1, 2, n_kv, 64)).astype(kv.np_dtype), "q": _f32((1, T, 4, 64)),
                    "v": _f32((1, 2, 64, n_kv)).astype(kv.np_dtype)}, {"T": T, "n": n_kv}, exact=True)


# -- flash attention ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kv", [F16, F32])
@pytest.mark.parametrize("max_bias,softcap,sinks", [(0.0, 0.0, False), (8.0, 30.0, False), (0.0, 0.0, True)])
@pytest.mark.parametrize("T", [1, 5])
def test_flash_attn(check, kv, max_bias, softcap, sinks, T):
    b = GraphBuilder("g", dims=["T", "n"])
    q = b.input("q", [1, 4, "T", 64], F32)
    k, v = b.input("k", [1, 2, "n", 64], kv), b.input("v", [1, 2, "n", 48], kv)
    m = b.input("m", [1, 1, "T", "n"], F16)
    s = b.input("s", [4], F32) if sinks else None
    b.output("y", b.flash_attn_ext(q, k, v, m, 0.125, max_bias=max_bias, logit_softcap=softcap, sinks=s))
    n = 37
    mask = np.zeros((1, 1, T, n), np.float16)
    mask[..., 30:] = -np.inf
    values = {"q": _f32((1, 4, T, 64)), "k": _f32((1, 2, n, 64)).astype(kv.np_dtype),
              "v": _f32((1, 2, n, 48)).astype(kv.np_dtype), "m": mask}
    if sinks:
        values["s"] = _f32((4,))
    # the reference accumulates V in numpy (np.exp, unfused products); ggml (and this kernel) use
    # glibc's expf and fma: NMSE far below the f16 KV cache's own error
    check(b.graph, values, {"T": T, "n": n}, tol=1e-8)


@pytest.mark.parametrize("kv", [F16, F32])
@pytest.mark.parametrize("softcap,sinks", [(0.0, False), (20.0, True)])
def test_flash_attn_tiled_prompt(check, kv, softcap, sinks):
    """64+ query rows take ggml's tiled path (f32 accumulation, where the reference keeps the
    one-row f16 accumulator): equal to the reference up to f16 rounding of V sums."""
    T, n = 70, 150
    b = GraphBuilder("g", dims=["T", "n"])
    q = b.input("q", [1, 4, "T", 64], F32)
    k, v = b.input("k", [1, 2, "n", 64], kv), b.input("v", [1, 2, "n", 64], kv)
    m = b.input("m", [1, 1, "T", "n"], F16)
    s = b.input("s", [4], F32) if sinks else None
    b.output("y", b.flash_attn_ext(q, k, v, m, 0.125, logit_softcap=softcap, sinks=s))
    mask = np.zeros((1, 1, T, n), np.float16)
    for t in range(T):
        mask[0, 0, t, 80 + t:] = -np.inf          # causal over a 80-cell history
    values = {"q": _f32((1, 4, T, 64)), "k": _f32((1, 2, n, 64)).astype(kv.np_dtype),
              "v": _f32((1, 2, n, 64)).astype(kv.np_dtype), "m": mask}
    if sinks:
        values["s"] = _f32((4,))
    check(b.graph, values, {"T": T, "n": n}, tol=1e-5 if kv == F16 else 1e-11)


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
@pytest.mark.parametrize("n_kv", [40, 37])
def test_mul_mat_quantized_kv_cache(check, name, n_kv):
    """A quantized KV cache read by k.q with GQA and permuted q: ggml's block layout, read
    directly (no repacking), in the reference's order (Q4_0's depends on n_kv % 8 at run time)."""
    dtype = dtype_named(name)
    b = GraphBuilder("g", dims=["T", "n"])
    cache = b.input("k", [1, 2, "n", 64], dtype)
    q = b.permute(b.input("q", [1, "T", 4, 64], F32), 0, 2, 1, 3)
    b.output("kq", b.mul_mat(cache, q))
    T = 3
    check(b.graph, {"k": _weight((1, 2, n_kv, 64), dtype), "q": _f32((1, T, 4, 64))}, {"T": T, "n": n_kv},
          exact=True)


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "q5_1"])
def test_flash_attn_quantized_cache(check, name):
    """Quantized K/V rows are dequantised (the reference's to_f32) and used in f32."""
    dtype = dtype_named(name)
    b = GraphBuilder("g", dims=["T", "n"])
    q = b.input("q", [1, 4, "T", 64], F32)
    k, v = b.input("k", [1, 2, "n", 64], dtype), b.input("v", [1, 2, "n", 64], dtype)
    m = b.input("m", [1, 1, "T", "n"], F16)
    b.output("y", b.flash_attn_ext(q, k, v, m, 0.125))
    T, n = 3, 40
    mask = np.zeros((1, 1, T, n), np.float16)
    mask[..., 33:] = -np.inf
    check(b.graph, {"q": _f32((1, 4, T, 64)), "k": _weight((1, 2, n, 64), dtype), "v": _weight((1, 2, n, 64), dtype),
                    "m": mask}, {"T": T, "n": n}, tol=1e-10)


@pytest.mark.parametrize("name", ["f32", "f16", "q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("n_b", [1, 2])
def test_mul_mat_id(check, name, n_b):
    dtype = dtype_named(name)
    E, M, K, T, k = 4, 24, 64, 5, 2
    b = GraphBuilder("g", dims=["T"])
    w = b.weight("w", [E, M, K], dtype)
    x = b.input("x", ["T", n_b, K], F32)
    ids = b.input("ids", ["T", k], I32)
    b.output("y", b.mul_mat_id(w, x, ids))
    check(b.graph, {"w": _weight((E, M, K), dtype), "x": _f32((T, n_b, K)),
                    "ids": rng.integers(0, E, (T, k)).astype(np.int32)}, {"T": T}, exact=True)
