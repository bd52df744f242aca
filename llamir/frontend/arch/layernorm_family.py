"""The block gpt2 and starcoder2 share (src/models/gpt2.cpp, starcoder2.cpp): pre-LayerNorm with
biases around attention (output bias) and a GELU ffn without a gate (with biases), then a final
LayerNorm with bias. Each architecture says how it embeds the tokens and makes q, k and v."""

from __future__ import annotations

import math
from abc import abstractmethod

from llamir.frontend.arch.base import QK_GAIN, ArchError, Architecture, TensorSpec

DEFAULT_NORM_EPS = 1e-5   # what synth writes when SynthSpec.norm_eps is None


class LayerNormFamily(Architecture):
    """The LayerNorm block; subclasses set name and tensor_specs and implement `qkv`."""

    synth_options = frozenset({"norm_eps"})

    def load_hparams(self, f, hp) -> None:
        require_norm_eps(f, hp)
        if hp.n_embd_head_k != hp.n_embd_head_v:   # GGML_ASSERT in both graphs
            raise ArchError(f"{f.path}: {hp.arch} needs key_length == value_length, got "
                            f"{hp.n_embd_head_k} and {hp.n_embd_head_v}")

    def embed(self, g):
        """The block input [T, E]."""
        return g.inp_embd()

    @abstractmethod
    def qkv(self, g, L, il: int, x):
        """q, k, v [T, H(kv), d] of the normed block input x, rotated where the architecture does."""

    def build(self, g) -> None:
        hp, b, W = g.hp, g.b, g.weights
        x = self.embed(g)                                                              # [T, E]
        out_ids = g.inp_out_ids()                                                      # [n_out]
        for il in g.layers():
            L = g.layer_weights(il)
            cur = g.norm(x, L.attn_norm, L.attn_norm_bias, kind="layer", name=("attn_norm", il))
            q, k, v = self.qkv(g, L, il, cur)                                          # [T, H(kv), d]
            cur = g.attn(il, q, k, v, L.attn_output, L.attn_output_bias, 1.0 / math.sqrt(hp.n_embd_head_k))
            if il == hp.n_layer - 1:  # only the rows that produce outputs go on
                cur, x = b.get_rows(cur, out_ids), b.get_rows(x, out_ids)             # [n_out, E]
            x = b.add(cur, x, name=("ffn_inp", il))
            cur = g.norm(x, L.ffn_norm, L.ffn_norm_bias, kind="layer", name=("ffn_norm", il))
            cur = g.ffn(cur, L.ffn_up, None, L.ffn_down, act="gelu", il=il, up_b=L.ffn_up_bias,
                        down_b=L.ffn_down_bias)
            x = g.cvec(b.add(cur, x), il, name=("l_out", il))
        hidden = g.norm(x, W.output_norm, W.output_norm_bias, kind="layer")           # [n_out, E]
        g.finish(hidden, g.linear(g.output_weight(), hidden))                         # [n_out, V]

    def synth_metadata(self, w, spec) -> None:
        w.add_layer_norm_eps(DEFAULT_NORM_EPS if spec.norm_eps is None else spec.norm_eps)


def layernorm_specs(hp, *, fused_qkv: bool, pos_embd: bool) -> list[TensorSpec]:
    """load_arch_tensors of gpt2 (fused_qkv, pos_embd) and starcoder2 (separate q/k/v, whose biases
    create_tensor_qkv makes optional), in the order of the block; every other bias is required."""
    e, v = hp.n_embd, hp.n_vocab
    specs = [TensorSpec("token_embd.weight", (v, e))]
    if pos_embd:   # drawn smaller than the token embedding, as trained ones are
        specs.append(TensorSpec("position_embd.weight", (hp.n_ctx_train, e), init="embedding", gain=0.5,
                                storage="embd"))
    specs += [TensorSpec("output_norm.weight", (e,)), TensorSpec("output_norm.bias", (e,)),
              TensorSpec("output.weight", (v, e), required=False, gain=3.0, synth=True)]
    for il in range(hp.n_layer):
        p, n_q, n_kv, f = f"blk.{il}.", hp.n_embd_head_k * hp.n_head(il), hp.n_embd_k_gqa(il), hp.n_ff(il)
        specs += [TensorSpec(p + "attn_norm.weight", (e,)), TensorSpec(p + "attn_norm.bias", (e,))]
        if fused_qkv:   # the score gain on the whole fused matrix (v's share only scales the output)
            specs += [TensorSpec(p + "attn_qkv.weight", (n_q + 2 * n_kv, e), gain=QK_GAIN),
                      TensorSpec(p + "attn_qkv.bias", (n_q + 2 * n_kv,))]
        else:
            specs += [TensorSpec(p + "attn_q.weight", (n_q, e), gain=QK_GAIN),
                      TensorSpec(p + "attn_k.weight", (n_kv, e), gain=QK_GAIN),
                      TensorSpec(p + "attn_v.weight", (n_kv, e))]
            specs += [TensorSpec(p + f"attn_{x}.bias", (n,), required=False, synth=True)
                      for x, n in (("q", n_q), ("k", n_kv), ("v", n_kv))]
        specs += [TensorSpec(p + "attn_output.weight", (e, n_q)), TensorSpec(p + "attn_output.bias", (e,)),
                  TensorSpec(p + "ffn_norm.weight", (e,)), TensorSpec(p + "ffn_norm.bias", (e,)),
                  TensorSpec(p + "ffn_up.weight", (f, e)), TensorSpec(p + "ffn_up.bias", (f,)),
                  TensorSpec(p + "ffn_down.weight", (e, f)), TensorSpec(p + "ffn_down.bias", (e,))]
    return specs


def require_norm_eps(f, hp) -> None:
    """get_key(LLM_KV_ATTENTION_LAYERNORM_EPS), required, f32; ggml's norm asserts eps >= 0 (llama.cpp
    aborts at its first decode), so it is refused here."""
    key = f"{hp.arch}.attention.layer_norm_epsilon"
    eps = f.metadata.get_f32(key, required=True)
    if not eps >= 0.0:
        raise ArchError(f"{f.path}: {key} = {eps}: ggml's norm needs eps >= 0 (llama.cpp aborts on it)")
    hp.f_norm_eps = eps


__all__ = ["DEFAULT_NORM_EPS", "LayerNormFamily", "layernorm_specs", "require_norm_eps"]
