"""The reference interpreter against llama.cpp's own CPU backend, one op at a time, bit for bit.

Each case builds the same one-op graph twice, once with GraphBuilder (run by the numpy
interpreter) and once with ggml through ctypes (llamir.testing.libggml, the libggml inside
llama-cpp-python, computed on 2 threads), on inputs of the scales and shapes models use, and
requires identical float bits. That is what keeps quantized models' logits exactly equal to
llama.cpp's: a single last-bit difference upstream of a Q8 quantization or an f16 rounding can
flip a greedy token. The interpreter runs the numerics profile of the installed oracle's build
(AVX-512 or AVX2, read from llama_print_system_info()); see llamir/ir/ggml_math.py for what each
emulation follows.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from llamir.ir import F16, F32, I32, GraphBuilder, ops, run_graph
from llamir.testing.libggml import assert_same_bits

pytestmark = pytest.mark.llama_cpp
f32, f16 = np.float32, np.float16
_DTYPES = {np.dtype(f32): F32, np.dtype(f16): F16, np.dtype(np.int32): I32}


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20240611)


def ours(build, **inputs: np.ndarray) -> np.ndarray:
    """build(g, **nodes) -> node, evaluated by the reference interpreter in the oracle's profile."""
    from llamir.testing.llama_cpp import oracle_numerics

    g = GraphBuilder("exact")
    nodes = {name: g.input(name, list(v.shape), _DTYPES[v.dtype]) for name, v in inputs.items()}
    g.output("y", build(g, **nodes))
    return run_graph(g.graph, inputs, numerics=oracle_numerics(), n_threads=2)["y"]


def theirs(ggml, build, *arrays: np.ndarray | None, n_threads: int = 2) -> np.ndarray:
    """build(g, *tensors) -> tensor, computed by libggml's CPU backend."""
    with ggml.graph(256 << 20) as g:
        tensors = [None if a is None else g.tensor(a) for a in arrays]
        return g.compute(build(g, *tensors), n_threads)


def causal_mask(n_tokens: int, n_kv: int, dtype=f32) -> np.ndarray:
    """The last n_tokens of n_kv cells, each seeing itself and what came before."""
    mask = np.zeros((n_tokens, n_kv), dtype=f32)
    for t in range(n_tokens):
        mask[t, n_kv - n_tokens + t + 1:] = -np.inf
    return mask.astype(dtype)


# -- softmax -------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_kv", [256, 250, 37])  # whole 16-lane chunks; 250/37 add glibc expf tails
@pytest.mark.parametrize("mask_dtype", [f32, f16])
def test_soft_max_causal(ggml, rng, n_kv, mask_dtype):
    kq = (rng.normal(0, 1, (8, 7, n_kv)) * 12).astype(f32)           # [H, T, n_kv] raw k.q
    mask, scale = causal_mask(7, n_kv, mask_dtype), 1 / math.sqrt(64)
    got = ours(lambda g, kq, mask: g.soft_max_ext(kq, mask, scale), kq=kq, mask=mask)
    want = theirs(ggml, lambda g, kq, mask: g.op("ggml_soft_max_ext", kq, mask, g.f(scale), g.f(0.0)),
                  kq, mask)
    assert_same_bits(got, want)


def test_soft_max_alibi_and_sinks(ggml, rng):
    """12 heads: slopes from both m0 and m1 powers; the mask*slope product is fused into wp."""
    kq = (rng.normal(0, 1, (12, 5, 96)) * 6).astype(f32)
    mask = causal_mask(5, 96) - np.abs(np.arange(96) - np.arange(91, 96)[:, None]).astype(f32)
    sinks = rng.normal(0, 2, 12).astype(f32)
    got = ours(lambda g, kq, mask, sinks: g.soft_max_ext(kq, mask, 0.125, 8.0, sinks),
               kq=kq, mask=mask, sinks=sinks)

    def build(g, kq, mask, sinks):
        out = g.op("ggml_soft_max_ext", kq, mask, g.f(0.125), g.f(8.0))
        g.call("ggml_soft_max_add_sinks", out, sinks)
        return out
    assert_same_bits(got, theirs(ggml, build, kq, mask, sinks))


