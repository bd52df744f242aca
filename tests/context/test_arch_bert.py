"""bert (llamir/frontend/arch/bert.py) against llama.cpp on random-weight GGUF files: pooled (mean,
cls, last, rank) and per-token embeddings of one and of two sequences in a batch, bit-exact on the
numpy reference and the LLVM backend, through encode() and decode() (a model without memory
encodes); the loader's refusals and the encoder's bad-batch errors."""

from __future__ import annotations

import dataclasses
import functools
import struct

import numpy as np
import pytest

import llamir
from llamir.frontend.arch import ARCHS
from llamir.frontend.arch.bert import QKV_FUSED_SPLIT_BIAS, Bert, BertHParams
from llamir.frontend.synth import SynthSpec, write_model
from llamir.testing.llama_cpp import LlamaCppOracle, oracle_numerics

pytestmark = pytest.mark.llama_cpp

TOKENS = [5, 6, 7, 8, 9, 10, 11, 12]           # two sequences in one batch
POS = [0, 1, 2, 3, 4, 0, 1, 2]
SEQS = [(0,)] * 5 + [(1,)] * 3
ONE = [40, 41, 42, 43, 44, 45]                  # one sequence
POOLINGS = ["none", "mean", "cls", "last", "rank"]
CASES = [("f32", False), ("q8_0", False), ("f32", True), ("q8_0", True)]
CASE_IDS = [f"{dtype}-{'fused' if fused else 'qkv'}" for dtype, fused in CASES]
N_CTX_TRAIN = 512


@pytest.fixture(scope="module")
def bert_path(tmp_path_factory):
    """bert_path(dtype, fused): a synthetic bert GGUF, written once per module."""
    root = tmp_path_factory.mktemp("bert")

    @functools.cache
    def make(dtype: str, fused: bool):
        spec = SynthSpec(arch="bert", n_layer=2, n_ctx_train=N_CTX_TRAIN, dtype=dtype, fused_qkv=fused, seed=3)
        return write_model(root / f"bert-{dtype}-{fused}.gguf", spec)

    return make


def _batch(tokens, pos, seqs):
    return llamir.Batch(tokens=tokens, pos=pos, seq_ids=seqs)


def _read(ctx, pooling: str, n_tokens: int, seq_ids) -> np.ndarray:
    """Per-token rows (pooling none) through get_embeddings_ith, else one pooled row per sequence."""
    if pooling == "none":
        return np.stack([ctx.get_embeddings_ith(i) for i in range(n_tokens)])
    return np.stack([ctx.get_embeddings_seq(s) for s in seq_ids])


def _ours(path, pooling, tokens, pos, seqs, *, call="decode", backend="numpy", flash_attn="off"):
    ctx = llamir.Context(llamir.load_model(path), n_ctx=256, n_seq_max=2, embeddings=True, pooling_type=pooling,
                         flash_attn=flash_attn, backend=backend, numerics=oracle_numerics())
    status = getattr(ctx, call)(_batch(tokens, pos, seqs))
    assert status == 0, ctx.last_error
    return _read(ctx, pooling, len(tokens), sorted({s for ids in seqs for s in ids}))


@functools.lru_cache(maxsize=64)
def _theirs(path, pooling, tokens, pos, seqs, call="decode", flash_attn=False) -> np.ndarray:
    with LlamaCppOracle(path, n_ctx=256, n_seq_max=2, embeddings=True, pooling=pooling, flash_attn=flash_attn) as o:
        if call == "decode":
            assert o.decode_batch(tokens, pos, seqs, [True] * len(tokens)) == 0
        else:
            assert o.encode_batch(tokens, pos, seqs) == 0
        if pooling == "none":
            return np.stack([o.embeddings_ith(i) for i in range(len(tokens))])
        seq_ids = sorted({s for ids in seqs for s in ids})
        if pooling == "rank":   # n_cls_out floats per sequence
            n_cls = int(o._lib.llama_model_n_cls_out(o._model))
            return np.stack([np.ctypeslib.as_array(o._lib.llama_get_embeddings_seq(o._ctx, s), shape=(n_cls,)).copy()
                             for s in seq_ids])
        return np.stack([o.embeddings_seq(s) for s in seq_ids])


