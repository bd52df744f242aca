"""jamba: Mamba-1 blocks and attention blocks (no rope) in one stack over the hybrid memory, each
followed by a dense or mixture-of-experts SwiGLU ffn, as llama.cpp's src/models/jamba.cpp.

A layer with no KV heads (head_count_kv[il] = 0) is a Mamba block with rms norms on dt, B and C;
the others attend through the KV cache with 1/sqrt(head_dim) scaling. A layer whose router
(ffn_gate_inp) exists routes each token to its top experts (softmax gating, unnormalised weights).
"""

from __future__ import annotations

import math

from llamir.frontend.arch.base import QK_GAIN, ROPE_NONE, ArchError, Architecture, TensorSpec, register_arch
from llamir.frontend.arch.mamba import (
    MambaHParams,
    build_mamba_layer,
    load_ssm_hparams,
    ssm_layout,
    ssm_specs,
    ssm_synth_extra,
    write_ssm_metadata,
)
from llamir.frontend.arch.moe import expert_specs
from llamir.frontend.graph_rs import RSLayout


@register_arch
class Jamba(Architecture):
    name = "jamba"
    rope_type = ROPE_NONE
    synth_options = frozenset({"ssm_d_state", "ssm_d_conv", "ssm_dt_rank", "n_expert", "n_expert_used"})
    synth_defaults = {"ssm_d_state": 16, "ssm_d_conv": 4, "ssm_dt_rank": 8}

    def load_hparams(self, f, hp) -> None:
        """llama_model_jamba::load_arch_hparams: the ssm keys and the rms eps; a layer is recurrent
        where it has no KV heads."""
        load_ssm_hparams(f, hp, dt_b_c_rms=False)
        if all(self.is_recurrent(hp, il) for il in range(hp.n_layer)) or not hp.n_head(0):
            raise ArchError(f"{f.path}: jamba needs attention heads and some layer with KV heads "
                            f"(head_count_kv = {list(hp.n_head_kv_arr)})")

    @staticmethod
    def is_recurrent(hp, il: int) -> bool:
        return hp.n_head_kv(il) == 0

    def create_memory(self, hp, causal: bool = True) -> str:
        return "hybrid"

    def recurrent_layout(self, hp, size: int) -> RSLayout:
        return ssm_layout(hp, size, tuple(il for il in range(hp.n_layer) if self.is_recurrent(hp, il)))

    def tensor_specs(self, hp):
        e, v, d = hp.n_embd, hp.n_vocab, hp.n_embd_head_v
        specs = [TensorSpec("token_embd.weight", (v, e)), TensorSpec("output_norm.weight", (e,)),
                 TensorSpec("output.weight", (v, e), required=False, gain=3.0, synth=True)]
        for il in range(hp.n_layer):
            p = f"blk.{il}."
            specs.append(TensorSpec(p + "attn_norm.weight", (e,)))
            if self.is_recurrent(hp, il):
                specs += ssm_specs(hp, il, norms=True)
            else:
                n_gqa = d * hp.n_head_kv(il)
                specs += [TensorSpec(p + "attn_q.weight", (e, e), gain=QK_GAIN),
                          TensorSpec(p + "attn_k.weight", (n_gqa, e), gain=QK_GAIN),
                          TensorSpec(p + "attn_v.weight", (n_gqa, e))]
                specs += [TensorSpec(p + f"attn_{x}.bias", (n,), required=False, synth=False)
                          for x, n in (("q", e), ("k", n_gqa), ("v", n_gqa))]
                specs.append(TensorSpec(p + "attn_output.weight", (e, e)))
            specs.append(TensorSpec(p + "ffn_norm.weight", (e,)))
            if hp.n_expert and il % 2 == 1:
                specs += expert_specs(hp, il, hp.n_ff(il))
            else:   # a dense ffn; llama.cpp picks by whether the router exists
                f = hp.n_ff(il)
                specs += [TensorSpec(p + "ffn_gate.weight", (f, e)), TensorSpec(p + "ffn_down.weight", (e, f)),
                          TensorSpec(p + "ffn_up.weight", (f, e))]
        return specs

    def build(self, g) -> None:
        hp, b = g.hp, g.b
        inp = g.inp_embd()                                                            # [T, E]
        out_ids = g.inp_out_ids()
        for il in g.layers():
            L = g.layer_weights(il)
            cur = g.norm(inp, L.attn_norm, name=("attn_norm", il))
            if self.is_recurrent(hp, il):
                cur = build_mamba_layer(g, L, il, cur)                                # [T, E]
            else:
                q, k, v = g.qkv(il, cur)                                              # no rope
                cur = g.attn(il, q, k, v, L.attn_output, None, 1.0 / math.sqrt(hp.n_embd_head_v))
            if il == hp.n_layer - 1:
                cur, inp = b.get_rows(cur, out_ids), b.get_rows(inp, out_ids)         # [n_out, E]
            ffn_inp = b.add(inp, cur, name=("ffn_inp", il))
            cur = g.norm(ffn_inp, L.ffn_norm, name=("ffn_norm", il))
            if f"blk.{il}.ffn_gate_inp.weight" in g.model.tensor_specs and g.has(f"blk.{il}.ffn_gate_inp.weight"):
                cur = g.moe_ffn(cur, L.ffn_gate_inp, L.ffn_up_exps, L.ffn_gate_exps, L.ffn_down_exps,
                                hp.n_expert_used, il=il)
            else:
                cur = g.ffn(cur, L.ffn_up, L.ffn_gate, L.ffn_down, il=il)
            inp = g.cvec(b.add(ffn_inp, cur), il, name=("l_out", il))
        cur = g.norm(inp, g.weights.output_norm)
        g.finish(cur, g.linear(g.output_weight(), cur))

    # -- synthetic models: attention on every other layer (1, 3, ...), experts there if asked ----
    def synth_kv_heads(self, spec) -> tuple[int, ...]:
        return tuple(spec.n_head_kv if il % 2 == 1 else 0 for il in range(spec.n_layer))

    def synth_extra(self, spec) -> MambaHParams:
        return ssm_synth_extra(spec)

    def synth_check(self, spec) -> None:
        if spec.n_layer < 2:
            raise ValueError("a synthetic jamba has attention on layers 1, 3, ...: it needs n_layer >= 2")
        if spec.n_embd_head * spec.n_head != spec.n_embd:
            raise ValueError(f"jamba's attn_q and attn_output are [n_embd, n_embd]: head_dim * n_head must be "
                             f"n_embd, got {spec.n_embd_head}*{spec.n_head}")

    def synth_metadata(self, w, spec) -> None:
        write_ssm_metadata(w, spec)
        if spec.n_expert:
            w.add_expert_count(spec.n_expert)
            w.add_expert_used_count(spec.n_expert_used)