# -- rope -----------------------------------------------------------------------------------------
def _rope(ggml, x, pos, factors=None, *, n_dims, mode, **kw):
    params = dict(n_ctx_orig=kw.get("n_ctx_orig", 0), freq_base=kw.get("freq_base", 10000.0),
                  freq_scale=kw.get("freq_scale", 1.0), ext_factor=kw.get("ext_factor", 0.0),
                  attn_factor=kw.get("attn_factor", 1.0), beta_fast=32.0, beta_slow=1.0)
    inputs = {"x": x, "pos": pos} | ({} if factors is None else {"ff": factors})
    got = ours(lambda g, x, pos, ff=None: g.rope_ext(x, pos, ff, n_dims=n_dims, mode=mode, **params),
               **inputs)

    def build(g, x, pos, ff):
        p = params
        return g.op("ggml_rope_ext", x, pos, ff, n_dims, mode, p["n_ctx_orig"], g.f(p["freq_base"]),
                    g.f(p["freq_scale"]), g.f(p["ext_factor"]), g.f(p["attn_factor"]),
                    g.f(p["beta_fast"]), g.f(p["beta_slow"]))
    return got, theirs(ggml, build, x, pos, factors)


@pytest.mark.parametrize("mode", [ops.ROPE_NORM, ops.ROPE_NEOX], ids=["norm", "neox"])
@pytest.mark.parametrize("freq_base", [10000.0, 1000000.0])
def test_rope(ggml, rng, mode, freq_base):
    """Head dim 64 at positions up to 2000: glibc sinf/cosf of f32-accumulated angles (beyond 120
    rad they take glibc's large-argument reduction) and x0*cos - x1*sin fused by GCC."""
    x = rng.normal(0, 2, (48, 4, 64)).astype(f32)                     # [T, H, head_dim]
    pos = np.sort(rng.integers(0, 2000, 48)).astype(np.int32)
    assert_same_bits(*_rope(ggml, x, pos, n_dims=64, mode=mode, freq_base=freq_base))


@pytest.mark.parametrize("mode", [ops.ROPE_NORM, ops.ROPE_NEOX], ids=["norm", "neox"])
def test_rope_partial_with_freq_factors_and_f16(ggml, rng, mode):
    x = rng.normal(0, 2, (9, 3, 96)).astype(f32)
    pos = np.array([0, 1, 2, 3, 150, 151, 700, 1999, 4000], dtype=np.int32)
    factors = rng.uniform(1, 8, 32).astype(f32)
    assert_same_bits(*_rope(ggml, x, pos, factors, n_dims=64, mode=mode, freq_base=500000.0))
    assert_same_bits(*_rope(ggml, x.astype(f16), pos, n_dims=64, mode=mode))


def test_rope_yarn(ggml, rng):
    """YaRN's ramp mix is fused by GCC; its magnitude scale uses logf (emulated by rounding f64)."""
    x = rng.normal(0, 2, (16, 2, 64)).astype(f32)
    pos = np.arange(0, 16000, 1000, dtype=np.int32)
    assert_same_bits(*_rope(ggml, x, pos, n_dims=64, mode=ops.ROPE_NEOX, n_ctx_orig=4096,
                            freq_scale=0.25, ext_factor=1.0))


# -- activations ----------------------------------------------------------------------------------
@pytest.mark.parametrize("width", [1536, 1000])  # 1000 = 62 chunks of 16 + a glibc-expf tail of 8
def test_swiglu_and_silu(ggml, rng, width):
    gate = (rng.normal(0, 3, (6, width))).astype(f32)
    up = rng.normal(0, 1, (6, width)).astype(f32)
    gate[0, :4] = [-120.0, 100.0, 0.0, -0.0]                           # exp over/underflow, zeros
    got = ours(lambda g, a, b: g.swiglu(a, b), a=gate, b=up)
    assert_same_bits(got, theirs(ggml, lambda g, a, b: g.op("ggml_swiglu_split", a, b), gate, up))
    got = ours(lambda g, a: g.silu(a), a=gate)
    assert_same_bits(got, theirs(ggml, lambda g, a: g.op("ggml_silu", a), gate))
    fused = np.concatenate([up, gate], axis=-1)                        # one [T, 2*width] projection
    got = ours(lambda g, a: g.glu("swiglu", a, swapped=True), a=fused)
    assert_same_bits(got, theirs(ggml, lambda g, a: g.op("ggml_swiglu_swapped", a), fused))


def test_silu_f16_is_scalar(ggml, rng):
    x = rng.normal(0, 3, (4, 64)).astype(f16)
    assert_same_bits(ours(lambda g, a: g.silu(a), a=x), theirs(ggml, lambda g, a: g.op("ggml_silu", a), x))


