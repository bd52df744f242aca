"""The graph side of the KV cache: cache leaves, k/v stores (set_rows) and attention over the
cached cells, laid out exactly like llama.cpp's llama_kv_cache (cpy_k/cpy_v/get_k/get_v) and
llm_graph_context::build_attn_mha.

Layouts (numpy order): K cache [n_stream, kv_size, n_embd_k_gqa]; V cache the same, or, when
`v_trans` (no flash attention), transposed per stream: [n_stream, n_embd_v_gqa, kv_size].
The runtime cells (which slot holds which position) live in the context layer, which fills the
inputs this module declares: attn_inp_k_idxs, attn_inp_v_idxs (i64) and attn_inp_kq_mask.
"""

from __future__ import annotations

from dataclasses import dataclass

from llamir.frontend.hparams import HParams
from llamir.ir import F16, F32, I64, DType, GraphBuilder, Node, dims
from llamir.ir.dims import Dim


@dataclass(frozen=True)
class KVLayout:
    """The shape of a KV cache as graphs see it."""

    kv_size: int
    type_k: DType = F16
    type_v: DType = F16
    v_trans: bool = True
    n_stream: int = 1
    layers: tuple[int, ...] = ()

    def k_shape(self, hp: HParams, il: int) -> tuple[int, int, int]:
        return (self.n_stream, self.kv_size, hp.n_embd_k_gqa(il))

    def v_shape(self, hp: HParams, il: int) -> tuple[int, int, int]:
        if self.v_trans:
            return (self.n_stream, hp.n_embd_v_gqa(il), self.kv_size)
        return (self.n_stream, self.kv_size, hp.n_embd_v_gqa(il))


def cache_k_name(il: int) -> str:
    return f"cache_k_l{il}"


def cache_v_name(il: int) -> str:
    return f"cache_v_l{il}"


