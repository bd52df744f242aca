"""The graph side of attention memory: KV cache leaves, k/v stores (set_rows), reads over the
cached cells, and attention itself, laid out like llama.cpp's llama_kv_cache (cpy_k/cpy_v/
get_k/get_v), llm_graph_context::build_attn_mha and llama_kv_cache::build_graph_shift.

Layouts (numpy order): K cache [n_stream, kv_size, n_embd_k_gqa]; V cache the same, or, when
`v_trans` (no flash attention), transposed per stream: [n_stream, n_embd_v_gqa, kv_size].
A ubatch uses `ns` consecutive streams from `s0`, with T_s tokens each (T = ns * T_s); a unified
cache has one stream, so ns = 1, s0 = 0 and T_s = T. The runtime cells live in the context
layer, which fills the inputs declared here (attn_inp_k_idxs, attn_inp_v_idxs, attn_inp_kq_mask,
with a "_swa" suffix for the sliding-window cache of an iSWA model).

A quantized cache may be Hadamard-rotated (llama_kv_cache's attn_rot_k / attn_rot_v, decided by
the context layer and carried by KVLayout.rot_k / rot_v): q and k, v, and the attention output
go through mul_mat_hadamard where llm_graph_context::build_attn applies llama_mul_mat_hadamard.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llamir.frontend.built import InputSpec
from llamir.frontend.hparams import HParams
from llamir.ir import F16, F32, I32, I64, DType, GraphBuilder, Node, dims, ops
from llamir.ir.dims import Dim


@dataclass(frozen=True)
class KVLayout:
    """The shape of one KV cache as graphs see it."""

    kv_size: int
    type_k: DType = F16
    type_v: DType = F16
    v_trans: bool = True
    n_stream: int = 1
    layers: tuple[int, ...] = ()
    suffix: str = ""          # "" for the main cache, "_swa" for an iSWA model's window cache
    rot_k: int = 0            # Hadamard size q and k are rotated by (attn_rot_k), 0: none
    rot_v: int = 0            # the same for v and the attention output (attn_rot_v)

    def k_shape(self, hp: HParams, il: int) -> tuple[int, int, int]:
        return (self.n_stream, self.kv_size, hp.n_embd_k_gqa(il))

    def v_shape(self, hp: HParams, il: int) -> tuple[int, int, int]:
        if self.v_trans:
            return (self.n_stream, hp.n_embd_v_gqa(il), self.kv_size)
        return (self.n_stream, self.kv_size, hp.n_embd_v_gqa(il))

    @property
    def n_kv_dim(self) -> str:
        return "n_kv" + self.suffix


@dataclass(frozen=True)
class TokenDims:
    """How a ubatch's tokens are grouped: T = ns * T_s tokens over streams s0 .. s0+ns-1."""

    T: Dim
    T_s: Dim
    ns: Dim
    s0: Dim


def cache_k_name(il: int) -> str:
    return f"cache_k_l{il}"


def cache_v_name(il: int) -> str:
    return f"cache_v_l{il}"