def test_gelu_tables_over_every_f16(ggml):
    """ggml's gelu and gelu_quick look up f16 tables built from ggml_gelu_f32 (glibc tanhf) at
    ggml_cpu_init; every finite f16 input, plus the +-10 clamps of plain gelu and geglu."""
    x = np.arange(65536, dtype=np.uint16).view(f16).astype(f32)
    x = np.concatenate([x[np.isfinite(x)], [-12.5, 10.0, 31.0]]).astype(f32).reshape(1, -1)
    g = np.linspace(-2, 2, x.size, dtype=f32).reshape(x.shape)
    for name in ("gelu", "gelu_quick", "tanh"):
        assert_same_bits(ours(lambda b, a, name=name: b.unary(name, a), a=x),
                         theirs(ggml, lambda b, a, name=name: b.op(f"ggml_{name}", a), x))
    assert_same_bits(ours(lambda b, a, c: b.glu("geglu", a, c), a=x, c=g),
                     theirs(ggml, lambda b, a, c: b.op("ggml_geglu_split", a, c), x, g))


@pytest.mark.parametrize("name", ["sigmoid", "exp", "sin", "cos", "log", "elu", "softplus", "gelu_erf"])
def test_libm_unary(ggml, rng, name):
    """ggml's scalar unary ops call glibc: expf (sigmoid, exp, softplus), sinf, cosf, logf (log,
    softplus), expm1f (elu)."""
    x = (rng.normal(0, 1, (8, 300)) * 10.0 ** rng.uniform(-2, 2.5, (8, 1))).astype(f32)
    if name in ("exp", "softplus"):
        x = np.clip(x, -100, 80)
    if name == "log":
        x = np.abs(x)
    got = ours(lambda g, a: g.unary(name, a), a=x)
    assert_same_bits(got, theirs(ggml, lambda g, a: g.op(f"ggml_{name}", a), x))


# -- normalisation and reductions -----------------------------------------------------------------
@pytest.mark.parametrize("width", [896, 1000, 4096])
def test_norms_and_reductions(ggml, rng, width):
    x = (rng.normal(0, 1, (7, width)) * 10.0 ** rng.uniform(-2, 2, (7, 1))).astype(f32)
    cases = [(lambda g, a: g.rms_norm(a, 1e-6), "ggml_rms_norm", [1e-6]),
             (lambda g, a: g.norm(a, 1e-5), "ggml_norm", [1e-5]),
             (lambda g, a: g.op(ops.L2Norm(eps=1e-12), a), "ggml_l2_norm", [1e-12]),
             (lambda g, a: g.mean(a), "ggml_mean", []),
             (lambda g, a: g.sum_rows(a), "ggml_sum_rows", []),
             (lambda g, a: g.op(ops.Sum(), a), "ggml_sum", [])]
    for build, name, floats in cases:
        want = theirs(ggml, lambda g, a, name=name, floats=floats: g.op(name, a, *map(g.f, floats)), x)
        assert_same_bits(ours(build, a=x), want)


def test_group_norm(ggml, rng):
    """Row sums into doubles, added per group; y = (x - mean) * (1/sqrtf(var + eps)); 6 channels in 4
    groups of 2 (the last group takes what is left)."""
    x = (rng.normal(0, 3, (2, 7, 5, 33)) + 1).astype(f32)               # [B, C, L, W]
    got = ours(lambda g, a: g.op(ops.GroupNorm(n_groups=4, eps=1e-5), a), a=x)
    assert_same_bits(got, theirs(ggml, lambda g, a: g.op("ggml_group_norm", a, 4, g.f(1e-5)), x))


# -- matmul ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("weight_dtype", [f16, f32], ids=["f16", "f32"])
@pytest.mark.parametrize("m,n,k", [
    (256, 1, 64),      # decode k.q: ggml_vec_dot_f16/f32, one 64-wide step
    (64, 1, 256),      # decode kq.v
    (96, 1, 200),      # vec_dot leftovers (f32: 8 vectorised unfused, then 0 fused)
    (40, 1, 71),       # f32 leftovers: 7 fused by GCC's scalar tail (AVX2: 3 fused, 4 rounded)
    (40, 1, 125),      # leftovers 61 (AVX-512) / 29 (AVX2): both epilogue widths and the tail
    (256, 7, 64),      # prompt: tinyBLAS, 16 lanes
    (64, 7, 256),
    (250, 7, 64),      # m % 4 != 0: tinyBLAS declines, vec_dot per output
    (64, 3, 72),       # k % 16 != 0: likewise
])
def test_mul_mat_float(ggml, rng, weight_dtype, m, n, k):
    a = rng.normal(0, 1, (m, k)).astype(weight_dtype)
    b = rng.normal(0, 1, (n, k)).astype(f32)
    got = ours(lambda g, a, b: g.mul_mat(a, b), a=a, b=b)
    assert_same_bits(got, theirs(ggml, lambda g, a, b: g.op("ggml_mul_mat", a, b), a, b))


