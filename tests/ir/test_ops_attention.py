"""rope_ext, soft_max_ext and flash_attn_ext of the reference interpreter against float64 closed
forms: rotations from the angle formula (YaRN included), masked softmax with ALiBi and sinks, and
plain softmax attention."""

from __future__ import annotations

import math

import numpy as np
import pytest

from llamir.ir import BF16, F16, F32, I32, GraphBuilder, IRError, ops, run_graph

f32, f16, f64 = np.float32, np.float16, np.float64


def _rand(shape, seed, lo=-2.0, hi=2.0):
    return np.random.default_rng(seed).uniform(lo, hi, shape).astype(f32)


# -- rope_ext ------------------------------------------------------------------------------------
def rope_angles(pos, n_dims, base, freq_scale=1.0, ext_factor=0.0, attn_factor=1.0, n_ctx_orig=0,
                beta_fast=32.0, beta_slow=1.0, freq_factors=None):
    """cos, sin [T, n_dims/2] in float64 from the formula (YaRN per ggml_rope_yarn_corr_dims)."""
    i = np.arange(n_dims // 2)
    extrap = pos[:, None].astype(f64) * base ** (-2.0 * i / n_dims)
    if freq_factors is not None:
        extrap = extrap / freq_factors[: n_dims // 2]
    theta, mscale = freq_scale * extrap, attn_factor
    if ext_factor != 0:
        def corr_dim(n_rot):
            return n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))
        low = max(0.0, math.floor(corr_dim(beta_fast)))
        high = min(n_dims - 1.0, math.ceil(corr_dim(beta_slow)))
        mix = (1 - np.clip((i - low) / max(0.001, high - low), 0, 1)) * ext_factor
        theta = theta * (1 - mix) + extrap * mix
        mscale *= 1 + 0.1 * math.log(1 / freq_scale)
    return np.cos(theta) * mscale, np.sin(theta) * mscale


def rope_ref(x, pos, n_dims, mode, **kw):
    """x [..., T, H, d]: NORM rotates (2i, 2i+1), NEOX rotates (i, i + n_dims/2); the rest passes."""
    cos, sin = rope_angles(pos, n_dims, **kw)
    cos, sin = cos[:, None, :], sin[:, None, :]
    x = x.astype(f64)
    y = x.copy()
    half = n_dims // 2
    if mode == ops.ROPE_NEOX:
        first, second = np.arange(half), np.arange(half) + half
    else:
        first, second = np.arange(half) * 2, np.arange(half) * 2 + 1
    y[..., first] = x[..., first] * cos - x[..., second] * sin
    y[..., second] = x[..., first] * sin + x[..., second] * cos
    return y


def _rope_graph(x_shape, n_dims, mode, dtype=F32, factors=False, dims=(), **kw):
    g = GraphBuilder("t", dims=dims)
    x = g.input("x", x_shape, dtype)
    pos = g.input("pos", [x_shape[-3]], I32)
    ff = g.weight("ff", [n_dims // 2], F32) if factors else None
    g.output("y", g.rope_ext(x, pos, ff, n_dims=n_dims, mode=mode, **kw))
    return g.graph


POS = np.array([0, 1, 5, 17, 3, 63, 2], dtype=np.int32)
MODES = [ops.ROPE_NORM, ops.ROPE_NEOX]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape,n_dims", [((7, 2, 8), 8), ((7, 3, 10), 6), ((2, 7, 1, 12), 4),
                                          ((7, 1, 2), 2)])
