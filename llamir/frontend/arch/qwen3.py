"""qwen3: per-head rms norm of q and k before NEOX rope, no biases (src/models/qwen3.cpp)."""

from __future__ import annotations

import math

from llamir.frontend.arch.base import ROPE_NEOX, Architecture, decoder_specs, register_arch, require_rms_eps


@register_arch
class Qwen3(Architecture):
    name = "qwen3"
    rope_type = ROPE_NEOX

    def load_hparams(self, f, hp) -> None:
        require_rms_eps(f, hp)

    def tensor_specs(self, hp):
        return decoder_specs(hp, qk_norm=True)

    def build(self, g) -> None:
        hp, b = g.hp, g.b
        kq_scale = 1.0 / math.sqrt(hp.n_embd_head_v)
        x = g.inp_embd()                                                               # [T, E]
        out_ids = g.inp_out_ids()
        for il in range(hp.n_layer):
            p = f"blk.{il}."
            residual = x
            cur = g.norm(x, g.w(p + "attn_norm.weight"), name=("attn_norm", il))
            q, k, v = g.qkv(il, cur)                                                   # [T, H(kv), d]
            q = g.norm(q, g.w(p + "attn_q_norm.weight"), name=("Qcur_normed", il))   # per head
            q = g.rope(q, self.rope_type, il, name=("Qcur", il))
            k = g.norm(k, g.w(p + "attn_k_norm.weight"), name=("Kcur_normed", il))
            k = g.rope(k, self.rope_type, il, name=("Kcur", il))
            cur = g.attn(il, q, k, v, g.w(p + "attn_output.weight"), None, kq_scale)  # [T, E]
            if il == hp.n_layer - 1:
                cur = b.get_rows(cur, out_ids)
                residual = b.get_rows(residual, out_ids)
            x = b.add(cur, residual, name=("ffn_inp", il))
            cur = g.norm(x, g.w(p + "ffn_norm.weight"), name=("ffn_norm", il))
            cur = g.ffn(cur, g.w(p + "ffn_up.weight"), g.w(p + "ffn_gate.weight"), g.w(p + "ffn_down.weight"),
                        act="silu", il=il)
            x = b.add(cur, x, name=("l_out", il))
        hidden = g.norm(x, g.w("output_norm.weight"))
        g.finish(hidden, b.mul_mat(g.output_weight(), hidden))