@pytest.mark.parametrize("m,n,k", [
    (64, 1, 256),      # ggml_vec_dot_bf16: vdpbf16ps pairs (AVX-512) or 8-lane fmas (AVX2)
    (48, 1, 200),      # leftovers into the double
    (64, 5, 256),      # tinyBLAS: 32-wide vdpbf16ps steps, or 8-lane fmas
    (64, 5, 72),       # K % 32 != 0: AVX-512 declines tinyBLAS, AVX2 takes it
    (62, 5, 64),       # M % 4 != 0: vec_dot
])
def test_mul_mat_bf16(ggml, rng, m, n, k):
    """bf16 weights: src1 rounded to bf16 (nearest even), products exact, denormals flushed by vdpbf16ps."""
    from llamir.ir import BF16
    from llamir.ir.interp_kernels import f32_to_bf16
    from llamir.testing.libggml import Raw

    bits = f32_to_bf16(rng.normal(0, 1, (m, k)).astype(f32))
    bits[0, :4] = [0x0001, 0x8002, 0x0040, 0x3F80]                 # bf16 denormals, and 1.0
    b = rng.normal(0, 1, (n, k)).astype(f32)
    g = GraphBuilder("exact")
    y = g.mul_mat(g.input("a", [m, k], BF16), g.input("b", [n, k], F32))
    g.output("y", y)
    from llamir.testing.llama_cpp import oracle_numerics
    got = run_graph(g.graph, {"a": bits, "b": b}, numerics=oracle_numerics())["y"]
    raw = Raw(bits.view(np.uint8).reshape(m, 2 * k), int(BF16.ggml_type), (m, k))
    assert_same_bits(got, theirs(ggml, lambda g, a, b: g.op("ggml_mul_mat", a, b), raw, b))


def test_mul_mat_broadcast_heads(ggml, rng):
    """k.q of grouped-query attention: 2 KV heads serve 6 query heads (f16 cache, f32 q)."""
    k = rng.normal(0, 1, (2, 256, 64)).astype(f16)
    q = rng.normal(0, 1, (6, 5, 64)).astype(f32)
    got = ours(lambda g, k, q: g.mul_mat(k, q), k=k, q=q)
    assert_same_bits(got, theirs(ggml, lambda g, k, q: g.op("ggml_mul_mat", k, q), k, q))


@pytest.mark.parametrize("weight_dtype", [f16, f32], ids=["f16", "f32"])
def test_mul_mat_permuted_activations(ggml, rng, weight_dtype):
    """k.q with q permuted to heads-first: an f32 cache takes it as is, to vec_dot; an f16 cache
    gets q converted (hence packed) and so reaches tinyBLAS."""
    k = rng.normal(0, 1, (4, 256, 64)).astype(weight_dtype)        # [H, n_kv, d]
    q = rng.normal(0, 1, (5, 4, 64)).astype(f32)                    # [T, H, d]
    got = ours(lambda g, k, q: g.mul_mat(k, g.permute(q, 1, 0, 2)), k=k, q=q)
    want = theirs(ggml, lambda g, k, q: g.op("ggml_mul_mat", k, g.op("ggml_permute", q, 0, 2, 1, 3)), k, q)
    assert_same_bits(got, want)


# -- plain element-wise and copies ----------------------------------------------------------------
def test_elementwise_and_copies(ggml, rng):
    x = rng.normal(0, 5, (6, 128)).astype(f32)
    w = rng.normal(0, 1, (128,)).astype(f32)
    table = rng.normal(0, 1, (50, 128)).astype(f16)
    rows = np.array([3, 0, 49, 3], dtype=np.int32)
    assert_same_bits(ours(lambda g, a, b: g.mul(a, b), a=x, b=w),
                     theirs(ggml, lambda g, a, b: g.op("ggml_mul", a, b), x, w))
    assert_same_bits(ours(lambda g, a, b: g.add(a, b), a=x, b=w),
                     theirs(ggml, lambda g, a, b: g.op("ggml_add", a, b), x, w))
    assert_same_bits(ours(lambda g, a: g.cast(a, F16), a=x),
                     theirs(ggml, lambda g, a, dst: g.op("ggml_cpy", a, dst), x, np.zeros(x.shape, f16)))
    assert_same_bits(ours(lambda g, t, i: g.get_rows(t, i), t=table, i=rows),
                     theirs(ggml, lambda g, t, i: g.op("ggml_get_rows", t, i), table, rows))