def test_rope(mode, shape, n_dims, nmse):
    x, pos = _rand(shape, 1), POS
    graph = _rope_graph(shape, n_dims, mode, n_ctx_orig=4096, freq_base=10000.0)
    got = run_graph(graph, {"x": x, "pos": pos})["y"]
    want = rope_ref(x, pos, n_dims, mode, base=10000.0)
    # angles are accumulated in f32 (theta *= theta_scale): relative error ~ i * 2^-24 of pos <= 63
    assert nmse(got, want) < 1e-10
    np.testing.assert_array_equal(got[..., n_dims:], x[..., n_dims:])     # pass-through, exact
    np.testing.assert_array_equal(got[..., 0, :, :], x[..., 0, :, :])     # position 0: identity


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n_tokens", [1, 3, 7])
def test_rope_symbolic_through_a_fused_qkv_view(mode, n_tokens, nmse):
    """q = view of a fused [T, 3*H*d] qkv row (llama.cpp's wqkv), roped without a copy."""
    n_head, d = 2, 8
    qkv = _rand((n_tokens, 3 * n_head * d), n_tokens)
    g = GraphBuilder("t", dims=["T"])
    T = g.dim("T")
    row = 3 * n_head * d * 4
    k = g.view(g.input("qkv", ["T", 3 * n_head * d], F32), [T, n_head, d], [row, d * 4, 4],
               offset=n_head * d * 4)                                            # the K part
    y = g.rope_ext(k, g.input("pos", ["T"], I32), n_dims=d, mode=mode, n_ctx_orig=0, freq_base=500.0)
    g.output("y", y)
    got = run_graph(g.graph, {"qkv": qkv, "pos": POS[:n_tokens]}, {"T": n_tokens})["y"]
    x = qkv[:, n_head * d: 2 * n_head * d].reshape(n_tokens, n_head, d)
    assert nmse(got, rope_ref(x, POS[:n_tokens], d, mode, base=500.0)) < 1e-10


@pytest.mark.parametrize("mode", MODES)
def test_rope_freq_factors(mode, nmse):
    x, ff = _rand((7, 2, 12), 2), np.array([1.0, 2.0, 4.0, 8.0, 1.5], dtype=f32)
    graph = _rope_graph((7, 2, 12), 10, mode, factors=True, n_ctx_orig=0, freq_base=1e4)
    got = run_graph(graph, {"x": x, "pos": POS, "ff": ff})["y"]
    want = rope_ref(x, POS, 10, mode, base=1e4, freq_factors=ff.astype(f64))
    assert nmse(got, want) < 1e-10
    assert nmse(got, rope_ref(x, POS, 10, mode, base=1e4)) > 1e-4        # the factors matter


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("ext_factor,attn_factor", [(1.0, 1.0), (0.5, 0.8)])
def test_rope_yarn(mode, ext_factor, attn_factor, nmse):
    shape, n_dims = (7, 2, 32), 32
    kw = dict(n_ctx_orig=512, freq_base=10000.0, freq_scale=0.25, ext_factor=ext_factor,
              attn_factor=attn_factor, beta_fast=32.0, beta_slow=1.0)
    x = _rand(shape, 3)
    got = run_graph(_rope_graph(shape, n_dims, mode, **kw), {"x": x, "pos": POS})["y"]
    want = rope_ref(x, POS, n_dims, mode, base=10000.0, **{k: v for k, v in kw.items() if k != "freq_base"})
    assert nmse(got, want) < 1e-10
    # the ramp really blends: plain linear scaling (ext_factor 0, same mscale) is far away
    plain = rope_ref(x, POS, n_dims, mode, base=10000.0, freq_scale=0.25,
                     attn_factor=attn_factor * (1 + 0.1 * math.log(4)))
    assert nmse(got, plain) > 1e-3


def test_rope_f16_input(nmse):
    x = _rand((7, 2, 8), 4).astype(f16)
    got = run_graph(_rope_graph((7, 2, 8), 8, ops.ROPE_NEOX, dtype=F16, n_ctx_orig=0, freq_base=1e4),
                    {"x": x, "pos": POS})["y"]
    assert got.dtype == f16
    assert nmse(got, rope_ref(x.astype(f32), POS, 8, ops.ROPE_NEOX, base=1e4)) < 1e-6


# -- soft_max_ext --------------------------------------------------------------------------------
def alibi_slopes_ref(n_head, max_bias):
    if max_bias <= 0:
        return np.ones(n_head)
    n_log2 = 2 ** math.floor(math.log2(n_head))
    m0, m1 = 2 ** (-max_bias / n_log2), 2 ** (-(max_bias / 2) / n_log2)
    return np.array([m0 ** (h + 1) if h < n_log2 else m1 ** (2 * (h - n_log2) + 1) for h in range(n_head)])


