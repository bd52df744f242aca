"""flash_attn_ext of the reference interpreter against libggml's CPU backend, bit for bit.

Every path ggml's CPU kernel takes is met: one_chunk (fewer than 64 query rows, or quantized /
mixed K and V), tiled (64+ rows of f16 or f32 K = V), and the split-KV decode (one row, 512+
cells, chunks per thread), with causal masks, GQA, ALiBi, sinks and head sizes 64 and 128.
The interpreter runs the oracle build's numerics profile with ggml's thread count (2).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from llamir.ir import F16, F32, GraphBuilder, dtype_named, quants, run_graph
from llamir.testing.libggml import Raw, assert_same_bits
from llamir.testing.llama_cpp import oracle_numerics

pytestmark = pytest.mark.llama_cpp
f32, f16 = np.float32, np.float16
N_THREADS = 2


def causal_mask(n_tokens: int, n_kv: int, n_pad_rows: int) -> np.ndarray:
    """[1, 1, rows, n_kv] f16: the last n_tokens of n_kv cells, each seeing itself and before."""
    mask = np.zeros((n_pad_rows, n_kv), dtype=f32)
    for t in range(n_tokens):
        mask[t, n_kv - n_tokens + t + 1:] = -np.inf
    return mask.astype(f16)[None, None]


def kv_storage(x: np.ndarray, dtype: str) -> np.ndarray:
    """Values [S, H, n, d] f32 as KV-cache storage of `dtype` (quantized rows as bytes)."""
    if dtype == "f32":
        return x
    if dtype == "f16":
        return x.astype(f16)
    return quants.quantize(np.ascontiguousarray(x), dtype_named(dtype))


def as_ggml(x: np.ndarray, dtype: str, shape: tuple[int, ...]):
    return x if dtype in ("f32", "f16") else Raw(x, int(dtype_named(dtype).ggml_type), shape)


def run_both(ggml, *, n_tok, n_kv, n_head, n_head_kv, dk, dv, k_type, v_type, seed, max_bias=0.0,
             softcap=0.0, sinks=False, masked=True):
    rng = np.random.default_rng(seed)
    q = rng.normal(0, 1, (1, n_head, n_tok, dk)).astype(f32)
    k = kv_storage(rng.normal(0, 1, (1, n_head_kv, n_kv, dk)).astype(f32), k_type)
    v = kv_storage(rng.normal(0, 1, (1, n_head_kv, n_kv, dv)).astype(f32), v_type)
    mask = causal_mask(n_tok, n_kv, n_tok) if masked else None
    if mask is not None and max_bias:
        rel = -np.abs(np.arange(n_kv) - np.arange(n_kv - n_tok, n_kv)[:, None]).astype(f32)
        mask = (mask.astype(f32) + rel).astype(f16)
    sink = (rng.normal(0, 2, n_head) + sinks).astype(f32) if sinks else None   # sinks=3: often the max
    scale = 1 / math.sqrt(dk)

    g = GraphBuilder("fa")
    qn = g.input("q", list(q.shape), F32)
    kn = g.input("k", [1, n_head_kv, n_kv, dk], dtype_named(k_type))
    vn = g.input("v", [1, n_head_kv, n_kv, dv], dtype_named(v_type))
    mn = g.input("mask", list(mask.shape), F16) if mask is not None else None
    sn = g.input("sinks", [n_head], F32) if sinks else None
    g.output("y", g.flash_attn_ext(qn, kn, vn, mn, scale, max_bias, softcap, sinks=sn))
    values = {"q": q, "k": k, "v": v} | ({"mask": mask} if mask is not None else {}) | (
        {"sinks": sink} if sinks else {})
    got = run_graph(g.graph, values, numerics=oracle_numerics(), n_threads=N_THREADS)["y"]

    with ggml.graph(256 << 20) as gg:
        tq = gg.tensor(q)
        tk = gg.tensor(as_ggml(k, k_type, (1, n_head_kv, n_kv, dk)))
        tv = gg.tensor(as_ggml(v, v_type, (1, n_head_kv, n_kv, dv)))
        tm = gg.tensor(mask) if mask is not None else None
        out = gg.op("ggml_flash_attn_ext", tq, tk, tv, tm, gg.f(scale), gg.f(max_bias), gg.f(softcap))
        if sinks:
            gg.call("ggml_flash_attn_ext_add_sinks", out, gg.tensor(sink))
        want = gg.compute(out, N_THREADS)
    return got, want


@pytest.mark.parametrize("kv", ["f16", "f32"])
@pytest.mark.parametrize("n_tok,n_kv", [(1, 256), (7, 256), (40, 300)])   # one_chunk
def test_one_chunk(ggml, kv, n_tok, n_kv):
    assert_same_bits(*run_both(ggml, n_tok=n_tok, n_kv=n_kv, n_head=4, n_head_kv=2, dk=64, dv=64,
                               k_type=kv, v_type=kv, seed=n_tok))


@pytest.mark.parametrize("kv", ["f16", "f32"])
@pytest.mark.parametrize("n_tok,n_kv,dk", [(64, 256, 64), (100, 300, 64), (70, 200, 128)])   # tiled
def test_tiled(ggml, kv, n_tok, n_kv, dk):
    assert_same_bits(*run_both(ggml, n_tok=n_tok, n_kv=n_kv, n_head=2, n_head_kv=1, dk=dk, dv=dk,
                               k_type=kv, v_type=kv, seed=n_tok + dk))


@pytest.mark.parametrize("kv", ["f16", "f32"])
@pytest.mark.parametrize("n_kv,dk", [(512, 64), (2048, 128), (777, 64)])   # split KV over the threads
def test_split_kv_decode(ggml, kv, n_kv, dk):
    assert_same_bits(*run_both(ggml, n_tok=1, n_kv=n_kv, n_head=4, n_head_kv=2, dk=dk, dv=dk,
                               k_type=kv, v_type=kv, seed=n_kv))


@pytest.mark.parametrize("k_type,v_type", [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("f16", "q8_0"), ("q8_0", "f16")])
@pytest.mark.parametrize("n_tok", [1, 9, 70])
def test_quantized_kv(ggml, k_type, v_type, n_tok):
    """q is quantized to q8_0 for the scores (vec_dot_q8_0_q8_0, vec_dot_q4_0_q8_0); V rows are
    dequantized and accumulated in f32."""
    assert_same_bits(*run_both(ggml, n_tok=n_tok, n_kv=256, n_head=4, n_head_kv=4, dk=64, dv=64,
                               k_type=k_type, v_type=v_type, seed=3 * n_tok))


@pytest.mark.parametrize("n_tok", [5, 64])
def test_alibi_and_sinks(ggml, n_tok):
    assert_same_bits(*run_both(ggml, n_tok=n_tok, n_kv=128, n_head=6, n_head_kv=3, dk=64, dv=64,
                               k_type="f16", v_type="f16", seed=11, max_bias=8.0, sinks=3))


@pytest.mark.parametrize("n_kv", [600])
def test_split_kv_with_sinks(ggml, n_kv):
    assert_same_bits(*run_both(ggml, n_tok=1, n_kv=n_kv, n_head=2, n_head_kv=1, dk=64, dv=64,
                               k_type="f16", v_type="f16", seed=5, sinks=3))


@pytest.mark.parametrize("n_tok", [3, 64])
def test_no_mask(ggml, n_tok):
    assert_same_bits(*run_both(ggml, n_tok=n_tok, n_kv=96, n_head=2, n_head_kv=2, dk=64, dv=64,
                               k_type="f16", v_type="f16", seed=13, masked=False))


@pytest.mark.parametrize("n_tok", [4, 64])
def test_logit_softcap(ggml, n_tok):
    """softcap * tanhf(s * scale / softcap), glibc's tanhf, then the mask (one_chunk and tiled)."""
    assert_same_bits(*run_both(ggml, n_tok=n_tok, n_kv=128, n_head=2, n_head_kv=1, dk=64, dv=64,
                               k_type="f16", v_type="f16", seed=17, softcap=0.5))
