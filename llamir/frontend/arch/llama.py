"""llama (llama 2/3, mistral, SmolLM; GQA or MHA; Mixtral with experts): NORM rope, as llama.cpp's
src/models/llama.cpp."""

from __future__ import annotations

from llamir.frontend.arch.base import FUSED_QKV, ROPE_NORM, ArchError, decoder_specs, register_arch
from llamir.frontend.arch.llama_family import LlamaFamily
from llamir.frontend.arch.moe import expert_specs, with_experts


@register_arch
class Llama(LlamaFamily):
    name = "llama"
    rope_type = ROPE_NORM
    out_bias = True
    unimplemented_tensors = FUSED_QKV + ("blk.{il}.ffn_gate.bias", "blk.{il}.ffn_down.bias", "blk.{il}.ffn_up.bias",
                                         "rope_factors_long.weight", "rope_factors_short.weight")
    synth_options = frozenset({"n_expert", "n_expert_used"})   # Mixtral

    def load_hparams(self, f, hp) -> None:
        meta = f.metadata
        if meta.get_u32(f"{hp.arch}.vocab_size") is None:   # read (for the model type) only by llama
            meta.get_arr_n("tokenizer.ggml.tokens")
        super().load_hparams(f, hp)
        if hp.n_rot != hp.n_embd_head_k:
            raise ArchError(f"invalid n_rot: {hp.n_rot}, expected {hp.n_embd_head_k}")

    def tensor_specs(self, hp):
        specs = decoder_specs(hp, out_bias=self.out_bias, rope_freqs=hp.rope_scaling_type_train != "longrope")
        if hp.n_expert:   # Mixtral: experts of n_ff (the gate optional), weights renormalised
            specs = with_experts(specs, lambda il: expert_specs(hp, il, hp.n_ff(il), gate_required=False))
        return specs

    def synth_metadata(self, w, spec) -> None:
        if spec.n_expert:
            w.add_expert_count(spec.n_expert)
            w.add_expert_used_count(spec.n_expert_used)

    def kq_scale(self, hp) -> float:
        return hp.f_attention_scale or super().kq_scale(hp)

    def rope_qk(self, g, L, il: int, q, k):
        """Llama 3 divides the rope angles by rope_freqs, when the model has it."""
        factors = g.weights.rope_freqs
        return (g.rope(q, self.rope_type, il, factors, name=("Qcur", il)),
                g.rope(k, self.rope_type, il, factors, name=("Kcur", il)))
