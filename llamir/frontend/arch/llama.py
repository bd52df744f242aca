"""llama (llama 2/3, mistral, SmolLM; GQA or MHA): NORM rope, as llama.cpp's src/models/llama.cpp."""

from __future__ import annotations

import math

from llamir.frontend.arch.base import FUSED_QKV, ROPE_NORM, ArchError, Architecture, decoder_specs, register_arch


@register_arch
class Llama(Architecture):
    name = "llama"
    rope_type = ROPE_NORM
    unimplemented_tensors = FUSED_QKV + ("blk.{il}.ffn_gate.bias", "blk.{il}.ffn_down.bias", "blk.{il}.ffn_up.bias",
                                         "rope_factors_long.weight", "rope_factors_short.weight")

    def load_hparams(self, f, hp) -> None:
        meta = f.metadata
        if meta.get_u32(f"{hp.arch}.vocab_size") is None:   # read (for the model type) only by llama
            meta.get_arr_n("tokenizer.ggml.tokens")
        super().load_hparams(f, hp)
        if hp.n_expert:
            raise ArchError(f"{f.path}: {hp.arch}.expert_count = {hp.n_expert}: llama.cpp reads this as a "
                            "mixture-of-experts llama, which llamir does not implement")
        if hp.n_rot != hp.n_embd_head_k:
            raise ArchError(f"invalid n_rot: {hp.n_rot}, expected {hp.n_embd_head_k}")

    def tensor_specs(self, hp):
        return decoder_specs(hp, out_bias=True, rope_freqs=hp.rope_scaling_type_train != "longrope")

    def kq_scale(self, hp) -> float:
        return hp.f_attention_scale or 1.0 / math.sqrt(hp.n_embd_head_v)

    def rope_qk(self, g, il: int, q, k):
        """Rotary embedding of q and k [T, H(kv), d]; llama 3 divides the angles by rope_freqs."""
        factors = g.w_opt("rope_freqs.weight")
        return (g.rope(q, self.rope_type, il, factors, name=("Qcur", il)),
                g.rope(k, self.rope_type, il, factors, name=("Kcur", il)))

    def build(self, g) -> None:
        hp, b = g.hp, g.b
        x = g.inp_embd()                                                               # [T, E]
        out_ids = g.inp_out_ids()                                                      # [n_out]
        for il in g.layers():
            p = f"blk.{il}."
            residual = x
            cur = g.norm(x, g.w(p + "attn_norm.weight"), name=("attn_norm", il))      # [T, E]
            q, k, v = g.qkv(il, cur)                                                   # [T, H(kv), d]
            q, k = self.rope_qk(g, il, q, k)
            cur = g.attn(il, q, k, v, g.w(p + "attn_output.weight"), g.w_opt(p + "attn_output.bias"),
                         self.kq_scale(hp))                                            # [T, E]
            if il == hp.n_layer - 1:  # only the rows that produce outputs go on
                cur = b.get_rows(cur, out_ids)                                        # [n_out, E]
                residual = b.get_rows(residual, out_ids)
            x = b.add(cur, residual, name=("ffn_inp", il))
            cur = g.norm(x, g.w(p + "ffn_norm.weight"), name=("ffn_norm", il))
            cur = g.ffn(cur, g.w(p + "ffn_up.weight"), g.w(p + "ffn_gate.weight"), g.w(p + "ffn_down.weight"),
                        act="silu", il=il)
            x = b.add(cur, x, name=("l_out", il))
        hidden = g.norm(x, g.w("output_norm.weight"))                                 # [n_out, E]
        g.finish(hidden, b.mul_mat(g.output_weight(), hidden))                        # [n_out, V]
