"""bert: an encoder without memory (src/models/bert.cpp). Token + token-type (row 0) + learned
position embeddings, a LayerNorm, then post-LN blocks: non-causal attention (q/k/v biases or one
fused attn_qkv), residual, LayerNorm, a GELU ffn with biases, residual, LayerNorm. No output head:
the last block's output is the embedding, pooled by the context (rank: through cls / cls.output)."""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np

from llamir.frontend.arch.base import QK_GAIN, ROPE_NEOX, ArchError, Architecture, TensorSpec, register_arch
from llamir.frontend.arch.layernorm_family import DEFAULT_NORM_EPS, require_norm_eps
from llamir.frontend.gguf_meta import GGUFType
from llamir.frontend.hparams import ArchHParams
from llamir.ir import F32

SYNTH_TOKEN_TYPES = 2     # BERT's two segments (tokenizer.ggml.token_type_count)
# how a block's q/k/v come (create_tensor_qkv): attn_q/k/v, or one attn_qkv with its bias, or one
# attn_qkv without it, whose separate q/k/v biases are read instead (legacy files)
QKV_SEPARATE, QKV_FUSED, QKV_FUSED_SPLIT_BIAS = "separate", "fused", "fused_split_bias"


@dataclass(frozen=True)
class BertHParams(ArchHParams):
    """bert's own hparams (hp.extra)."""

    n_token_types: int = SYNTH_TOKEN_TYPES   # tokenizer.ggml.token_type_count (the vocab's, in llama.cpp)
    n_cls_out: int = 1                       # classifier outputs: len({arch}.classifier.output_labels)
    qkv: tuple[str, ...] = ()                # per block: QKV_SEPARATE / QKV_FUSED / QKV_FUSED_SPLIT_BIAS

    def qkv_of(self, il: int) -> str:
        return self.qkv[il] if il < len(self.qkv) else QKV_SEPARATE


