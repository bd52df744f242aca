"""gemma3: embeddings scaled by sqrt(n_embd), q/k rms norms, pre and post norms around attention
and the GELU-gated ffn, and interleaved sliding-window attention (5 local layers, then a
global one) with its own rope base (src/models/gemma3.cpp)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from llamir.frontend.arch.base import FUSED_QKV, decoder_specs, register_arch
from llamir.frontend.arch.gemma_family import GemmaFamily, query_scale
from llamir.frontend.hparams import ArchHParams


@dataclass(frozen=True)
class Gemma3HParams(ArchHParams):
    """gemma3's own hparams (hp.extra); the sliding-window layout is in HParams, the KV cache reads it."""

    final_logit_softcapping: float = 0.0   # 0: none
    rope_freq_base_swa: float = 10000.0    # the rope base of the sliding-window layers
    query_scale: float = 0.0               # q is scaled by this before attention


@register_arch
class Gemma3(GemmaFamily):
    name = "gemma3"
    unimplemented_tensors = FUSED_QKV + ("dense_2_out.weight", "dense_3_out.weight")
    synth_options = frozenset({"sliding_window", "swa_pattern"})

    def load_hparams(self, f, hp) -> None:
        """llama_model_gemma3::load_arch_hparams, with llama.cpp's key types (gguf_meta)."""
        meta, key, rope_base_swa = f.metadata, f"{hp.arch}.", 10000.0
        if hp.load_sliding_window(meta, n_pattern=6):
            rope_base_swa = meta.get_f32(key + "rope.freq_base_swa", rope_base_swa)
        softcap = meta.get_f32(key + "final_logit_softcapping", 0.0)
        super().load_hparams(f, hp)
        hp.extra = Gemma3HParams(final_logit_softcapping=softcap, rope_freq_base_swa=rope_base_swa,
                                 query_scale=query_scale(f, hp, n_layer_27b=62))

    def tensor_specs(self, hp):   # the embedding is drawn small: the graph scales it by sqrt(n_embd)
        return decoder_specs(hp, qk_norm=True, post_norms=True, embd_gain=1 / math.sqrt(hp.n_embd))

    def rope_qk(self, g, L, il: int, q, k):
        q = g.norm(q, L.attn_q_norm, name=("Qcur_normed", il))
        k = g.norm(k, L.attn_k_norm, name=("Kcur_normed", il))
        return super().rope_qk(g, L, il, q, k)

    def synth_metadata(self, w, spec) -> None:   # (synth writes the sliding-window keys after these)
        w.add_key_length(spec.n_embd_head)
        w.add_value_length(spec.n_embd_head)