def softmax_ref(x, mask=None, scale=1.0, max_bias=0.0, sinks=None):
    """x [..., H, T, n]; mask [..., H', T' >= T, n] (first T rows; heads tiled h % H')."""
    w = x.astype(f64) * scale
    if mask is not None:
        m = mask[..., : x.shape[-2], :].astype(f64)
        m = m.reshape((1,) * (x.ndim - m.ndim) + m.shape)
        m = m[np.ix_(*[np.arange(n) % k for n, k in zip(x.shape, m.shape, strict=True)])]
        slopes = alibi_slopes_ref(x.shape[-3], max_bias) if x.ndim >= 3 else np.ones(1)
        w = w + slopes[:, None, None] * m if x.ndim >= 3 else w + m
    e = np.exp(w - w.max(axis=-1, keepdims=True))
    total = e.sum(axis=-1, keepdims=True)
    if sinks is not None:
        total = total + np.exp(sinks.astype(f64)[:, None, None] - w.max(axis=-1, keepdims=True))
    return e / total


def causal_mask(n_rows, n_kv, n_past, pad_rows=0, dtype=f32):
    """Causal mask with `pad_rows` extra rows of junk that must never be read."""
    rows = np.arange(n_rows + pad_rows)[:, None] + n_past
    m = np.where(np.arange(n_kv)[None, :] <= rows, 0.0, -np.inf)
    m[n_rows:] = 1e4
    return m.astype(dtype)


def _softmax(x, mask=None, sinks=None, dims=(), bindings=None, mask_dtype=F32, **kw):
    g = GraphBuilder("t", dims=dims)
    xs = g.input("x", x.shape, F32)
    m = g.input("mask", mask.shape, mask_dtype) if mask is not None else None
    s = g.weight("sinks", sinks.shape, F32) if sinks is not None else None
    g.output("y", g.soft_max_ext(xs, m, sinks=s, **kw))
    vals = {"x": x, "mask": mask, "sinks": sinks}
    return run_graph(g.graph, {k: v for k, v in vals.items() if v is not None}, bindings)["y"]


@pytest.mark.parametrize("shape", [(1, 5), (3, 9), (4, 3, 8), (2, 6, 1, 7)])
@pytest.mark.parametrize("scale", [1.0, 0.125])
def test_soft_max_plain(shape, scale, nmse):
    x = _rand(shape, 5, -6, 6)
    got = _softmax(x, scale=scale)
    assert nmse(got, softmax_ref(x, scale=scale)) < 1e-13
    np.testing.assert_allclose(got.sum(-1), 1, rtol=1e-6)


@pytest.mark.parametrize("mask_dtype", [F32, F16])
@pytest.mark.parametrize("x_shape,mask_rows", [((3, 8), 5), ((4, 3, 8), 8), ((2, 4, 1, 8), 4)])
def test_soft_max_causal_mask_with_padding_rows(mask_dtype, x_shape, mask_rows, nmse):
    x = _rand(x_shape, 6, -4, 4)
    t = x_shape[-2]
    mask = causal_mask(t, 8, n_past=8 - t, pad_rows=mask_rows - t, dtype=mask_dtype.np_dtype)
    got = _softmax(x, mask, scale=0.5, mask_dtype=mask_dtype)
    assert nmse(got, softmax_ref(x, mask.astype(f32), scale=0.5)) < 1e-13
    assert np.all(got[..., mask[:t] == -np.inf] == 0)


def test_soft_max_mask_heads_tile_modulo(nmse):
    x = _rand((2, 4, 3, 6), 7)
    mask = _rand((1, 2, 3, 6), 8, -3, 0)             # mask head h % 2 serves head h
    got = _softmax(x, mask, scale=1.0)
    assert nmse(got, softmax_ref(x, mask)) < 1e-13
    assert nmse(got[:, 2], softmax_ref(x[:, 2], mask[:, 0])) < 1e-13


