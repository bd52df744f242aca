"""qwen2: the llama block with q/k/v biases and NEOX rope (src/models/qwen2.cpp)."""

from __future__ import annotations

from llamir.frontend.arch.base import FUSED_QKV, ROPE_NEOX, decoder_specs, register_arch
from llamir.frontend.arch.llama_family import LlamaFamily


@register_arch
class Qwen2(LlamaFamily):
    name = "qwen2"
    rope_type = ROPE_NEOX
    unimplemented_tensors = FUSED_QKV + ("output.bias",)

    def tensor_specs(self, hp):
        return decoder_specs(hp, qkv_bias=True)   # optional in the loader, present in every qwen2

    def synth_check(self, spec) -> None:
        if spec.n_embd_head * spec.n_head != spec.n_embd:
            # llama.cpp's qwen2 loader shapes attn_q/attn_output as {n_embd, n_embd}
            raise ValueError(f"qwen2 needs head_dim * n_head == n_embd, got {spec.n_embd_head}*{spec.n_head}")
