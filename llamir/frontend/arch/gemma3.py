"""gemma3: embeddings scaled by sqrt(n_embd), q/k rms norms, pre and post norms around attention
and the GELU-gated ffn, and interleaved sliding-window attention (5 local layers, then a
global one) with its own rope base (src/models/gemma3.cpp)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from llamir.frontend.arch.base import FUSED_QKV, ROPE_NEOX, ArchError, Architecture, decoder_specs, register_arch
from llamir.frontend.hparams import ArchHParams


@dataclass(frozen=True)
class Gemma3HParams(ArchHParams):
    """gemma3's own hparams (hp.extra); the sliding-window layout is in HParams, the KV cache reads it."""

    final_logit_softcapping: float = 0.0   # 0: none
    rope_freq_base_swa: float = 10000.0    # the rope base of the sliding-window layers
    query_scale: float = 0.0               # q is scaled by this before attention


@register_arch
class Gemma3(Architecture):
    name = "gemma3"
    rope_type = ROPE_NEOX
    unimplemented_tensors = FUSED_QKV + ("dense_2_out.weight", "dense_3_out.weight")
    synth_options = frozenset({"sliding_window", "swa_pattern"})

    def load_hparams(self, f, hp) -> None:
        """llama_model_gemma3::load_arch_hparams, with llama.cpp's key types (gguf_meta)."""
        meta, key, rope_base_swa = f.metadata, f"{hp.arch}.", 10000.0
        if hp.load_sliding_window(meta, n_pattern=6):
            rope_base_swa = meta.get_f32(key + "rope.freq_base_swa", rope_base_swa)
        softcap = meta.get_f32(key + "final_logit_softcapping", 0.0)
        super().load_hparams(f, hp)
        # gemma_pytorch: 27B scales by n_embd/n_head, the others by the head size (in f32, as llama.cpp)
        if hp.n_layer == 62 and not hp.n_head():
            raise ArchError(f"{f.path}: gemma3 27B scales attention by n_embd/n_head, but n_head is 0")
        n = hp.n_embd // hp.n_head() if hp.n_layer == 62 else hp.n_embd_head_k
        with np.errstate(divide="ignore"):   # a head size of 0 scales by inf, as in llama.cpp
            scale = float(np.float32(1.0) / np.sqrt(np.float32(n)))
        hp.extra = Gemma3HParams(final_logit_softcapping=softcap, rope_freq_base_swa=rope_base_swa, query_scale=scale)

    def tensor_specs(self, hp):   # the embedding is drawn small: the graph scales it by sqrt(n_embd)
        return decoder_specs(hp, qk_norm=True, post_norms=True, embd_gain=1 / math.sqrt(hp.n_embd))

    def rope_freq_base(self, hp, rope, il: int) -> float:
        return hp.extra.rope_freq_base_swa if hp.is_swa(il) else rope.freq_base

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
            q = g.rope(g.norm(q, L.attn_q_norm, name=("Qcur_normed", il)), self.rope_type, il, name=("Qcur", il))
            k = g.rope(g.norm(k, L.attn_k_norm, name=("Kcur_normed", il)), self.rope_type, il, name=("Kcur", il))
            cur = g.attn(il, b.scale(q, extra.query_scale), k, v, L.attn_output, None, 1.0)   # [T, E]
            if il == hp.n_layer - 1:
                cur, x = b.get_rows(cur, out_ids), b.get_rows(x, out_ids)
            sa_out = b.add(g.norm(cur, L.post_attention_norm, name=("attn_post_norm", il)), x, name=("sa_out", il))
            cur = g.ffn(g.norm(sa_out, L.ffn_norm, name=("ffn_norm", il)), L.ffn_up, L.ffn_gate, L.ffn_down,
                        act="gelu", il=il)
            x = b.add(g.norm(cur, L.post_ffw_norm, name=("ffn_post_norm", il)), sa_out, name=("l_out", il))
        hidden = g.norm(x, g.weights.output_norm)
        logits = b.mul_mat(g.output_weight(), hidden)                                 # [n_out, V]
        if cap := extra.final_logit_softcapping:
            logits = b.scale(b.unary("tanh", b.scale(logits, 1.0 / cap)), cap)
        g.finish(hidden, logits)

    def synth_metadata(self, w, spec) -> None:   # (synth writes the sliding-window keys after these)
        w.add_key_length(spec.n_embd_head)
        w.add_value_length(spec.n_embd_head)