@pytest.mark.parametrize("n_head", [1, 4, 6])
@pytest.mark.parametrize("max_bias", [8.0, 2.5])
def test_soft_max_alibi(n_head, max_bias, nmse):
    x = _rand((n_head, 3, 7), 9)
    mask = np.tile(-np.abs(np.arange(7) - 6.0), (3, 1)).astype(f32)   # ALiBi's linear position bias
    got = _softmax(x, mask, scale=0.3, max_bias=max_bias)
    assert nmse(got, softmax_ref(x, mask, scale=0.3, max_bias=max_bias)) < 1e-12


def test_alibi_slopes_closed_form():
    """For 8 heads and max_bias 8 the slopes are 2^-1 ... 2^-8 (the ALiBi paper's sequence)."""
    x = np.zeros((8, 1, 2), dtype=f32)
    mask = np.array([[0.0, 100.0]], dtype=f32)
    got = _softmax(x, mask, scale=1.0, max_bias=8.0)
    slopes = np.log(got[:, 0, 1] / got[:, 0, 0]) / 100   # softmax([0, 100 slope]): ratio e^(100 slope)
    np.testing.assert_allclose(slopes, 2.0 ** -np.arange(1, 9), rtol=1e-5)


@pytest.mark.parametrize("with_mask", [False, True])
def test_soft_max_sinks(with_mask, nmse):
    x = _rand((3, 4, 6), 10)
    sinks = np.array([0.5, -1.0, 3.0], dtype=f32)
    mask = causal_mask(4, 6, 2) if with_mask else None
    got = _softmax(x, mask, sinks, scale=0.7)
    want = softmax_ref(x, mask, scale=0.7, sinks=sinks)
    assert nmse(got, want) < 1e-13
    assert np.all(got.sum(-1) < 1)                     # the sink takes part of the mass


@pytest.mark.parametrize("n_tokens", [1, 3, 7])
def test_soft_max_symbolic_and_permuted(n_tokens, nmse):
    x = _rand((n_tokens, 2, 9), n_tokens)
    mask = causal_mask(n_tokens, 9, 9 - n_tokens, pad_rows=1)
    g = GraphBuilder("t", dims=["T", "Tp"])
    xp = g.permute(g.input("x", ["T", 2, 9], F32), 1, 0, 2)          # [2, T, 9]
    g.output("y", g.soft_max_ext(xp, g.input("mask", ["Tp", 9], F32), 0.25))
    got = run_graph(g.graph, {"x": x, "mask": mask}, {"T": n_tokens, "Tp": n_tokens + 1})["y"]
    assert nmse(got, softmax_ref(np.transpose(x, (1, 0, 2)), mask, scale=0.25)) < 1e-13


def test_soft_max_rejects_a_mask_with_fewer_rows():
    g = GraphBuilder("t")
    with pytest.raises(IRError, match="mask"):
        g.soft_max_ext(g.input("x", [2, 4, 8], F32), g.input("mask", [1, 8], F32), 1.0)


# -- flash_attn_ext ------------------------------------------------------------------------------
def attention_ref(q, k, v, mask=None, scale=1.0, max_bias=0.0, softcap=0.0, sinks=None):
    """Plain softmax attention in float64: q [S, H, T, dk], k/v [S, Hkv, n, d] -> [S, T, H, dv]."""
    n_s, n_head, n_tok, _ = q.shape
    group = n_head // k.shape[1]
    kk = np.repeat(k.astype(f64), group, axis=1)         # head h uses KV head h // group
    vv = np.repeat(v.astype(f64), group, axis=1)
    s = np.einsum("shtd,shnd->shtn", q.astype(f64), kk) * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    if mask is not None:
        m = mask[..., :n_tok, :].astype(f64)
        m = m[np.ix_(np.arange(n_s) % m.shape[0], np.arange(n_head) % m.shape[1],
                     np.arange(n_tok), np.arange(m.shape[-1]))]
        s = s + alibi_slopes_ref(n_head, max_bias)[None, :, None, None] * m
    row_max = s.max(axis=-1, keepdims=True)
    if sinks is not None:
        row_max = np.maximum(row_max, sinks.astype(f64)[None, :, None, None])
    e = np.exp(s - row_max)
    total = e.sum(-1, keepdims=True)
    if sinks is not None:
        total = total + np.exp(sinks.astype(f64)[None, :, None, None] - row_max)
    with np.errstate(invalid="ignore"):
        out = np.einsum("shtn,shnd->shtd", e, vv) / total
    return np.transpose(np.nan_to_num(out), (0, 2, 1, 3))


