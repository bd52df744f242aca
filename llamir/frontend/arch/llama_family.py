"""The decoder block llama, qwen2 and qwen3 share (src/models/llama.cpp, qwen2.cpp, qwen3.cpp):
pre-norm attention and a SiLU-gated ffn around residuals. Each architecture says what it does
differently: its rope type, how q and k are normed and rotated, the score scale and its tensors."""

from __future__ import annotations

import math
from typing import ClassVar

from llamir.frontend.arch.base import Architecture


class LlamaFamily(Architecture):
    """The llama block; subclasses set name, rope_type and tensor_specs, and override the hooks."""

    ffn_act: ClassVar[str] = "silu"
    out_bias: ClassVar[bool] = False   # whether the specs declare blk.N.attn_output.bias (optional)
    moe_norm_w: ClassVar[bool] = True  # whether the selected experts' weights are renormalised to sum 1

    def kq_scale(self, hp) -> float:
        return 1.0 / math.sqrt(hp.n_embd_head_v)

    def rope_qk(self, g, L, il: int, q, k):
        """Rotary embedding of q and k [T, H(kv), d], given the block's weights L."""
        return (g.rope(q, self.rope_type, il, name=("Qcur", il)),
                g.rope(k, self.rope_type, il, name=("Kcur", il)))

    def ffn_block(self, g, L, il: int, cur):
        """The block's ffn on the normed input [T, E]: dense, or the experts when the model has them."""
        if not g.hp.n_expert:
            return g.ffn(cur, L.ffn_up, L.ffn_gate, L.ffn_down, act=self.ffn_act, il=il)
        return g.moe_ffn(cur, L.ffn_gate_inp, L.ffn_up_exps, L.ffn_gate_exps, L.ffn_down_exps, g.hp.n_expert_used,
                         act=self.ffn_act, norm_w=self.moe_norm_w, il=il)

    def build(self, g) -> None:
        hp, b, W = g.hp, g.b, g.weights
        x = g.inp_embd()                                                               # [T, E]
        out_ids = g.inp_out_ids()                                                      # [n_out]
        for il in g.layers():
            L = g.layer_weights(il)
            residual = x
            cur = g.norm(x, L.attn_norm, name=("attn_norm", il))                      # [T, E]
            q, k, v = g.qkv(il, cur)                                                   # [T, H(kv), d]
            q, k = self.rope_qk(g, L, il, q, k)
            wo, wo_b = L.attn_output, L.attn_output_bias if self.out_bias else None
            cur = g.attn(il, q, k, v, wo, wo_b, self.kq_scale(hp))                     # [T, E]
            if il == hp.n_layer - 1:  # only the rows that produce outputs go on
                cur = b.get_rows(cur, out_ids)                                        # [n_out, E]
                residual = b.get_rows(residual, out_ids)
            x = b.add(cur, residual, name=("ffn_inp", il))
            cur = g.norm(x, L.ffn_norm, name=("ffn_norm", il))
            cur = self.ffn_block(g, L, il, cur)
            x = g.cvec(b.add(cur, x), il, name=("l_out", il))
        hidden = g.norm(x, W.output_norm)                                             # [n_out, E]
        g.finish(hidden, g.linear(g.output_weight(), hidden))                         # [n_out, V]


__all__ = ["LlamaFamily"]
