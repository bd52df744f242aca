"""gemma2: the gemma block (embeddings scaled by sqrt(n_embd), pre and post norms around attention
and the GELU-gated ffn) with attention-logit and final-logit softcapping, every other layer a
sliding window, and the output tied to the token embedding (src/models/gemma2-iswa.cpp)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from llamir.frontend.arch.base import FUSED_QKV, ArchError, decoder_specs, register_arch
from llamir.frontend.arch.gemma_family import GemmaFamily, query_scale
from llamir.frontend.hparams import ArchHParams


@dataclass(frozen=True)
class Gemma2HParams(ArchHParams):
    """gemma2's own hparams (hp.extra); the attention softcap is hp.f_attn_logit_softcapping."""

    final_logit_softcapping: float = 30.0   # the logits are always capped
    rope_freq_base_swa: float = 10000.0     # the rope base of the sliding-window layers
    query_scale: float = 0.0                # q is scaled by this before attention


@register_arch
class Gemma2(GemmaFamily):
    name = "gemma2"
    unimplemented_tensors = FUSED_QKV
    synth_options = frozenset({"sliding_window", "swa_pattern"})
    # what synth writes: caps that bend a synthetic model's scores (std ~2) and logits (std ~2)
    SYNTH_CAPS = {"attn_logit_softcapping": 4.0, "final_logit_softcapping": 6.0}

    def load_hparams(self, f, hp) -> None:
        """llama_model_gemma2::load_arch_hparams: a window of 4096 unless given, on layers 0, 2, 4...
        unless a pattern is given; the softcaps default to 50 (attention) and 30 (logits)."""
        meta, key = f.metadata, f"{hp.arch}."
        hp.swa_type = "standard"
        hp.load_swa_pattern(meta, key + "attention.sliding_window_pattern", 2)
        rope_base_swa = meta.get_f32(key + "rope.freq_base_swa", hp.rope_freq_base_train)
        hp.n_swa = meta.get_u32(key + "attention.sliding_window", 4096)
        super().load_hparams(f, hp)
        hp.f_attn_logit_softcapping = meta.get_f32(key + "attn_logit_softcapping", 50.0)
        final = meta.get_f32(key + "final_logit_softcapping", 30.0)
        for name, cap in (("attn_logit_softcapping", hp.f_attn_logit_softcapping), ("final_logit_softcapping", final)):
            # llama.cpp divides by the cap (NaN or all-zero results), and flash attention reads 0 as no cap
            if not cap > 0.0:
                raise ArchError(f"{f.path}: {key}{name} = {cap}: gemma2 always softcaps, it needs a cap > 0")
        if not hp.n_swa:   # a standard window of 0 masks every key, its own too: llama.cpp gives NaN logits
            raise ArchError(f"{f.path}: {key}attention.sliding_window = 0: the window must hold a token")
        hp.extra = Gemma2HParams(final_logit_softcapping=final, rope_freq_base_swa=rope_base_swa,
                                 query_scale=query_scale(f, hp, n_layer_27b=46))

    def tensor_specs(self, hp):   # the embedding is drawn small: the graph scales it by sqrt(n_embd)
        specs = decoder_specs(hp, post_norms=True, embd_gain=2 / math.sqrt(hp.n_embd))
        return [s for s in specs if s.name != "output.weight"]   # llama.cpp always ties the output

    def output_weight(self, g):
        return g.weights.token_embd

    def synth_metadata(self, w, spec) -> None:
        for name, cap in self.SYNTH_CAPS.items():
            w.add_float32(f"{spec.arch}.{name}", cap)
