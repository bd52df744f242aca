"""qwen3moe: the qwen3 block (per-head q/k rms norms, NEOX rope) with softmax-routed experts whose
selected weights are renormalised, and no shared expert (src/models/qwen3moe.cpp)."""

from __future__ import annotations

from llamir.frontend.arch.base import FUSED_QKV, decoder_specs, register_arch
from llamir.frontend.arch.moe import expert_specs, load_expert_hparams, n_ff_exp, with_experts
from llamir.frontend.arch.qwen3 import Qwen3


@register_arch
class Qwen3Moe(Qwen3):
    name = "qwen3moe"
    unimplemented_tensors = FUSED_QKV
    synth_options = frozenset({"n_expert", "n_expert_used", "n_ff_exp"})
    synth_defaults = {"n_expert": 4, "n_expert_used": 2}

    def load_hparams(self, f, hp) -> None:
        super().load_hparams(f, hp)
        load_expert_hparams(f, hp, "exp")

    def tensor_specs(self, hp):
        return with_experts(decoder_specs(hp, qk_norm=True), lambda il: expert_specs(hp, il, n_ff_exp(hp, il)))

    def synth_metadata(self, w, spec) -> None:
        w.add_expert_count(spec.n_expert)
        w.add_expert_used_count(spec.n_expert_used)
        if spec.n_ff_exp is not None:
            w.add_expert_feed_forward_length(spec.n_ff_exp)