def _both(path, pooling, tokens=TOKENS, pos=POS, seqs=SEQS, **ours):
    key = (str(path), pooling, tuple(tokens), tuple(pos), tuple(tuple(s) for s in seqs))
    theirs = _theirs(*key, call=ours.get("call", "decode"), flash_attn=ours.get("flash_attn", "off") == "on")
    return _ours(path, pooling, tokens, pos, seqs, **ours), theirs


@pytest.mark.parametrize("backend", ["numpy", "llvm"])
@pytest.mark.parametrize("pooling", POOLINGS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_two_sequences_in_one_batch_equal_llama_cpp(bert_path, nmse, case, pooling, backend):
    ours, theirs = _both(bert_path(*case), pooling, backend=backend)
    assert np.isfinite(theirs).all() and theirs.std() > 0.01
    assert nmse(ours, theirs) == 0.0


BATCHES = {"one": (ONE, list(range(len(ONE))), [(0,)] * len(ONE)), "two": (TOKENS, POS, SEQS)}


@pytest.mark.parametrize("call", ["encode", "decode"])
@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("pooling", ["none", "mean", "cls"])
@pytest.mark.parametrize("case", CASES[1::2], ids=CASE_IDS[1::2])
def test_encode_and_decode_equal_llama_cpps_encode(bert_path, nmse, case, pooling, batch, call):
    """llama_encode on llama.cpp's side too (its llama_decode on a model without memory calls it)."""
    ours, theirs = _both(bert_path(*case), pooling, *BATCHES[batch], call=call)
    assert nmse(ours, theirs) == 0.0


@pytest.mark.parametrize("pooling", ["none", "mean"])
def test_flash_attention_equals_llama_cpps(bert_path, nmse, pooling):
    ours, theirs = _both(bert_path("q8_0", True), pooling, flash_attn="on")
    assert nmse(ours, theirs) == 0.0


def test_the_public_api_defaults_give_llama_cpps_embeddings(bert_path, nmse):
    """Context(model, embeddings=True, pooling_type="mean") on the LLVM backend with the host's
    numerics and flash attention auto (on, as in llama.cpp on a CPU): encode and decode agree."""
    path = bert_path("q8_0", False)
    model = llamir.load_model(path)
    ctx = llamir.Context(model, embeddings=True, pooling_type="mean")
    assert ctx.memory is None and not ctx.cparams.causal_attn
    assert ctx.encode(llamir.Batch.from_tokens(ONE)) == 0, ctx.last_error
    encoded = ctx.get_embeddings_seq(0).copy()
    assert ctx.decode(llamir.Batch.from_tokens(ONE)) == 0, ctx.last_error
    np.testing.assert_array_equal(ctx.get_embeddings_seq(0), encoded)
    theirs = _theirs(str(path), "mean", tuple(ONE), tuple(range(len(ONE))), ((0,),) * len(ONE), flash_attn=True)
    assert nmse(encoded[None], theirs) < 1e-10


def test_the_models_pooling_and_attention_are_the_defaults(bert_path):
    model = llamir.load_model(bert_path("f32", False))
    hp = model.hparams
    assert (hp.causal_attn, hp.pooling_type, hp.f_norm_eps) == (False, "mean", pytest.approx(1e-5))
    assert hp.extra == BertHParams(n_token_types=2, n_cls_out=1, qkv=("separate", "separate"))
    ctx = llamir.Context(model, embeddings=True, backend="numpy")
    assert ctx.cparams.pooling_type == "mean" and ctx.memory is None
    assert ctx.decode(llamir.Batch.from_tokens(ONE)) == 0, ctx.last_error
    assert ctx.get_embeddings_seq(0).shape == (hp.n_embd,)


def test_negative_indices_count_back_from_the_last_token(bert_path):
    model = llamir.load_model(bert_path("f32", False))
    ctx = llamir.Context(model, n_seq_max=2, embeddings=True, pooling_type="none", backend="numpy")
    assert ctx.encode(_batch(TOKENS, POS, SEQS)) == 0, ctx.last_error
    np.testing.assert_array_equal(ctx.get_embeddings_ith(-1), ctx.get_embeddings_ith(len(TOKENS) - 1))
    assert ctx.get_embeddings().shape == (len(TOKENS), model.hparams.n_embd)


# -- files of other shapes: the legacy fused-with-split-biases layout, no optional tensors, labels --


class SplitBiasBert(Bert):
    """attn_qkv without its bias, the separate q/k/v biases instead (llama.cpp concatenates them)."""

    def synth_extra(self, spec):
        return BertHParams(qkv=(QKV_FUSED_SPLIT_BIAS,) * spec.n_layer)


class BareBert(Bert):
    """Only the required tensors: no token types, no biases where they are optional, no classifier."""

    def tensor_specs(self, hp):
        return [s for s in super().tensor_specs(hp) if s.required]


class LabelledBert(Bert):
    """A ranker with three labels: cls.output has three rows."""

    def synth_extra(self, spec):
        return BertHParams(n_cls_out=3)

    def synth_metadata(self, w, spec):
        super().synth_metadata(w, spec)
        w.add_classifier_output_labels(["a", "b", "c"])


def _write_as(arch_cls, path, monkeypatch, **spec):
    """Write a synthetic 'bert' file with another Bert class's specs, then restore the real one."""
    with monkeypatch.context() as m:
        m.setitem(ARCHS, "bert", arch_cls)
        return write_model(path, SynthSpec(arch="bert", n_layer=2, n_ctx_train=N_CTX_TRAIN, seed=5, **spec))


@pytest.mark.parametrize("variant,pooling", [(SplitBiasBert, "none"), (SplitBiasBert, "mean"), (BareBert, "mean"),
                                             (BareBert, "none"), (LabelledBert, "rank")])
def test_other_file_layouts_equal_llama_cpp(tmp_path, monkeypatch, nmse, variant, pooling):
    path = _write_as(variant, tmp_path / "v.gguf", monkeypatch, dtype="q8_0")
    model = llamir.load_model(path)
    if variant is SplitBiasBert:
        assert model.hparams.extra.qkv == (QKV_FUSED_SPLIT_BIAS,) * 2 and model.has_tensor("blk.1.attn_k.bias")
    if variant is BareBert:
        assert not model.has_tensor("token_types.weight") and not model.has_tensor("blk.0.ffn_up.bias")
    ours, theirs = _both(path, pooling, backend="llvm")
    if variant is LabelledBert:
        assert ours.shape == (2, 3)   # one score per label and sequence
    assert nmse(ours, theirs) == 0.0


# -- bad input --


def test_a_batch_longer_than_n_ubatch_is_refused_and_the_outputs_stay(bert_path):
    model = llamir.load_model(bert_path("f32", False))
    ctx = llamir.Context(model, n_ubatch=8, n_batch=64, embeddings=True, pooling_type="mean", backend="numpy")
    assert ctx.encode(llamir.Batch.from_tokens(ONE)) == 0, ctx.last_error
    before = ctx.get_embeddings_seq(0).copy()
    for call in (ctx.encode, ctx.decode):
        assert call(llamir.Batch.from_tokens(list(range(5, 15)))) == -1
        assert "n_ubatch >= n_tokens (10)" in ctx.last_error
        np.testing.assert_array_equal(ctx.get_embeddings_seq(0), before)


def test_a_position_past_the_learned_ones_fails_the_batch_and_the_outputs_stay(bert_path):
    model = llamir.load_model(bert_path("f32", False))
    ctx = llamir.Context(model, n_ctx=1024, embeddings=True, pooling_type="mean", backend="numpy")
    assert ctx.encode(llamir.Batch.from_tokens(ONE)) == 0, ctx.last_error
    before = ctx.get_embeddings_seq(0).copy()
    assert ctx.encode(llamir.Batch.from_tokens([5, 6, 7], pos0=N_CTX_TRAIN - 2)) == -3
    assert "pos_embd" in ctx.last_error and f"index {N_CTX_TRAIN}" in ctx.last_error
    np.testing.assert_array_equal(ctx.get_embeddings_seq(0), before)


class NoTypeCountBert(Bert):
    def synth_metadata(self, w, spec):   # everything but tokenizer.ggml.token_type_count
        w.add_layer_norm_eps(1e-5)
        w.add_causal_attention(False)


def _without(name):
    class Missing(Bert):
        def tensor_specs(self, hp):
            return [s for s in super().tensor_specs(hp) if s.name != name]
    return Missing


@pytest.mark.parametrize("variant,message", [
    (_without("token_embd_norm.bias"), "missing tensor 'token_embd_norm.bias'"),
    (_without("position_embd.weight"), "missing tensor 'position_embd.weight'"),
    (_without("blk.1.attn_k.weight"), "missing tensor 'blk.1.attn_k.weight'"),
    (_without("blk.0.layer_output_norm.weight"), "missing tensor 'blk.0.layer_output_norm.weight'"),
    (NoTypeCountBert, "bert model needs to define token type count"),
])
def test_a_file_llama_cpp_refuses_is_refused_naming_what_is_missing(tmp_path, monkeypatch, variant, message):
    path = _write_as(variant, tmp_path / "bad.gguf", monkeypatch)
    with pytest.raises(RuntimeError, match="could not load"):
        LlamaCppOracle(path)
    with pytest.raises(llamir.ModelError, match=message):
        llamir.load_model(path)


def test_a_fused_block_missing_its_projection_is_refused(tmp_path, monkeypatch):
    """Without attn_qkv a block is read as separate q/k/v (create_tensor_qkv), so the error names
    attn_q; a fused bias left without its matrix is a tensor no bert loader reads."""
    class NoFusedProjection(Bert):
        def tensor_specs(self, hp):
            return [s for s in super().tensor_specs(hp) if not s.name.startswith("blk.1.attn_qkv.")]

    cases = [(NoFusedProjection, r"missing tensor 'blk\.1\.attn_q\.weight'"),
             (_without("blk.1.attn_qkv.weight"), r"tensor 'blk\.1\.attn_qkv\.bias' is not one the bert architecture")]
    for i, (variant, message) in enumerate(cases):
        path = _write_as(variant, tmp_path / f"bad{i}.gguf", monkeypatch, fused_qkv=True)
        with pytest.raises(RuntimeError, match="could not load"):
            LlamaCppOracle(path)
        with pytest.raises(llamir.ModelError, match=message):
            llamir.load_model(path)


def test_token_types_stored_as_f16_are_refused(tmp_path, monkeypatch):
    """llama.cpp loads such a file, then aborts in ggml's add (f32 + f16) at its first batch, so
    only llamir's side is run."""
    class F16Types(Bert):
        def tensor_specs(self, hp):
            return [dataclasses.replace(s, storage="weight") if s.name == "token_types.weight" else s
                    for s in super().tensor_specs(hp)]

    path = _write_as(F16Types, tmp_path / "f16.gguf", monkeypatch, dtype="f16")
    with pytest.raises(llamir.ModelError, match="token_types.weight is f16; its row 0 is added to f32"):
        llamir.load_model(path)


def test_synth_refuses_heads_that_do_not_tile_the_embedding(tmp_path):
    with pytest.raises(ValueError, match="bert needs head_dim \\* n_head == n_embd"):
        write_model(tmp_path / "x.gguf", SynthSpec(arch="bert", head_dim=32))
    with pytest.raises(ValueError, match="fused_qkv is a bert setting, not llama's"):
        write_model(tmp_path / "y.gguf", SynthSpec(arch="llama", fused_qkv=True))


def test_a_memory_less_context_saves_its_state_and_reports_its_memory(tmp_path):
    """An encoder keeps no memory: its state is the architecture name alone, and restores."""
    path = write_model(tmp_path / "m.gguf", SynthSpec(arch="bert", n_layer=1))
    ctx = llamir.Context(llamir.load_model(path), embeddings=True, pooling_type="mean")
    data = ctx.state_get_data()
    assert data == struct.pack("<I", 4) + b"bert"
    assert ctx.state_set_data(data) == len(data)
    assert all(v["context"] == 0 for v in ctx.memory_breakdown().values())
