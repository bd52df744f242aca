"""gemma3: embeddings scaled by sqrt(n_embd), q/k rms norms, pre and post norms around attention
and the GELU-gated ffn, and interleaved sliding-window attention (5 local layers, then a
global one) with its own rope base (src/models/gemma3.cpp)."""

from __future__ import annotations

import math

from llamir.frontend.arch.base import (
    ROPE_NEOX,
    Architecture,
    TensorSpec,
    decoder_specs,
    register_arch,
)


@register_arch
class Gemma3(Architecture):
    name = "gemma3"
    rope_type = ROPE_NEOX

    def load_hparams(self, f, hp) -> None:
        super().load_hparams(f, hp)
        key = f"{hp.arch}."
        if hp.n_swa > 0:
            hp.swa_type = "standard"
            pattern = f.get(key + "attention.sliding_window_pattern", 6)
            if isinstance(pattern, (list, tuple)) or getattr(pattern, "ndim", 0):
                hp.swa_layers = tuple(bool(x) for x in pattern)
            else:
                hp.set_swa_pattern(int(pattern))
            hp.rope_freq_base_train_swa = float(f.get(key + "rope.freq_base_swa", 10000.0))
        hp.f_final_logit_softcapping = float(f.get(key + "final_logit_softcapping", 0.0))
        # gemma_pytorch: 27B scales by n_embd/n_head, the others by the head size
        hp.f_attention_scale = 1.0 / math.sqrt(hp.n_embd // hp.n_head() if hp.n_layer == 62 else hp.n_embd_head_k)

    def tensor_specs(self, hp):
        specs = decoder_specs(hp, qk_norm=True)
        for il in range(hp.n_layer):
            specs += [TensorSpec(f"blk.{il}.post_attention_norm.weight", (hp.n_embd,)),
                      TensorSpec(f"blk.{il}.post_ffw_norm.weight", (hp.n_embd,))]
        return specs

    def rope_freq_base(self, hp, rope, il: int) -> float:
        return hp.rope_freq_base_train_swa if hp.is_swa(il) else rope.freq_base

    def build(self, g) -> None:
        hp, b = g.hp, g.b
        x = g.inp_embd()                                                               # [T, E]
        if g.config.input_kind == "tokens":  # raw embeddings (e.g. images) are not rescaled
            x = b.scale(x, math.sqrt(hp.n_embd), name="inp_scaled")
        out_ids = g.inp_out_ids()
        for il in range(hp.n_layer):
            p = f"blk.{il}."
            cur = g.norm(x, g.w(p + "attn_norm.weight"), name=("attn_norm", il))
            q, k, v = g.qkv(il, cur)                                                   # [T, H(kv), d]
            q = g.norm(q, g.w(p + "attn_q_norm.weight"), name=("Qcur_normed", il))
            q = g.rope(q, self.rope_type, il, name=("Qcur", il))
            k = g.norm(k, g.w(p + "attn_k_norm.weight"), name=("Kcur_normed", il))
            k = g.rope(k, self.rope_type, il, name=("Kcur", il))
            q = b.scale(q, hp.f_attention_scale)
            cur = g.attn(il, q, k, v, g.w(p + "attn_output.weight"), None, 1.0)       # [T, E]
            if il == hp.n_layer - 1:
                cur = b.get_rows(cur, out_ids)
                x = b.get_rows(x, out_ids)
            cur = g.norm(cur, g.w(p + "post_attention_norm.weight"), name=("attn_post_norm", il))
            sa_out = b.add(cur, x, name=("sa_out", il))
            cur = g.norm(sa_out, g.w(p + "ffn_norm.weight"), name=("ffn_norm", il))
            cur = g.ffn(cur, g.w(p + "ffn_up.weight"), g.w(p + "ffn_gate.weight"), g.w(p + "ffn_down.weight"),
                        act="gelu", il=il)
            cur = g.norm(cur, g.w(p + "post_ffw_norm.weight"), name=("ffn_post_norm", il))
            x = b.add(cur, sa_out, name=("l_out", il))
        hidden = g.norm(x, g.w("output_norm.weight"))
        logits = b.mul_mat(g.output_weight(), hidden)                                 # [n_out, V]
        if hp.f_final_logit_softcapping:
            cap = hp.f_final_logit_softcapping
            logits = b.scale(b.unary("tanh", b.scale(logits, 1.0 / cap)), cap)
        g.finish(hidden, logits)