def _flash(q, k, v, mask=None, sinks=None, kv_dtype=F32, **kw):
    g = GraphBuilder("t")
    inputs = [g.input("q", q.shape, F32), g.input("k", k.shape, kv_dtype), g.input("v", v.shape, kv_dtype)]
    m = g.input("mask", mask.shape, F16) if mask is not None else None
    s = g.weight("sinks", sinks.shape, F32) if sinks is not None else None
    g.output("y", g.flash_attn_ext(*inputs, m, sinks=s, **kw))
    vals = {"q": q, "k": k, "v": v, "mask": mask, "sinks": sinks}
    return run_graph(g.graph, {n: a for n, a in vals.items() if a is not None})["y"]


def _qkv(n_s, n_head, n_head_kv, n_tok, n_kv, dk, dv, seed):
    return (_rand((n_s, n_head, n_tok, dk), seed), _rand((n_s, n_head_kv, n_kv, dk), seed + 1),
            _rand((n_s, n_head_kv, n_kv, dv), seed + 2))


def _mask4(n_s, n_head, n_tok, n_kv, pad_rows=0):
    m = causal_mask(n_tok, n_kv, n_kv - n_tok, pad_rows=pad_rows, dtype=f16)
    return np.broadcast_to(m, (n_s, n_head) + m.shape).copy()


FLASH_CASES = [  # (S, H, Hkv, T, n_kv, dk, dv)
    (1, 1, 1, 1, 1, 4, 4),
    (1, 4, 2, 3, 8, 8, 8),      # GQA
    (2, 6, 1, 5, 7, 4, 6),      # MQA, two streams, dv != dk
    (1, 2, 2, 4, 16, 16, 8),
]


@pytest.mark.parametrize("case", FLASH_CASES)
def test_flash_attn_f32_kv_matches_softmax_attention(case, nmse):
    n_s, n_head, n_head_kv, n_tok, n_kv, dk, dv = case
    q, k, v = _qkv(n_s, n_head, n_head_kv, n_tok, n_kv, dk, dv, 11)
    mask = _mask4(1, 1, n_tok, n_kv, pad_rows=2)          # one mask for all streams and heads
    got = _flash(q, k, v, mask, scale=1 / math.sqrt(dk))
    assert got.shape == (n_s, n_tok, n_head, dv)
    assert nmse(got, attention_ref(q, k, v, mask, scale=1 / math.sqrt(dk))) < 1e-12


def test_flash_attn_f16_kv_within_f16_accumulation_bound(nmse):
    """With f16 K/V, ggml rounds q to f16 and keeps the V accumulator in f16: every KV step rounds
    twice (rescale, add) by at most 2^-11 of a value bounded by S_j * max|v|, and dividing by
    S >= S_j leaves |error| <= 2 * n_kv * 2^-11 * max|v|."""
    n_s, n_head, n_head_kv, n_tok, n_kv, d = 1, 4, 2, 3, 16, 16
    q, k, v = _qkv(n_s, n_head, n_head_kv, n_tok, n_kv, d, d, 12)
    k16, v16 = k.astype(f16), v.astype(f16)
    mask = _mask4(1, 2, n_tok, n_kv)
    got = _flash(q, k16, v16, mask, kv_dtype=F16, scale=0.25)
    want = attention_ref(q.astype(f16), k16, v16, mask, scale=0.25)
    bound = 2 * n_kv * 2.0**-11 * np.abs(v16.astype(f64)).max()
    assert np.max(np.abs(got - want)) <= bound
    assert nmse(got, want) < 1e-5                       # typical error is a random walk, far below


