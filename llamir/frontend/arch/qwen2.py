"""qwen2: the llama block with q/k/v biases and NEOX rope (src/models/qwen2.cpp)."""

from __future__ import annotations

from llamir.frontend.arch.base import ROPE_NEOX, decoder_specs, register_arch
from llamir.frontend.arch.llama import Llama


@register_arch
class Qwen2(Llama):
    name = "qwen2"
    rope_type = ROPE_NEOX

    def load_hparams(self, f, hp) -> None:
        from llamir.frontend.arch.base import require_rms_eps

        require_rms_eps(f, hp)

    def tensor_specs(self, hp):
        return decoder_specs(hp, qkv_bias=True)
