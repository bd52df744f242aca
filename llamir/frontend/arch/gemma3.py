"""gemma3: embeddings scaled by sqrt(n_embd), q/k rms norms, pre and post norms around attention
and the GELU-gated ffn, and interleaved sliding-window attention (5 local layers, then a
global one) with its own rope base (src/models/gemma3.cpp)."""

from __future__ import annotations

import math

import numpy as np

from llamir.frontend.arch.base import (
    FUSED_QKV,
    ROPE_NEOX,
    ArchError,
    Architecture,
    TensorSpec,
    decoder_specs,
    register_arch,
)


@register_arch
class Gemma3(Architecture):
    name = "gemma3"
    rope_type = ROPE_NEOX
    unimplemented_tensors = FUSED_QKV + ("dense_2_out.weight", "dense_3_out.weight")

    def load_hparams(self, f, hp) -> None:
        """llama_model_gemma3::load_arch_hparams, with llama.cpp's key types (gguf_meta)."""
        meta, key = f.metadata, f"{hp.arch}."
        n_swa = meta.get_u32(key + "attention.sliding_window")
        if n_swa:
            hp.n_swa, hp.swa_type = n_swa, "standard"
            self._load_swa_pattern(meta, hp, key + "attention.sliding_window_pattern", 6)
            hp.rope_freq_base_train_swa = meta.get_f32(key + "rope.freq_base_swa", hp.rope_freq_base_train_swa)
        hp.f_final_logit_softcapping = meta.get_f32(key + "final_logit_softcapping", 0.0)
        super().load_hparams(f, hp)
        # gemma_pytorch: 27B scales by n_embd/n_head, the others by the head size (in f32, as llama.cpp)
        if hp.n_layer == 62 and not hp.n_head():
            raise ArchError(f"{f.path}: gemma3 27B scales attention by n_embd/n_head, but n_head is 0")
        n = hp.n_embd // hp.n_head() if hp.n_layer == 62 else hp.n_embd_head_k
        with np.errstate(divide="ignore"):   # a head size of 0 scales by inf, as in llama.cpp
            hp.f_attention_scale = float(np.float32(1.0) / np.sqrt(np.float32(n)))

    @staticmethod
    def _load_swa_pattern(meta, hp, key: str, n_pattern: int) -> None:
        """load_swa_pattern: a per-layer array (layers past its end are dense), or a u32 period."""
        layers = meta.get_u32_arr(key)
        if layers is not None:
            hp.swa_layers = tuple(bool(x) for x in layers[:hp.n_layer]) + (False,) * (hp.n_layer - len(layers))
        else:
            hp.set_swa_pattern(meta.get_u32(key, n_pattern))

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
        for il in g.layers():
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
