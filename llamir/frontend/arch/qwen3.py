"""qwen3: the llama block with a per-head rms norm of q and k before NEOX rope, no biases
(src/models/qwen3.cpp)."""

from __future__ import annotations

from llamir.frontend.arch.base import FUSED_QKV, ROPE_NEOX, decoder_specs, register_arch
from llamir.frontend.arch.llama_family import LlamaFamily


@register_arch
class Qwen3(LlamaFamily):
    name = "qwen3"
    rope_type = ROPE_NEOX
    unimplemented_tensors = FUSED_QKV + ("cls_out.weight",)

    def tensor_specs(self, hp):
        return decoder_specs(hp, qk_norm=True)

    def rope_qk(self, g, L, il: int, q, k):
        q = g.norm(q, L.attn_q_norm, name=("Qcur_normed", il))   # per head
        k = g.norm(k, L.attn_k_norm, name=("Kcur_normed", il))
        return super().rope_qk(g, L, il, q, k)
