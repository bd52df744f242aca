"""qwen2moe: the qwen2 block (q/k/v biases, NEOX rope) with softmax-routed experts whose weights are
not renormalised, plus a shared expert gated by sigmoid(ffn_gate_inp_shexp . x) (src/models/qwen2moe.cpp)."""

from __future__ import annotations

from dataclasses import replace

from llamir.frontend.arch.base import FUSED_QKV, ROPE_NEOX, decoder_specs, register_arch
from llamir.frontend.arch.llama_family import LlamaFamily
from llamir.frontend.arch.moe import expert_specs, load_expert_hparams, n_ff_exp, shared_expert_specs, with_experts


@register_arch
class Qwen2Moe(LlamaFamily):
    name = "qwen2moe"
    rope_type = ROPE_NEOX
    moe_norm_w = False
    unimplemented_tensors = FUSED_QKV
    synth_options = frozenset({"n_expert", "n_expert_used", "n_ff_exp", "n_ff_shexp"})
    synth_defaults = {"n_expert": 4, "n_expert_used": 2}

    def load_hparams(self, f, hp) -> None:
        super().load_hparams(f, hp)
        load_expert_hparams(f, hp, "exp", "shexp")

    def tensor_specs(self, hp):
        specs = [replace(t, required=True) if t.name == "output.weight" else t   # not optional here
                 for t in decoder_specs(hp, qkv_bias=True)]
        return with_experts(specs, lambda il: expert_specs(hp, il, n_ff_exp(hp, il))
                            + shared_expert_specs(hp, il, hp.n_ff_shexp or hp.n_ff(il)))

    def ffn_block(self, g, L, il: int, cur):
        b = g.b
        moe_out = super().ffn_block(g, L, il, cur)                                           # [T, E]
        gate_logit = g.linear(L.ffn_gate_inp_shexp, cur, name=("ffn_shexp_gate_inp", il))  # [T, 1]
        # sigmoid as llama.cpp writes it: silu(x) / x
        gate = b.div(b.unary("silu", gate_logit), gate_logit, name=("ffn_shexp_gate", il))
        shared = g.ffn(cur, L.ffn_up_shexp, L.ffn_gate_shexp, L.ffn_down_shexp, act="silu", il=il)
        shared = b.mul(shared, gate, name=("ffn_shexp_out", il))                          # [T, E]
        return b.add(moe_out, shared, name=("ffn_out", il))

    def synth_check(self, spec) -> None:
        if spec.tied:
            raise ValueError("qwen2moe cannot be tied: llama.cpp's loader requires output.weight")
        if spec.n_embd_head * spec.n_head != spec.n_embd:   # attn_q/attn_output are {n_embd, n_embd}
            raise ValueError(f"qwen2moe needs head_dim * n_head == n_embd, got {spec.n_embd_head}*{spec.n_head}")

    def synth_metadata(self, w, spec) -> None:
        w.add_expert_count(spec.n_expert)
        w.add_expert_used_count(spec.n_expert_used)
        if spec.n_ff_exp is not None:
            w.add_expert_feed_forward_length(spec.n_ff_exp)
        if spec.n_ff_shexp is not None:
            w.add_expert_shared_feed_forward_length(spec.n_ff_shexp)
