"""t5: an encoder-decoder (src/models/t5.cpp). Two graphs of one model: the encoder (encode(),
bidirectional attention over the source) and the decoder (decode(), causal self-attention over
its KV cache, then cross-attention over the stored encoder output). Both are pre-RMS-norm blocks
without rope: a learned bias per head and relative-position bucket is added to the attention
scores (layer 0's table serves every layer without its own), and the scores are not scaled by
1/sqrt(d). The ffn is GELU-gated (flan-t5) where a layer has ffn_gate, relu (t5) otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from llamir.frontend.arch.base import (
    QK_GAIN,
    ROPE_NONE,
    ArchError,
    Architecture,
    TensorSpec,
    register_arch,
    require_rms_eps,
)
from llamir.frontend.hparams import ArchHParams
from llamir.frontend.weights import Weights

LLAMA_TOKEN_NULL = -1
SYNTH_BUCKETS = 32               # what synth writes: T5's relative_attention_num_buckets
SYNTH_DECODER_START = 0          # synth: the decoder starts from token 0 (T5 starts from its pad token)


@dataclass(frozen=True)
class T5HParams(ArchHParams):
    """t5's own hparams (hp.extra)."""

    n_rel_attn_bkts: int = SYNTH_BUCKETS               # {arch}.attention.relative_buckets_count
    dec_start_token_id: int = LLAMA_TOKEN_NULL         # {arch}.decoder_start_token_id (-1: unset)
    dec_n_layer: int = 0                               # {arch}.decoder_block_count (default: block_count)


def t5_hparams(hp) -> T5HParams:
    if not isinstance(hp.extra, T5HParams):
        raise ArchError(f"{hp.arch}: the t5 hparams (hp.extra) were not loaded")
    return hp.extra