@pytest.mark.parametrize("softcap", [0.0, 1.5])
@pytest.mark.parametrize("max_bias", [0.0, 4.0])
def test_flash_attn_softcap_alibi(softcap, max_bias, nmse):
    q, k, v = _qkv(1, 6, 3, 3, 8, 8, 8, 13)
    q *= 3
    mask = _mask4(1, 1, 3, 8, pad_rows=1)
    mask[..., :3, :] += -np.abs(np.arange(8) - 7.0).astype(f16)       # ALiBi-like position bias
    got = _flash(q, k, v, mask, scale=0.5, max_bias=max_bias, logit_softcap=softcap)
    want = attention_ref(q, k, v, mask, scale=0.5, max_bias=max_bias, softcap=softcap)
    assert nmse(got, want) < 1e-12


@pytest.mark.filterwarnings("ignore:divide by zero")  # interp_nn: 1/run_sum is evaluated where it is 0
def test_flash_attn_sinks_and_fully_masked_rows(nmse):
    q, k, v = _qkv(1, 2, 1, 3, 5, 4, 4, 14)
    sinks = np.array([1.0, -2.0], dtype=f32)
    mask = _mask4(1, 2, 3, 5)
    mask[0, 1, 2, :] = -np.inf                          # head 1, token 2 sees nothing
    got = _flash(q, k, v, mask, sinks, scale=0.5)
    assert nmse(got, attention_ref(q, k, v, mask, scale=0.5, sinks=sinks)) < 1e-12
    got_no_sink = _flash(q, k, v, mask, scale=0.5)
    np.testing.assert_array_equal(got_no_sink[0, 2, 1], 0)   # ggml: S == 0 -> output 0, not NaN
    np.testing.assert_array_equal(got[0, 2, 1], 0)


@pytest.mark.parametrize("n_kv", [1, 3, 7])
def test_flash_attn_symbolic_through_permuted_cache_views(n_kv, nmse):
    """llama.cpp's layout: q [T, H, d] permuted to [H, T, d]; k/v read from a [n_ctx, Hkv, d] cache."""
    n_ctx, n_head, n_head_kv, d, n_tok = 8, 4, 2, 4, 1
    q, cache_k, cache_v = _rand((n_tok, n_head, d), 15), _rand((n_ctx, n_head_kv, d), 16), \
        _rand((n_ctx, n_head_kv, d), 17)
    g = GraphBuilder("t", dims=["n_kv"])
    nk = g.dim("n_kv")

    def cache_view(name):
        leaf = g.state(name, [n_ctx, n_head_kv, d], F32)
        view = g.view(leaf, [nk, n_head_kv, d], [n_head_kv * d * 4, d * 4, 4])
        return g.reshape(g.cont(g.permute(view, 1, 0, 2)), 1, n_head_kv, nk, d)

    qp = g.reshape(g.cont(g.permute(g.input("q", [n_tok, n_head, d], F32), 1, 0, 2)), 1, n_head, n_tok, d)
    y = g.flash_attn_ext(qp, cache_view("k"), cache_view("v"), None, scale=0.5)
    g.output("y", y)
    got = run_graph(g.graph, {"q": q, "k": cache_k, "v": cache_v}, {"n_kv": n_kv})["y"]
    qq = np.transpose(q, (1, 0, 2))[None]
    kk = np.transpose(cache_k[:n_kv], (1, 0, 2))[None]
    vv = np.transpose(cache_v[:n_kv], (1, 0, 2))[None]
    assert nmse(got, attention_ref(qq, kk, vv, scale=0.5)) < 1e-12


def test_flash_attn_bf16_k_rounds_q_to_bf16(nmse):
    q, k, v = _qkv(1, 2, 2, 3, 8, 32, 8, 18)
    to_bits = lambda a: ((a.view(np.uint32).astype(np.uint64) + 0x7FFF  # noqa: E731
                          + ((a.view(np.uint32) >> 16) & 1)) >> 16).astype(np.uint16)
    from_bits = lambda b: (b.astype(np.uint32) << 16).view(f32)  # noqa: E731
    g = GraphBuilder("t")
    y = g.flash_attn_ext(g.input("q", q.shape, F32), g.input("k", k.shape, BF16), g.input("v", v.shape, F32),
                         None, scale=0.3)
    g.output("y", y)
    got = run_graph(g.graph, {"q": q, "k": to_bits(k), "v": v})["y"]
    want = attention_ref(from_bits(to_bits(q)), from_bits(to_bits(k)), v, scale=0.3)
    assert nmse(got, want) < 1e-12


