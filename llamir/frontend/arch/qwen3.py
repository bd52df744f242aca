"""qwen3: the llama block with a per-head rms norm of q and k before NEOX rope, no biases
(src/models/qwen3.cpp)."""

from __future__ import annotations

import math

from llamir.frontend.arch.base import FUSED_QKV, ROPE_NEOX, Architecture, decoder_specs, register_arch
from llamir.frontend.arch.llama import Llama


@register_arch
class Qwen3(Llama):
    name = "qwen3"
    rope_type = ROPE_NEOX
    unimplemented_tensors = FUSED_QKV + ("cls_out.weight",)

    def load_hparams(self, f, hp) -> None:
        Architecture.load_hparams(self, f, hp)   # the rms eps, without llama's n_rot check

    def tensor_specs(self, hp):
        return decoder_specs(hp, qk_norm=True)

    def kq_scale(self, hp) -> float:
        return 1.0 / math.sqrt(hp.n_embd_head_v)

    def rope_qk(self, g, il: int, q, k):
        p = f"blk.{il}."
        q = g.norm(q, g.w(p + "attn_q_norm.weight"), name=("Qcur_normed", il))   # per head
        k = g.norm(k, g.w(p + "attn_k_norm.weight"), name=("Kcur_normed", il))
        return (g.rope(q, self.rope_type, il, name=("Qcur", il)),
                g.rope(k, self.rope_type, il, name=("Kcur", il)))
