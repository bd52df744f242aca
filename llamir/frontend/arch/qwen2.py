"""qwen2: the llama block with q/k/v biases and NEOX rope (src/models/qwen2.cpp)."""

from __future__ import annotations

from llamir.frontend.arch.base import FUSED_QKV, ROPE_NEOX, Architecture, decoder_specs, register_arch
from llamir.frontend.arch.llama import Llama


@register_arch
class Qwen2(Llama):
    name = "qwen2"
    rope_type = ROPE_NEOX
    unimplemented_tensors = FUSED_QKV + ("output.bias",)

    def load_hparams(self, f, hp) -> None:
        Architecture.load_hparams(self, f, hp)   # the rms eps, without llama's n_rot check

    def tensor_specs(self, hp):
        return decoder_specs(hp)
