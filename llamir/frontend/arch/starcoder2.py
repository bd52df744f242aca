"""starcoder2: the LayerNorm block with separate q/k/v projections (biases, GQA) and NEOX rope over
the whole head (src/models/starcoder2.cpp)."""

from __future__ import annotations

from llamir.frontend.arch.base import FUSED_QKV, ROPE_NEOX, ArchError, register_arch, require_rope_dims
from llamir.frontend.arch.layernorm_family import LayerNormFamily, layernorm_specs


@register_arch
class Starcoder2(LayerNormFamily):
    name = "starcoder2"
    rope_type = ROPE_NEOX
    unimplemented_tensors = FUSED_QKV   # create_tensor_qkv takes a fused attn_qkv too (newer llama.cpp)

    def load_hparams(self, f, hp) -> None:
        super().load_hparams(f, hp)
        require_rope_dims(f, hp)
        if hp.n_rot != hp.n_embd_head_k:   # GGML_ASSERT(n_embd_head == n_rot) in the graph
            raise ArchError(f"{f.path}: starcoder2 rotates whole heads: rope.dimension_count = {hp.n_rot}, "
                            f"head size {hp.n_embd_head_k}")

    def tensor_specs(self, hp):
        return layernorm_specs(hp, fused_qkv=False, pos_embd=False)

    def qkv(self, g, L, il: int, x):
        q, k, v = g.qkv(il, x)                                                         # [T, H(kv), d]
        return (g.rope(q, self.rope_type, il, name=("Qcur", il)),
                g.rope(k, self.rope_type, il, name=("Kcur", il)), v)

    def synth_check(self, spec) -> None:
        if spec.n_embd_head * spec.n_head != spec.n_embd:
            # llama.cpp's starcoder2 loader shapes attn_q/attn_output as {n_embd, n_embd}
            raise ValueError(f"starcoder2 needs head_dim * n_head == n_embd, got "
                             f"{spec.n_embd_head}*{spec.n_head}")
