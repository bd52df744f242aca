"""stablelm: LayerNorms with biases, q/k/v biases, partial NEOX rope, a SiLU-gated ffn; StableLM 2
12B adds per-head q/k LayerNorms and, without ffn norms, a parallel residual (src/models/stablelm.cpp)."""

from __future__ import annotations

import math

from llamir.frontend.arch import base
from llamir.frontend.arch.base import QK_GAIN, ROPE_NEOX, ArchError, Architecture, TensorSpec, register_arch


@register_arch
class StableLM(Architecture):
    name = "stablelm"
    rope_type = ROPE_NEOX
    unimplemented_tensors = base.FUSED_QKV
    synth_options = frozenset({"partial_rotary", "norm_eps"})
    synth_defaults = {"partial_rotary": 0.25}   # StableLM's rotated share of each head

    def load_hparams(self, f, hp) -> None:
        key = f"{hp.arch}.attention.layer_norm_epsilon"
        hp.f_norm_eps = f.metadata.get_f32(key, required=True)
        if not hp.f_norm_eps >= 0.0:
            raise ArchError(f"{f.path}: {key} = {hp.f_norm_eps}: ggml's norm needs eps >= 0")
        base.require_rope_dims(f, hp)

    def tensor_specs(self, hp):
        e, v, d = hp.n_embd, hp.n_vocab, hp.n_embd_head_k
        specs = [TensorSpec("token_embd.weight", (v, e)), TensorSpec("output_norm.bias", (e,)),
                 TensorSpec("output_norm.weight", (e,)), TensorSpec("output.weight", (v, e), gain=3.0)]
        for il in range(hp.n_layer):
            p, n_q, n_kv, f = f"blk.{il}.", d * hp.n_head(il), hp.n_embd_k_gqa(il), hp.n_ff(il)
            specs += [TensorSpec(p + "attn_norm.weight", (e,)), TensorSpec(p + "attn_norm.bias", (e,)),
                      TensorSpec(p + "attn_q.weight", (n_q, e), gain=QK_GAIN),
                      TensorSpec(p + "attn_k.weight", (n_kv, e), gain=QK_GAIN),
                      TensorSpec(p + "attn_v.weight", (n_kv, e))]
            specs += [TensorSpec(p + f"attn_{x}.bias", (n,), required=False, synth=True)
                      for x, n in (("q", n_q), ("k", n_kv), ("v", n_kv))]
            specs.append(TensorSpec(p + "attn_output.weight", (e, n_q)))
            specs += [TensorSpec(p + f"attn_{x}_norm.weight", (h, d), required=False, gain=QK_GAIN, storage="f32")
                      for x, h in (("q", hp.n_head(il)), ("k", hp.n_head_kv(il)))]   # StableLM 2 12B
            specs += [TensorSpec(p + f"ffn_norm.{x}", (e,), required=False, synth=True) for x in ("weight", "bias")]
            specs += [TensorSpec(p + "ffn_gate.weight", (f, e)), TensorSpec(p + "ffn_down.weight", (e, f)),
                      TensorSpec(p + "ffn_up.weight", (f, e))]
        return specs

    def build(self, g) -> None:
        hp, b = g.hp, g.b
        x = g.inp_embd()                                                               # [T, E]
        out_ids = g.inp_out_ids()
        for il in g.layers():
            L = g.layer_weights(il)
            cur = normed = g.norm(x, L.attn_norm, L.attn_norm_bias, kind="layer", name=("attn_norm", il))
            q, k, v = g.qkv(il, cur)                                                   # [T, H(kv), d]
            if L.attn_q_norm is not None:   # per head, over the head size
                q = g.norm(q, L.attn_q_norm, kind="layer", name=("Qcur", il))
            if L.attn_k_norm is not None:
                k = g.norm(k, L.attn_k_norm, kind="layer", name=("Kcur", il))
            q = g.rope(q, self.rope_type, il, name=("Qcur", il))                      # the first n_rot dims
            k = g.rope(k, self.rope_type, il, name=("Kcur", il))
            cur = g.attn(il, q, k, v, L.attn_output, None, 1.0 / math.sqrt(hp.n_embd_head_v))   # [T, E]
            if il == hp.n_layer - 1:
                cur, x, normed = b.get_rows(cur, out_ids), b.get_rows(x, out_ids), b.get_rows(normed, out_ids)
            ffn_inp = b.add(cur, x, name=("ffn_inp", il))
            if L.ffn_norm is not None:
                cur = g.norm(ffn_inp, L.ffn_norm, L.ffn_norm_bias, kind="layer", name=("ffn_norm", il))
            else:   # parallel residual: the ffn reads the attention's input
                cur = normed
            cur = g.ffn(cur, L.ffn_up, L.ffn_gate, L.ffn_down, act="silu", il=il)
            x = g.cvec(b.add(cur, ffn_inp), il, name=("l_out", il))
        hidden = g.norm(x, g.weights.output_norm, g.weights.output_norm_bias, kind="layer")   # [n_out, E]
        g.finish(hidden, g.linear(g.weights.output, hidden))                           # [n_out, V]

    def synth_check(self, spec) -> None:
        if spec.n_embd_head * spec.n_head != spec.n_embd:   # the loader shapes attn_q {n_embd, n_embd}
            raise ValueError(f"stablelm needs head_dim * n_head == n_embd, got {spec.n_embd_head}*{spec.n_head}")

    def synth_metadata(self, w, spec) -> None:
        w.add_layer_norm_eps(spec.norm_eps if spec.norm_eps is not None else 1e-5)
