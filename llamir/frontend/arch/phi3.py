"""phi3: a fused qkv projection, NEOX rope with LongRoPE factors (the long ones beyond the original
context), q scaled before attention, an ffn of fused gate|up halves (src/models/phi3.cpp)."""

from __future__ import annotations

import math

import numpy as np

from llamir.frontend.arch.base import QK_GAIN, ROPE_NEOX, Architecture, TensorSpec, register_arch

SYNTH_ORIG_CTX_SHARE = 8   # synth: the original context is n_ctx_train / 8 (Phi-3 128k: 1/32)


@register_arch
class Phi3(Architecture):
    name = "phi3"
    rope_type = ROPE_NEOX
    # the separate projections create_tensor_qkv falls back to (llamir reads the fused one only)
    unimplemented_tensors = tuple(f"blk.{{il}}.attn_{x}.{s}" for x in "qkv" for s in ("weight", "bias"))

    def tensor_specs(self, hp):
        e, v, d = hp.n_embd, hp.n_vocab, hp.n_embd_head_k
        specs = [TensorSpec("token_embd.weight", (v, e)), TensorSpec("output_norm.weight", (e,)),
                 TensorSpec("output.weight", (v, e), required=False, gain=3.0, synth=True)]
        for il in range(hp.n_layer):
            p, n_q, f = f"blk.{il}.", d * hp.n_head(il), hp.n_ff(il)
            specs += [TensorSpec(p + "attn_norm.weight", (e,)),
                      TensorSpec(p + "attn_qkv.weight", (n_q + 2 * hp.n_embd_k_gqa(il), e), gain=QK_GAIN),
                      TensorSpec(p + "attn_qkv.bias", (n_q + 2 * hp.n_embd_k_gqa(il),), required=False),
                      TensorSpec(p + "attn_output.weight", (e, n_q)), TensorSpec(p + "ffn_norm.weight", (e,)),
                      TensorSpec(p + "ffn_down.weight", (e, f)), TensorSpec(p + "ffn_up.weight", (2 * f, e))]
        # LongRoPE: the angles are divided by these; synth draws the long ones ~4, the short ones ~1
        return specs + [TensorSpec(f"rope_factors_{x}.weight", (hp.n_rot // 2,), required=False, synth=True,
                                   init="norm", gain=gain) for x, gain in (("long", 4.0), ("short", 1.0))]

    def rope_factors(self, g):
        """llama_model::get_rope_factors: the long factors when a sequence's context (the KV cache
        size, cparams.n_ctx_seq) is beyond the original context, else the short ones."""
        n_ctx_seq = g.config.memory[0].kv_size if g.config.memory else g.hp.n_ctx_train
        return g.weights.rope_factors_long if n_ctx_seq > g.hp.n_ctx_orig_yarn else g.weights.rope_factors_short

    def build(self, g) -> None:
        hp, b = g.hp, g.b
        x = g.inp_embd()                                                               # [T, E]
        out_ids = g.inp_out_ids()
        factors = self.rope_factors(g)                                                 # [n_rot/2] or None
        q_scale = float(np.float32(1.0) / np.sqrt(np.float32(hp.n_embd_head_k)))      # f32, as 1.0f/sqrtf
        for il in g.layers():
            L = g.layer_weights(il)
            cur = g.norm(x, L.attn_norm, name=("attn_norm", il))
            q, k, v = g.qkv_fused(il, cur, L.attn_qkv, L.attn_qkv_bias)         # [T, H(kv), d]
            q = g.rope(q, self.rope_type, il, factors, name=("Qcur", il))
            k = g.rope(k, self.rope_type, il, factors, name=("Kcur", il))
            cur = g.attn(il, b.scale(q, q_scale), k, v, L.attn_output, None, 1.0)    # [T, E]
            if il == hp.n_layer - 1:
                cur, x = b.get_rows(cur, out_ids), b.get_rows(x, out_ids)
            x = b.add(cur, x, name=("ffn_inp", il))
            cur = g.norm(x, L.ffn_norm, name=("ffn_norm", il))
            up = g.linear(L.ffn_up, cur, name=("ffn_up", il))                         # [T, 2 n_ff]: gate | up
            cur = g.linear(L.ffn_down, b.glu("swiglu", up, name=("ffn_swiglu", il)), name=("ffn_out", il))
            x = g.cvec(b.add(x, cur), il, name=("l_out", il))
        hidden = g.norm(x, g.weights.output_norm)                                     # [n_out, E]
        g.finish(hidden, g.linear(g.output_weight(), hidden))                         # [n_out, V]

    def synth_check(self, spec) -> None:
        if spec.n_embd_head * spec.n_head != spec.n_embd:   # the loader shapes attn_output {n_embd, n_embd}
            raise ValueError(f"phi3 needs head_dim * n_head == n_embd, got {spec.n_embd_head}*{spec.n_head}")

    def synth_name(self, spec) -> str:
        # llama.cpp gives a model named *phi3* the rstrip attributes of Phi-3's vocab, whose </s>, <s>
        # and <unk> the synthetic vocab lacks (it throws): the name must not say phi3 or phi-3
        return f"synth-longrope-{spec.dtype}"

    def synth_metadata(self, w, spec) -> None:
        """LongRoPE's keys: the original context and the attention factor convert_hf_to_gguf writes,
        sqrt(1 + ln(n_ctx_train / orig) / ln(orig))."""
        orig = spec.n_ctx_train // SYNTH_ORIG_CTX_SHARE
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(spec.n_ctx_train / orig) / math.log(orig)))