class KVGraph:
    """Builds the KV-cache part of one graph (single stream: every token in one ubatch group)."""

    def __init__(self, b: GraphBuilder, hp: HParams, layout: KVLayout, n_tokens: Dim, n_kv: Dim,
                 flash_attn: bool):
        if layout.n_stream != 1:
            raise NotImplementedError("multi-stream KV graphs are built by the context layer's stream split")
        self.b, self.hp, self.layout = b, hp, layout
        self.T, self.n_kv = n_tokens, n_kv
        self.flash_attn = flash_attn
        self._k_idxs: Node | None = None
        self._v_idxs: Node | None = None
        self._mask: Node | None = None

    # -- inputs -------------------------------------------------------------------------------
    def k_idxs(self) -> Node:
        if self._k_idxs is None:
            self._k_idxs = self.b.input("attn_inp_k_idxs", [self.T], I64)
        return self._k_idxs

    def v_idxs(self, n_embd_v_gqa: int) -> Node:
        if self._v_idxs is None:
            n = dims.mul(self.T, n_embd_v_gqa) if self.layout.v_trans else self.T
            self._v_idxs = self.b.input("attn_inp_v_idxs", [n], I64)
        return self._v_idxs

    def kq_mask(self) -> Node:
        """[n_stream, 1, T, n_kv]: 0 where a token may attend a cell, -inf elsewhere."""
        if self._mask is None:
            dtype = F16 if self.flash_attn else F32
            self._mask = self.b.input("attn_inp_kq_mask", [1, 1, self.T, self.n_kv], dtype)
        return self._mask

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
        k_2d = self.b.reshape(k_cur, self.T, gqa)
        return self.b.set_rows(rows, k_2d, self.k_idxs(), name=("k_stored", il))

    def cpy_v(self, il: int, v_cur: Node) -> Node:
        """Store v_cur [T, Hkv, dv]: whole rows, or (v_trans) one element per index."""
        lay, gqa = self.layout, self.hp.n_embd_v_gqa(il)
        cache = self._cache(cache_v_name(il), lay.v_shape(self.hp, il), lay.type_v)
        if not lay.v_trans:
            rows = self.b.reshape(cache, lay.n_stream * lay.kv_size, gqa)
            return self.b.set_rows(rows, self.b.reshape(v_cur, self.T, gqa), self.v_idxs(gqa),
                                   name=("v_stored", il))
        elements = self.b.reshape(cache, lay.n_stream * gqa * lay.kv_size, 1)
        v_col = self.b.reshape(v_cur, dims.mul(self.T, gqa), 1)
        return self.b.set_rows(elements, v_col, self.v_idxs(gqa), name=("v_stored", il))

    def get_k(self, il: int, stored: Node) -> Node:
        """[S, n_kv, Hkv, d] view of the first n_kv cells (llama_kv_cache::get_k)."""
        hp, lay = self.hp, self.layout
        es, d, gqa = lay.type_k.type_size, hp.n_embd_head_k, hp.n_embd_k_gqa(il)
        return self.b.view(stored, [lay.n_stream, self.n_kv, hp.n_head_kv(il), d],
                           [lay.kv_size * gqa * es, gqa * es, d * es, es], 0, name=("k", il))

    def get_v(self, il: int, stored: Node) -> Node:
        """[S, n_kv, Hkv, dv] rows, or transposed [S, dv, Hkv, n_kv] (llama_kv_cache::get_v)."""
        hp, lay = self.hp, self.layout
        es, d, gqa = lay.type_v.type_size, hp.n_embd_head_v, hp.n_embd_v_gqa(il)
        if not lay.v_trans:
            return self.b.view(stored, [lay.n_stream, self.n_kv, hp.n_head_kv(il), d],
                               [lay.kv_size * gqa * es, gqa * es, d * es, es], 0, name=("v", il))
        return self.b.view(stored, [lay.n_stream, d, hp.n_head_kv(il), self.n_kv],
                           [lay.kv_size * gqa * es, lay.kv_size * es, lay.kv_size * d * es, es], 0,
                           name=("v", il))

    # -- attention ------------------------------------------------------------------------------
    def attend(self, il: int, q: Node, k_cur: Node, v_cur: Node, kq_scale: float, max_bias: float = 0.0,
               softcap: float = 0.0) -> Node:
        """Store this ubatch's k/v, then attend q [T, H, d] over the cache -> [T, H*dv]."""
        k = self.get_k(il, self.cpy_k(il, k_cur))
        v = self.get_v(il, self.cpy_v(il, v_cur))
        return self.mha(il, q, k, v, self.kq_mask(), kq_scale, max_bias, softcap)

    def mha(self, il: int, q: Node, k: Node, v: Node, mask: Node, kq_scale: float, max_bias: float,
            softcap: float) -> Node:
        """build_attn_mha: per-stream q, permuted heads, soft_max or flash attention."""
        b, hp = self.b, self.hp
        n_head, d = q.shape[-2], q.shape[-1]
        v_trans = self.layout.v_trans
        q = b.reshape(q, 1, self.T, n_head, d)                      # [S, T, H, d]
        q = b.permute(q, 0, 2, 1, 3)                                # [S, H, T, d]
        k = b.permute(k, 0, 2, 1, 3)                                # [S, Hkv, n_kv, d]
        v = b.permute(v, 0, 2, 1, 3)                                # [S, Hkv, n_kv, dv] or [S, Hkv, dv, n_kv]
        if self.flash_attn:
            if v_trans:
                v = b.transpose(v)                                  # [S, Hkv, n_kv, dv]
            cur = b.flash_attn_ext(q, k, v, mask, kq_scale, max_bias, softcap, name=("__fattn__", il))
            dv = cur.shape[-1]
            return b.reshape(cur, self.T, dims.mul(n_head, dv), name=("kqv_out", il))  # [T, H*dv]
        kq = b.mul_mat(k, q, name=("kq", il))                       # [S, H, T, n_kv]
        if softcap:
            kq = b.scale(b.unary("tanh", b.scale(kq, 1.0 / softcap)), softcap)
        kq = b.soft_max_ext(kq, mask, kq_scale, max_bias, name=("kq_soft_max", il))
        if not v_trans:
            v = b.cont(b.transpose(v), name=("v_cont", il))          # [S, Hkv, dv, n_kv]
        kqv = b.mul_mat(v, kq, name=("kqv", il))                     # [S, H, T, dv]
        cur = b.permute(kqv, 0, 2, 1, 3)                            # [S, T, H, dv]
        dv = kqv.shape[-1]
        return b.cont(cur, self.T, dims.mul(n_head, dv), name=("kqv_out", il))   # [T, H*dv]
