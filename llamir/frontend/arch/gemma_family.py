"""The gemma block gemma2 and gemma3 share (src/models/gemma2.cpp, gemma3.cpp): embeddings scaled by
sqrt(n_embd), RMS pre and post norms around attention and the GELU-gated ffn, q scaled before
attention (kq_scale 1), NEOX rope and an optional final-logit softcap."""

from __future__ import annotations

import math

import numpy as np

from llamir.frontend.arch.base import ROPE_NEOX, ArchError, Architecture


def query_scale(f, hp, n_layer_27b: int) -> float:
    """f_attention_scale: gemma_pytorch's 27B (the model with n_layer_27b blocks) scales q by
    1/sqrt(n_embd/n_head), the others by 1/sqrt(head size); in f32, as llama.cpp."""
    if hp.n_layer == n_layer_27b and not hp.n_head():
        raise ArchError(f"{f.path}: {hp.arch} 27B scales attention by n_embd/n_head, but n_head is 0")
    n = hp.n_embd // hp.n_head() if hp.n_layer == n_layer_27b else hp.n_embd_head_k
    with np.errstate(divide="ignore"):   # a head size of 0 scales by inf, as in llama.cpp
        return float(np.float32(1.0) / np.sqrt(np.float32(n)))


class GemmaFamily(Architecture):
    """The block; subclasses say what differs: `rope_qk` (gemma3's q/k norms) and `output_weight`.
    hp.extra has `query_scale`, `final_logit_softcapping` (0: none) and `rope_freq_base_swa`."""

    rope_type = ROPE_NEOX

    def rope_freq_base(self, hp, rope, il: int) -> float:
        return hp.extra.rope_freq_base_swa if hp.is_swa(il) else rope.freq_base

    def rope_qk(self, g, L, il: int, q, k):
        return (g.rope(q, self.rope_type, il, name=("Qcur", il)), g.rope(k, self.rope_type, il, name=("Kcur", il)))

    def output_weight(self, g):
        return g.output_weight()

    def build(self, g) -> None:
        hp, b, extra = g.hp, g.b, g.hp.extra
        x = g.inp_embd()                                                               # [T, E]
        if g.config.input_kind == "tokens":  # raw embeddings (e.g. images) are not rescaled
            x = b.scale(x, math.sqrt(hp.n_embd), name="inp_scaled")
        out_ids = g.inp_out_ids()
        for il in g.layers():
            L = g.layer_weights(il)
            cur = g.norm(x, L.attn_norm, name=("attn_norm", il))
            q, k, v = g.qkv(il, cur)                                                   # [T, H(kv), d]
            q, k = self.rope_qk(g, L, il, q, k)
            cur = g.attn(il, b.scale(q, extra.query_scale), k, v, L.attn_output, None, 1.0)   # [T, E]
            if il == hp.n_layer - 1:
                cur, x = b.get_rows(cur, out_ids), b.get_rows(x, out_ids)
            sa_out = b.add(g.norm(cur, L.post_attention_norm, name=("attn_post_norm", il)), x, name=("sa_out", il))
            cur = g.ffn(g.norm(sa_out, L.ffn_norm, name=("ffn_norm", il)), L.ffn_up, L.ffn_gate, L.ffn_down,
                        act="gelu", il=il)
            x = g.cvec(b.add(g.norm(cur, L.post_ffw_norm, name=("ffn_post_norm", il)), sa_out), il,
                       name=("l_out", il))
        hidden = g.norm(x, g.weights.output_norm)
        logits = g.linear(self.output_weight(g), hidden)                              # [n_out, V]
        if cap := extra.final_logit_softcapping:
            logits = g.softcap(logits, cap)
        g.finish(hidden, logits)