@register_arch
class Bert(Architecture):
    name = "bert"
    rope_type = ROPE_NEOX   # llama_model_rope_type's answer; bert itself never ropes
    synth_options = frozenset({"norm_eps", "fused_qkv"})

    def load_hparams(self, f, hp) -> None:
        """The LayerNorm eps; the token type count (llama.cpp throws without one); the classifier's
        width; and, per block, whether q/k/v come fused (llama.cpp's create_tensor_qkv looks)."""
        require_norm_eps(f, hp)
        if not (hp.n_embd_head_k == hp.n_embd_head_v and hp.n_embd_head_k * hp.n_head() == hp.n_embd):
            # the loader shapes attn_q / attn_output {n_embd, n_embd}; the graph asserts k == v head sizes
            raise ArchError(f"{f.path}: bert needs key_length == value_length and head size * n_head == "
                            f"n_embd, got {hp.n_embd_head_k}, {hp.n_embd_head_v} * {hp.n_head()} vs {hp.n_embd}")
        n_types = f.metadata.get_u32("tokenizer.ggml.token_type_count", 0)
        if n_types == 0:
            raise ArchError(f"{f.path}: bert model needs to define token type count "
                            "(tokenizer.ggml.token_type_count)")
        types = f.tensors.get("token_types.weight")
        if types is not None and types.dtype != F32:   # ggml's add takes an f32 row only: llama.cpp aborts
            raise ArchError(f"{f.path}: token_types.weight is {types.dtype}; its row 0 is added to f32 "
                            "embeddings, which ggml does only from f32 (llama.cpp aborts at its first batch)")
        labels = f.metadata.get_arr(f"{hp.arch}.classifier.output_labels", (GGUFType.STRING,), (),
                                    non_array_missing=True)
        hp.extra = BertHParams(n_token_types=n_types, n_cls_out=len(labels) or 1,
                               qkv=tuple(qkv_layout(f.tensors, il) for il in range(hp.n_layer)))

    def create_memory(self, hp, causal: bool = True) -> str:
        return "none"   # llama_model::create_memory: no memory for bert, whatever the attention

    def tensor_specs(self, hp):
        extra = hp.extra if isinstance(hp.extra, BertHParams) else BertHParams()
        e, v, n_cls = hp.n_embd, hp.n_vocab, extra.n_cls_out
        # the embeddings are drawn as trained ones are: positions and types smaller than tokens
        specs = [TensorSpec("token_embd.weight", (v, e)),
                 TensorSpec("token_types.weight", (extra.n_token_types, e), required=False, synth=True,
                            init="embedding", gain=0.5, storage="f32"),
                 TensorSpec("position_embd.weight", (hp.n_ctx_train, e), init="embedding", gain=0.5, storage="embd"),
                 optional_synth("cls.weight", (e, e)), optional_synth("cls.bias", (e,)),
                 optional_synth("cls.output.weight", (n_cls, e)), optional_synth("cls.output.bias", (n_cls,)),
                 TensorSpec("token_embd_norm.weight", (e,)), TensorSpec("token_embd_norm.bias", (e,))]
        for il in range(hp.n_layer):
            p, n_kv, f = f"blk.{il}.", hp.n_embd_k_gqa(il), hp.n_ff(il)
            specs += qkv_specs(p, e, n_kv, extra.qkv_of(il))
            specs += [TensorSpec(p + "attn_output.weight", (e, e)), optional_synth(p + "attn_output.bias", (e,)),
                      TensorSpec(p + "attn_output_norm.weight", (e,)), TensorSpec(p + "attn_output_norm.bias", (e,)),
                      TensorSpec(p + "ffn_up.weight", (f, e)), optional_synth(p + "ffn_up.bias", (f,)),
                      TensorSpec(p + "ffn_down.weight", (e, f)), optional_synth(p + "ffn_down.bias", (e,)),
                      TensorSpec(p + "layer_output_norm.weight", (e,)),
                      TensorSpec(p + "layer_output_norm.bias", (e,))]
        return specs

    def build(self, g) -> None:
        hp, b, W = g.hp, g.b, g.weights
        x = g.inp_embd()                                                               # [T, E]
        if W.token_types is not None:   # every token is of type 0 ("sentence A")
            x = b.add(x, self.type_row0(g, W.token_types))                            # [T, E] + [E]
        x = g.inp_pos_embd(x, W.position_embd)                                         # [T, E]
        x = g.norm(x, W.token_embd_norm, W.token_embd_norm_bias, kind="layer", name="inp_norm")
        out_ids = g.inp_out_ids()                                                      # [n_out]
        kq_scale = float(np.float32(1.0) / np.sqrt(np.float32(hp.n_embd_head_k)))     # 1.0f / sqrtf(d)
        for il in g.layers():
            L = g.layer_weights(il)
            q, k, v = self.qkv(g, L, il, x)                                            # [T, H(kv), d]
            cur = g.attn(il, q, k, v, L.attn_output, L.attn_output_bias, kq_scale)     # [T, E]
            if il == hp.n_layer - 1:  # only the rows that produce outputs go on
                cur, x = b.get_rows(cur, out_ids), b.get_rows(x, out_ids)             # [n_out, E]
            cur = g.norm(b.add(cur, x), L.attn_output_norm, L.attn_output_norm_bias, kind="layer")
            ffn_inp = b.name(cur, ("ffn_inp", il))
            cur = g.ffn(ffn_inp, L.ffn_up, None, L.ffn_down, act="gelu", il=il, up_b=L.ffn_up_bias,
                        down_b=L.ffn_down_bias)
            x = g.norm(b.add(cur, ffn_inp), L.layer_output_norm, L.layer_output_norm_bias, kind="layer",
                       name=("l_out", il))                                             # [T or n_out, E]
        g.finish(x, None)                                                              # embeddings only

    def type_row0(self, g, token_types):
        """ggml_view_1d(token_types, n_embd, 0): the type-0 embedding row [E]."""
        e = g.hp.n_embd
        return g.b.view(token_types, [e], [F32.type_size], 0, name="type_row0")

    def qkv(self, g, L, il: int, x):
        """build_qkv: the fused projection (its bias, or the three separate ones concatenated, as
        llama.cpp takes legacy files), else separate q/k/v with their biases."""
        layout = g.hp.extra.qkv_of(il)
        if layout == QKV_SEPARATE:
            return g.qkv(il, x)
        if layout == QKV_FUSED:
            return g.qkv_fused(il, x, L.attn_qkv, L.attn_qkv_bias)
        parts = [L.attn_q_bias, L.attn_k_bias, L.attn_v_bias]   # used only when all three are there
        bias = g.b.concat(g.b.concat(parts[0], parts[1], 0), parts[2], 0) if all(
            p is not None for p in parts) else None                                   # [n_q + 2 n_kv]
        return g.qkv_fused(il, x, L.attn_qkv, bias)

    def synth_check(self, spec) -> None:
        if spec.n_embd_head * spec.n_head != spec.n_embd:
            raise ValueError(f"bert needs head_dim * n_head == n_embd, got {spec.n_embd_head}*{spec.n_head}")

    def synth_extra(self, spec) -> BertHParams:
        """hp.extra of a synthetic model: BERT's two token types, one classifier output, and every
        block fused when the spec asks for it."""
        return BertHParams(qkv=((QKV_FUSED if spec.fused_qkv else QKV_SEPARATE),) * spec.n_layer)

    def synth_metadata(self, w, spec) -> None:
        w.add_layer_norm_eps(DEFAULT_NORM_EPS if spec.norm_eps is None else spec.norm_eps)
        w.add_causal_attention(False)
        w.add_pooling_type(gguf.PoolingType.MEAN)   # sentence-transformers' usual
        w.add_token_type_count(SYNTH_TOKEN_TYPES)


def optional_synth(name: str, shape: tuple[int, ...]) -> TensorSpec:
    """An optional tensor (TENSOR_NOT_REQUIRED) that synthetic models have."""
    return TensorSpec(name, shape, required=False, synth=True)


def qkv_layout(tensors, il: int) -> str:
    """create_tensor_qkv's choice for block il, by the tensors the file has."""
    p = f"blk.{il}."
    if p + "attn_qkv.weight" not in tensors:
        return QKV_SEPARATE
    return QKV_FUSED if p + "attn_qkv.bias" in tensors else QKV_FUSED_SPLIT_BIAS


def qkv_specs(p: str, e: int, n_kv: int, layout: str) -> list[TensorSpec]:
    """create_tensor_qkv's tensors for `layout`; every bias is optional. The score gain is on the
    q and k matrices (on the whole fused one: v's share only scales the output)."""
    sizes = (("q", e), ("k", n_kv), ("v", n_kv))
    biases = [optional_synth(p + f"attn_{x}.bias", (n,)) for x, n in sizes]
    if layout == QKV_SEPARATE:
        return [*(TensorSpec(p + f"attn_{x}.weight", (n, e), gain=QK_GAIN if x != "v" else 1.0)
                  for x, n in sizes), *biases]
    fused = TensorSpec(p + "attn_qkv.weight", (e + 2 * n_kv, e), gain=QK_GAIN)
    if layout == QKV_FUSED:
        return [fused, optional_synth(p + "attn_qkv.bias", (e + 2 * n_kv,))]
    return [fused, *biases]


__all__ = ["Bert", "BertHParams"]