def mul_mat_hadamard(b: GraphBuilder, x: Node, n: int) -> Node:
    """llama_mul_mat_hadamard(x, rot[n, n]): every run of n values of x times the orthonormal
    Walsh-Hadamard matrix, in the arithmetic of ggml's CPU backend. That mul_mat carries
    GGML_HINT_SRC0_IS_HADAMARD, so ggml_compute_forward_fwht runs instead of a matmul, never
    reading rot: each value is scaled by 1.0f/sqrtf(n), then butterflied (u + v, u - v) with the
    partner `len` away, len = 1, 2, 4, .., n/2 (the SIMD passes give the same single roundings)."""
    shape = x.shape
    if not isinstance(shape[-1], int) or shape[-1] % n:
        raise ValueError(f"a Hadamard rotation of size {n} needs rows that are a multiple of it, got {x.type}")
    rows = dims.div(dims.prod(shape), n)
    if x.is_op(ops.View, ops.Permute, ops.Transpose):
        cur = b.cont(x, rows, n)                                          # ggml_cont_2d
    else:
        cur = b.reshape(x, rows, n)                                       # ggml_reshape_2d: [R, n]
    cur = b.scale(cur, float(np.float32(1.0) / np.sqrt(np.float32(n))))
    half = 1
    while half < n:
        pairs = b.reshape(cur, rows, n // (2 * half), 2, half)            # [R, B, 2, len]
        strides = [n * 4, 2 * half * 4, 4]
        u = b.view(pairs, [rows, n // (2 * half), half], strides, 0)      # [R, B, len]
        v = b.view(pairs, [rows, n // (2 * half), half], strides, half * 4)
        total = b.reshape(b.add(u, v), rows, n // (2 * half), 1, half)
        diff = b.reshape(b.sub(u, v), rows, n // (2 * half), 1, half)
        cur = b.reshape(b.concat(total, diff, axis=2), rows, n)
        half *= 2
    return b.reshape(cur, *shape)                                         # ggml_reshape_4d


class AttentionGraph:
    """build_attn_mha for any source of k/v: per-stream q, permuted heads, softmax or flash."""

    def __init__(self, b: GraphBuilder, tokens: TokenDims, flash_attn: bool):
        self.b, self.tok, self.flash_attn = b, tokens, flash_attn

    def mha(self, il: int, q: Node, k: Node, v: Node, mask: Node, kq_scale: float, max_bias: float,
            softcap: float, v_trans: bool, kq_b: Node | None = None) -> Node:
        """q [T, H, d]; k [S, n, Hkv, d]; v [S, n, Hkv, dv] or (v_trans) [S, dv, Hkv, n] -> [T, H*dv].
        A position bias kq_b [H, T_s, n] is added to the scores before the softmax; flash
        attention takes no bias, so with one the softmax path runs (as llama.cpp's does)."""
        b, tok = self.b, self.tok
        n_head, d = q.shape[-2], q.shape[-1]
        q = b.reshape(q, tok.ns, tok.T_s, n_head, d)               # [S, T_s, H, d]
        q = b.permute(q, 0, 2, 1, 3)                                # [S, H, T_s, d]
        k = b.permute(k, 0, 2, 1, 3)                                # [S, Hkv, n, d]
        v = b.permute(v, 0, 2, 1, 3)                                # [S, Hkv, n, dv] or [S, Hkv, dv, n]
        if self.flash_attn and kq_b is None:
            if v_trans:
                v = b.transpose(v)                                  # [S, Hkv, n, dv]
            if k.dtype == F32:  # no cache: flash attention wants f16 k and v
                k = b.cast(k, F16)
            if v.dtype == F32:
                v = b.cast(v, F16)
            cur = b.flash_attn_ext(q, k, v, mask, kq_scale, max_bias, softcap, name=("__fattn__", il))
            return b.reshape(cur, tok.T, dims.mul(n_head, cur.shape[-1]), name=("kqv_out", il))
        kq = b.mul_mat(k, q, name=("kq", il))                       # [S, H, T_s, n]
        if softcap:
            kq = b.scale(b.unary("tanh", b.scale(kq, 1.0 / softcap)), softcap)
        if kq_b is not None:
            kq = b.add(kq, kq_b, name=("kq_plus_kq_b", il))          # [S, H, T_s, n]
        kq = b.soft_max_ext(kq, mask, kq_scale, max_bias, name=("kq_soft_max", il))
        if not v_trans:
            v = b.cont(b.transpose(v), name=("v_cont", il))          # [S, Hkv, dv, n]
        kqv = b.mul_mat(v, kq, name=("kqv", il))                     # [S, H, T_s, dv]
        cur = b.permute(kqv, 0, 2, 1, 3)                            # [S, T_s, H, dv]
        return b.cont(cur, tok.T, dims.mul(n_head, kqv.shape[-1]), name=("kqv_out", il))


class KVGraph(AttentionGraph):
    """The KV-cache part of one graph for one cache (the main one, or the SWA one)."""

    def __init__(self, b: GraphBuilder, hp: HParams, layout: KVLayout, tokens: TokenDims, n_kv: Dim,
                 flash_attn: bool, iswa: bool = False):
        super().__init__(b, tokens, flash_attn)
        self.hp, self.layout, self.n_kv = hp, layout, n_kv
        self.iswa = iswa          # build_attn for llm_graph_input_attn_kv_iswa (k rotated before v)
        self._inputs: dict[str, Node] = {}

    # -- inputs -------------------------------------------------------------------------------
    def _input(self, base: str, shape, dtype) -> Node:
        name = base + self.layout.suffix
        if name not in self._inputs:
            self._inputs[name] = self.b.input(name, shape, dtype)
        return self._inputs[name]

    def input_spec(self):
        """The attn_kv input of this cache, when the graph reads it (llm_graph_input_attn_kv)."""
        if not self._inputs:
            return None
        return InputSpec("attn_kv", tuple(self._inputs), {"suffix": self.layout.suffix})

    def k_idxs(self) -> Node:
        return self._input("attn_inp_k_idxs", [self.tok.T], I64)

    def v_idxs(self, n_embd_v_gqa: int) -> Node:
        n = dims.mul(self.tok.T, n_embd_v_gqa) if self.layout.v_trans else self.tok.T
        return self._input("attn_inp_v_idxs", [n], I64)

    def kq_mask(self) -> Node:
        """[ns, 1, T_s, n_kv]: 0 where a token may attend a cell, -inf elsewhere."""
        return self._input("attn_inp_kq_mask", [self.tok.ns, 1, self.tok.T_s, self.n_kv],
                           F16 if self.flash_attn else F32)

    # -- stores and reads -----------------------------------------------------------------------
    def _cache(self, name: str, shape: tuple[int, ...], dtype: DType) -> Node:
        for leaf in self.b.graph.leafs:
            if leaf.name == name:
                return leaf
        return self.b.state(name, shape, dtype)

    def cpy_k(self, il: int, k_cur: Node) -> Node:
        """Store k_cur [T, Hkv, d] into its cells; returns the updated cache rows [S*kv_size, gqa]."""
        lay, gqa = self.layout, self.hp.n_embd_k_gqa(il)
        cache = self._cache(cache_k_name(il), lay.k_shape(self.hp, il), lay.type_k)
        rows = self.b.reshape(cache, lay.n_stream * lay.kv_size, gqa)
        k_2d = self.b.reshape(k_cur, self.tok.T, gqa)
        return self.b.set_rows(rows, k_2d, self.k_idxs(), name=("k_stored", il))

    def cpy_v(self, il: int, v_cur: Node) -> Node:
        """Store v_cur [T, Hkv, dv]: whole rows, or (v_trans) one element per index."""
        lay, gqa = self.layout, self.hp.n_embd_v_gqa(il)
        cache = self._cache(cache_v_name(il), lay.v_shape(self.hp, il), lay.type_v)
        if not lay.v_trans:
            rows = self.b.reshape(cache, lay.n_stream * lay.kv_size, gqa)
            return self.b.set_rows(rows, self.b.reshape(v_cur, self.tok.T, gqa), self.v_idxs(gqa),
                                   name=("v_stored", il))
        elements = self.b.reshape(cache, lay.n_stream * gqa * lay.kv_size, 1)
        v_col = self.b.reshape(v_cur, dims.mul(self.tok.T, gqa), 1)
        return self.b.set_rows(elements, v_col, self.v_idxs(gqa), name=("v_stored", il))

    def get_k(self, il: int, stored: Node) -> Node:
        """[ns, n_kv, Hkv, d] view of the first n_kv cells of streams s0.. (get_k)."""
        hp, lay = self.hp, self.layout
        es, d, gqa = lay.type_k.type_size, hp.n_embd_head_k, hp.n_embd_k_gqa(il)
        row = lay.type_k.row_bytes(gqa)
        return self.b.view(stored, [self.tok.ns, self.n_kv, hp.n_head_kv(il), d],
                           [lay.kv_size * row, row, lay.type_k.row_bytes(d), es],
                           dims.mul(self.tok.s0, lay.kv_size * row), name=("k", il))

    def get_v(self, il: int, stored: Node) -> Node:
        """[ns, n_kv, Hkv, dv] rows, or transposed [ns, dv, Hkv, n_kv] (get_v)."""
        hp, lay = self.hp, self.layout
        es, d, gqa = lay.type_v.type_size, hp.n_embd_head_v, hp.n_embd_v_gqa(il)
        row = lay.type_v.row_bytes(gqa)
        stream = lay.kv_size * row
        if not lay.v_trans:
            return self.b.view(stored, [self.tok.ns, self.n_kv, hp.n_head_kv(il), d],
                               [stream, row, lay.type_v.row_bytes(d), es], dims.mul(self.tok.s0, stream),
                               name=("v", il))
        return self.b.view(stored, [self.tok.ns, d, hp.n_head_kv(il), self.n_kv],
                           [stream, lay.kv_size * es, lay.kv_size * d * es, es], dims.mul(self.tok.s0, stream),
                           name=("v", il))

    def attend(self, il: int, q: Node, k_cur: Node, v_cur: Node, kq_scale: float, max_bias: float = 0.0,
               softcap: float = 0.0, kq_b: Node | None = None) -> Node:
        """Store this ubatch's k/v, then attend q [T, H, d] over the cache -> [T, H*dv] (plus the
        position bias kq_b [H, T, n_kv], if any). A rotated cache gets q, k and v rotated first and
        the output rotated back, as build_attn does (in its expand order: q, v, k; q, k, v with the
        iSWA input)."""
        lay, b = self.layout, self.b
        if lay.rot_k:
            q = mul_mat_hadamard(b, q, lay.rot_k)
        if lay.rot_v and not self.iswa:
            v_cur = mul_mat_hadamard(b, v_cur, lay.rot_v)
        if lay.rot_k:
            k_cur = mul_mat_hadamard(b, k_cur, lay.rot_k)
        if lay.rot_v and self.iswa:
            v_cur = mul_mat_hadamard(b, v_cur, lay.rot_v)
        k = self.get_k(il, self.cpy_k(il, k_cur))
        v = self.get_v(il, self.cpy_v(il, v_cur))
        cur = self.mha(il, q, k, v, self.kq_mask(), kq_scale, max_bias, softcap, lay.v_trans, kq_b)
        return mul_mat_hadamard(b, cur, lay.rot_v) if lay.rot_v else cur


class NoCacheGraph(AttentionGraph):
    """Attention over the ubatch itself (encoders and embedding models): mask [1, 1, T, T]."""

    def __init__(self, b: GraphBuilder, tokens: TokenDims, flash_attn: bool, suffix: str = ""):
        super().__init__(b, tokens, flash_attn)
        self.suffix = suffix
        self._mask: Node | None = None

    def input_spec(self):
        """The attn_no_cache input, when the graph reads it (llm_graph_input_attn_no_cache)."""
        if self._mask is None:
            return None
        return InputSpec("attn_no_cache", (self._mask.name,), {"suffix": self.suffix})

    def kq_mask(self) -> Node:
        if self._mask is None:
            self._mask = self.b.input("attn_inp_kq_mask" + self.suffix, [1, 1, self.tok.T, self.tok.T],
                                      F16 if self.flash_attn else F32)
        return self._mask

    def attend(self, il: int, q: Node, k_cur: Node, v_cur: Node, kq_scale: float, max_bias: float = 0.0,
               softcap: float = 0.0, kq_b: Node | None = None) -> Node:
        k = self.b.reshape(k_cur, 1, *k_cur.shape)                   # [1, T, Hkv, d]
        v = self.b.reshape(v_cur, 1, *v_cur.shape)
        return self.mha(il, q, k, v, self.kq_mask(), kq_scale, max_bias, softcap, v_trans=False, kq_b=kq_b)


class CrossGraph(AttentionGraph):
    """Attention over the stored encoder output (an encoder-decoder's cross-attention,
    llm_graph_input_attn_cross): k/v [n_enc, Hkv, d] made from it, mask [1, 1, T, n_enc]."""

    def __init__(self, b: GraphBuilder, tokens: TokenDims, flash_attn: bool, n_enc: Dim):
        super().__init__(b, tokens, flash_attn)
        self.n_enc = n_enc
        self._mask: Node | None = None

    def input_spec(self):
        """The attn_cross input, when the graph reads it."""
        if self._mask is None:
            return None
        return InputSpec("attn_cross", (self._mask.name,))

    def kq_mask(self) -> Node:
        """0 where a token's sequences share one with the encoder token's, -inf elsewhere."""
        if self._mask is None:
            self._mask = self.b.input("cross_kq_mask", [1, 1, self.tok.T, self.n_enc],
                                      F16 if self.flash_attn else F32)
        return self._mask

    def attend(self, il: int, q: Node, k_enc: Node, v_enc: Node, kq_scale: float) -> Node:
        """q [T, H, d] over k/v [n_enc, Hkv, d] -> [T, H*dv]."""
        k = self.b.reshape(k_enc, 1, *k_enc.shape)                   # [1, n_enc, Hkv, d]
        v = self.b.reshape(v_enc, 1, *v_enc.shape)
        return self.mha(il, q, k, v, self.kq_mask(), kq_scale, 0.0, 0.0, v_trans=False)


def build_shift_graph(hp: HParams, layout: KVLayout, rope_mode: int, rope, freq_base_of, name: str = "k_shift"):
    """llama_kv_cache::build_graph_shift: re-rope every cached K row by its cell's accumulated
    shift (input "k_shift" i32 [n_stream*kv_size]); written back in place through set_rows. A
    quantized K goes through f32, and a rotated one is rotated back before the rope and forward
    after it (build_rope_shift; the Hadamard matrix is its own inverse)."""
    b = GraphBuilder(name)
    n_rows = layout.n_stream * layout.kv_size
    shift = b.input("k_shift", [n_rows], I32)
    rows = b.input("k_shift_rows", [n_rows], I64)  # 0..n_rows-1: every row is written back
    for il in layout.layers:
        cache = b.state(cache_k_name(il), layout.k_shape(hp, il), layout.type_k)
        k = b.reshape(cache, n_rows, hp.n_head_kv(il), hp.n_embd_head_k)              # [S*kv, Hkv, d]
        k32 = k if layout.type_k in (F16, F32) else b.cast(k, F32)                   # quantized: via f32
        if layout.rot_k:
            k32 = mul_mat_hadamard(b, k32, layout.rot_k)
        roped = b.rope_ext(k32, shift, n_dims=hp.n_rot, mode=rope_mode, n_ctx_orig=rope.n_ctx_orig,
                           freq_base=freq_base_of(il), freq_scale=rope.freq_scale, ext_factor=rope.ext_factor,
                           attn_factor=rope.attn_factor, beta_fast=rope.beta_fast, beta_slow=rope.beta_slow,
                           name=("k_shifted", il))
        if layout.rot_k:
            roped = mul_mat_hadamard(b, roped, layout.rot_k)
        out = b.set_rows(b.reshape(cache, n_rows, hp.n_embd_k_gqa(il)),
                         b.reshape(roped, n_rows, hp.n_embd_k_gqa(il)), rows)
        b.output(f"k_l{il}", out)
    return b.graph