def test_flash_attn_rejects_a_mask_with_non_dividing_heads():
    g = GraphBuilder("t")
    with pytest.raises(IRError, match="mask"):
        g.flash_attn_ext(g.input("q", [1, 4, 2, 8], F32), g.input("k", [1, 2, 6, 8], F16),
                         g.input("v", [1, 2, 6, 8], F16), g.input("mask", [1, 3, 2, 6], F16), scale=1.0)


# -- type errors ---------------------------------------------------------------------------------
def test_attention_type_errors():
    g = GraphBuilder("t", dims=["T"])
    x = g.input("x", ["T", 2, 8], F32)
    pos = g.input("pos", ["T"], I32)
    with pytest.raises(IRError, match=r"rope_ext.*n_dims=10 must be even and within the head size 8"):
        g.rope_ext(x, pos, n_dims=10, mode=0, n_ctx_orig=0, freq_base=1e4)
    with pytest.raises(IRError, match=r"rope_ext.*n_dims=3"):
        g.rope_ext(x, pos, n_dims=3, mode=0, n_ctx_orig=0, freq_base=1e4)
    with pytest.raises(IRError, match=r"rope_ext.*mode 1 is not supported"):
        g.rope_ext(x, pos, n_dims=8, mode=1, n_ctx_orig=0, freq_base=1e4)
    with pytest.raises(IRError, match=r"rope_ext.*pos must be i32"):
        g.rope_ext(x, g.input("fpos", ["T"], F32), n_dims=8, mode=0, n_ctx_orig=0, freq_base=1e4)
    with pytest.raises(IRError, match=r"rope_ext.*3 positions for T tokens"):
        g.rope_ext(x, g.input("pos3", [3], I32), n_dims=8, mode=0, n_ctx_orig=0, freq_base=1e4)
    with pytest.raises(IRError, match=r"rope_ext.*2 freq factors < n_dims/2"):
        g.rope_ext(x, pos, g.weight("ff", [2], F32), n_dims=8, mode=0, n_ctx_orig=0, freq_base=1e4)
    with pytest.raises(IRError, match=r"soft_max_ext.*x must be f32, got f16"):
        g.soft_max_ext(g.input("h", [2, 8], F16), None, 1.0)
    with pytest.raises(IRError, match=r"soft_max_ext.*differ in the last axis"):
        g.soft_max_ext(g.input("s", [2, 8], F32), g.input("m", [2, 7], F32), 1.0)
    with pytest.raises(IRError, match=r"soft_max_ext.*does not repeat into"):
        g.soft_max_ext(g.input("s3", [4, 2, 8], F32), g.input("m3", [3, 2, 8], F32), 1.0)
    with pytest.raises(IRError, match=r"soft_max_ext.*sinks must be f32"):
        g.soft_max_ext(g.input("s4", [4, 2, 8], F32), None, 1.0, sinks=g.input("sk", [4], F16))
    q, k = g.input("q", [1, 4, 3, 8], F32), g.input("k", [1, 2, 6, 8], F16)
    with pytest.raises(IRError, match=r"flash_attn_ext.*q must be f32"):
        g.flash_attn_ext(g.input("qh", [1, 4, 3, 8], F16), k, k, None, 1.0)
    with pytest.raises(IRError, match=r"flash_attn_ext.*head sizes differ"):
        g.flash_attn_ext(q, g.input("k2", [1, 2, 6, 4], F16), k, None, 1.0)
    with pytest.raises(IRError, match=r"flash_attn_ext.*KV heads"):
        g.flash_attn_ext(q, g.input("k3", [1, 3, 6, 8], F16), g.input("v3", [1, 3, 6, 8], F16), None, 1.0)
    with pytest.raises(IRError, match=r"flash_attn_ext.*mask .* does not match"):
        g.flash_attn_ext(q, k, k, g.input("m4", [1, 1, 3, 5], F16), 1.0)