@register_arch
class T5(Architecture):
    name = "t5"
    rope_type = ROPE_NONE
    has_encoder = True
    synth_options = frozenset({"n_dec_layer", "gated_ffn"})

    def load_hparams(self, f, hp) -> None:
        """llama_model_t5::load_arch_hparams, with what would abort llama.cpp refused: the bucket
        formula needs 4 <= buckets < 256 (it divides by log(128 / max_exact)), q is shaped by the
        KV heads (n_head_kv == n_head), k and v heads agree, and the decoder's blocks have KV cells
        only up to block_count (the cache is made for the encoder's block count)."""
        meta, key = f.metadata, f"{hp.arch}."
        require_rms_eps(f, hp)
        n_bkts = meta.get_u32(key + "attention.relative_buckets_count", required=True)
        start = meta.get_u32(key + "decoder_start_token_id")
        dec_n_layer = meta.get_u32(key + "decoder_block_count", hp.n_layer)
        if not 4 <= n_bkts < 256:
            raise ArchError(f"{f.path}: {key}attention.relative_buckets_count = {n_bkts}: llama.cpp's relative "
                            "position buckets need 4 <= count < 256 (it divides by zero otherwise)")
        if any(h != hkv for h, hkv in zip(hp.n_head_arr, hp.n_head_kv_arr, strict=True)):
            raise ArchError(f"{f.path}: t5 needs head_count_kv == head_count (its q is shaped by the KV heads), got "
                            f"{hp.n_head_kv_arr[0]} and {hp.n_head_arr[0]}")
        if hp.n_embd_head_k != hp.n_embd_head_v:   # GGML_ASSERT in both graphs
            raise ArchError(f"{f.path}: t5 needs key_length == value_length, got {hp.n_embd_head_k} and "
                            f"{hp.n_embd_head_v}")
        if not 0 < dec_n_layer <= hp.n_layer:
            raise ArchError(f"{f.path}: {key}decoder_block_count = {dec_n_layer}: llama.cpp's KV cache has the "
                            f"{hp.n_layer} blocks of block_count, so the decoder needs 1..{hp.n_layer}")
        hp.extra = T5HParams(n_rel_attn_bkts=n_bkts, dec_n_layer=dec_n_layer,
                             dec_start_token_id=LLAMA_TOKEN_NULL if start is None else start)

    def tensor_specs(self, hp):
        """load_arch_tensors: the encoder's blocks (enc.blk.N), the decoder's (dec.blk.N) and the
        shared token embedding. Every relative-bias table is optional to llama.cpp's loader, but
        layer 0's is read by every layer without one (llama.cpp crashes without it), so it is
        required here; the cross-attention's table is loaded and never used."""
        t5, e, v = t5_hparams(hp), hp.n_embd, hp.n_vocab
        specs = [TensorSpec("token_embd.weight", (v, e)), TensorSpec("enc.output_norm.weight", (e,)),
                 TensorSpec("dec.output_norm.weight", (e,)),
                 TensorSpec("output.weight", (v, e), required=False, gain=3.0, synth=True)]
        for il in range(hp.n_layer):
            specs += self._block_specs(hp, t5, f"enc.blk.{il}.", il, cross=False)
        for il in range(t5.dec_n_layer):
            specs += self._block_specs(hp, t5, f"dec.blk.{il}.", il, cross=True)
        return specs

    @staticmethod
    def _block_specs(hp, t5: T5HParams, p: str, il: int, cross: bool) -> list[TensorSpec]:
        e, f, n_k, n_v = hp.n_embd, hp.n_ff(il), hp.n_embd_k_gqa(il), hp.n_embd_v_gqa(il)
        # scores are not scaled by 1/sqrt(d): q and k are drawn smaller so they keep a std of ~2
        qk_gain = QK_GAIN / hp.n_embd_head_k ** 0.25
        rel_b = TensorSpec(p + "attn_rel_b.weight", (t5.n_rel_attn_bkts, hp.n_head(il)), required=il == 0,
                           init="embedding", storage="f32", synth=il == 0)

        def attention(prefix: str) -> list[TensorSpec]:
            return [TensorSpec(p + f"{prefix}_q.weight", (n_k, e), gain=qk_gain),
                    TensorSpec(p + f"{prefix}_k.weight", (n_k, e), gain=qk_gain),
                    TensorSpec(p + f"{prefix}_v.weight", (n_v, e)), TensorSpec(p + f"{prefix}_o.weight", (e, n_v))]

        specs = [TensorSpec(p + "attn_norm.weight", (e,)), rel_b, *attention("attn")]
        if cross:
            specs += [TensorSpec(p + "cross_attn_norm.weight", (e,)),
                      TensorSpec(p + "cross_attn_rel_b.weight", (t5.n_rel_attn_bkts, hp.n_head(il)), required=False,
                                 init="embedding", storage="f32"),
                      *attention("cross_attn")]
        return specs + [TensorSpec(p + "ffn_norm.weight", (e,)),
                        TensorSpec(p + "ffn_gate.weight", (f, e), required=False, synth=True),
                        TensorSpec(p + "ffn_down.weight", (e, f)), TensorSpec(p + "ffn_up.weight", (f, e))]

    def build(self, g) -> None:
        """The encoder graph for encode(), the decoder graph otherwise (build_arch_graph)."""
        if g.config.gtype == "encoder":
            self.build_encoder(g)
        else:
            self.build_decoder(g)

    # -- the two graphs -----------------------------------------------------------------------------
    def build_encoder(self, g) -> None:
        hp, b, t5 = g.hp, g.b, t5_hparams(g.hp)
        x = g.inp_embd()                                                               # [T, E]
        buckets = g.inp_pos_bucket(t5.n_rel_attn_bkts)                                 # [T, T]
        out_ids = g.inp_out_ids()                                                      # [n_out]
        table0 = None
        for il in g.layers():
            L = Weights(g, f"enc.blk.{il}.")
            cur = g.norm(x, L.attn_norm, name=("attn_norm", il))
            q, k, v = self.qkv(g, il, L, cur)                                          # [T, H, d]
            table, table0 = self.rel_tables(L, il, table0)
            kq_b = g.pos_bias(buckets, table, il)                                      # [H, T, T]
            cur = g.attn(il, q, k, v, L.attn_o, None, 1.0, kq_b)                       # [T, E]
            if il == hp.n_layer - 1:  # only the rows that produce outputs go on
                cur, x = b.get_rows(cur, out_ids), b.get_rows(x, out_ids)             # [n_out, E]
            x = b.add(cur, x, name=("ffn_inp", il))
            x = g.cvec(b.add(self.ffn(g, il, L, x), x), il, name=("l_out", il))
        hidden = g.norm(x, g.weights["enc.output_norm.weight"])                       # [n_out, E]
        g.finish(hidden, None, embd=True)                                              # the decoder's input

    def build_decoder(self, g) -> None:
        b, t5 = g.b, t5_hparams(g.hp)
        x = g.inp_embd()                                                               # [T, E]
        embd_enc = g.inp_cross_embd()                                                  # [n_enc, E]
        buckets = g.inp_pos_bucket(t5.n_rel_attn_bkts)                                 # [T, n_kv]
        out_ids = g.inp_out_ids()                                                      # [n_out]
        table0 = None
        for il in g.layers(t5.dec_n_layer):
            L = Weights(g, f"dec.blk.{il}.")
            cur = g.norm(x, L.attn_norm, name=("attn_norm", il))
            q, k, v = self.qkv(g, il, L, cur)                                          # [T, H, d]
            table, table0 = self.rel_tables(L, il, table0)
            kq_b = g.pos_bias(buckets, table, il)                                      # [H, T, n_kv]
            cur = g.attn(il, q, k, v, L.attn_o, None, 1.0, kq_b)                       # [T, E]
            x = b.add(cur, x, name=("cross_inp", il))
            cur = g.norm(x, L.cross_attn_norm, name=("attn_norm_cross", il))
            q, k, v = self.qkv(g, il, L, cur, embd_enc)                                # [T | n_enc, H, d]
            cur = g.attn_cross(il, q, k, v, L.cross_attn_o, 1.0)                       # [T, E]
            if il == t5.dec_n_layer - 1:  # only the rows that produce outputs go on
                cur, x = b.get_rows(cur, out_ids), b.get_rows(x, out_ids)             # [n_out, E]
            x = b.add(cur, x, name=("ffn_inp", il))
            x = g.cvec(b.add(self.ffn(g, il, L, x), x), il, name=("l_out", il))
        hidden = g.norm(x, g.weights["dec.output_norm.weight"])                       # [n_out, E]
        g.finish(hidden, g.linear(g.output_weight(), hidden))                         # [n_out, V]

    # -- blocks -------------------------------------------------------------------------------------
    @staticmethod
    def qkv(g, il: int, L: Weights, x, kv_source=None):
        """q from x [T, E]; k and v from x too, or (cross-attention) from kv_source [n_enc, E]:
        each [rows, H, d]. The self-attention's tensors are attn_*, the cross-attention's
        cross_attn_*."""
        hp, b = g.hp, g.b
        prefix = "attn" if kv_source is None else "cross_attn"
        src = x if kv_source is None else kv_source
        d, h = hp.n_embd_head_k, hp.n_head_kv(il)
        q = b.reshape(g.linear(L[f"{prefix}_q.weight"], x), x.shape[0], h, d, name=("Qcur", il))
        k = b.reshape(g.linear(L[f"{prefix}_k.weight"], src), src.shape[0], h, d, name=("Kcur", il))
        v = b.reshape(g.linear(L[f"{prefix}_v.weight"], src), src.shape[0], h, d, name=("Vcur", il))
        return q, k, v

    @staticmethod
    def rel_tables(L: Weights, il: int, table0):
        """(the relative-bias table of block il, layer 0's): the block's own, else layer 0's. Layer
        0's is read while building layer 0, so it is placed with that layer."""
        own = L.attn_rel_b
        table0 = own if il == 0 else table0
        return (own if own is not None else table0), table0

    @staticmethod
    def ffn(g, il: int, L: Weights, x):
        """RMS norm, then the GELU-gated ffn where the layer has ffn_gate (flan-t5), relu otherwise (t5)."""
        cur = g.norm(x, L.ffn_norm, name=("ffn_norm", il))
        gate = L.ffn_gate
        return g.ffn(cur, L.ffn_up, gate, L.ffn_down, act="gelu" if gate is not None else "relu", il=il)

    # -- synthetic models ---------------------------------------------------------------------------
    def synth_check(self, spec) -> None:
        if spec.n_head_kv != spec.n_head:
            raise ValueError(f"t5 needs n_head_kv == n_head, got {spec.n_head_kv} and {spec.n_head}")
        if spec.n_dec_layer is not None and not 0 < spec.n_dec_layer <= spec.n_layer:
            raise ValueError(f"n_dec_layer={spec.n_dec_layer} must be in 1..n_layer={spec.n_layer}")

    def synth_extra(self, spec) -> T5HParams:
        return T5HParams(n_rel_attn_bkts=SYNTH_BUCKETS, dec_start_token_id=SYNTH_DECODER_START,
                         dec_n_layer=spec.n_dec_layer or spec.n_layer)

    def synth_metadata(self, w, spec) -> None:
        extra = self.synth_extra(spec)
        w.add_relative_attn_buckets_count(extra.n_rel_attn_bkts)
        w.add_decoder_start_token_id(extra.dec_start_token_id)
        if spec.n_dec_layer is not None:
            w.add_decoder_block_count(spec.n_dec_layer)
