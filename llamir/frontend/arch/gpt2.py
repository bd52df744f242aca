"""gpt2: learned absolute positions added to the token embeddings, the LayerNorm block with a fused
q/k/v projection and no rope (src/models/gpt2.cpp)."""

from __future__ import annotations

from llamir.frontend.arch.base import ROPE_NONE, register_arch
from llamir.frontend.arch.layernorm_family import LayerNormFamily, layernorm_specs


@register_arch
class Gpt2(LayerNormFamily):
    name = "gpt2"
    rope_type = ROPE_NONE

    def tensor_specs(self, hp):
        return layernorm_specs(hp, fused_qkv=True, pos_embd=True)

    def embed(self, g):
        return g.inp_pos_embd(g.inp_embd(), g.weights.position_embd)                 # [T, E]

    def qkv(self, g, L, il: int, x):
        return g.qkv_fused(il, x, L.attn_qkv, L.attn_qkv_bias)

    def synth_check(self, spec) -> None:
        if spec.n_embd_head * spec.n_head != spec.n_embd:
            # llama.cpp's gpt2 loader shapes attn_output as {n_embd, n_embd}
            raise ValueError(f"gpt2 needs head_dim * n_head == n_embd, got {spec.n_embd_head}*{spec.n_head}")
