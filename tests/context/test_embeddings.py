"""Embeddings and pooling (none/mean/cls/last) against llama.cpp, and encode()."""

from __future__ import annotations

import numpy as np
import pytest

import llamir
from llamir.frontend.synth import SynthSpec, write_model
from llamir.testing.llama_cpp import LlamaCppOracle, oracle_numerics

TOKENS = [5, 6, 7, 8, 9, 10, 11, 12]
POS = [0, 1, 2, 3, 4, 0, 1, 2]
SEQS = [(0,)] * 5 + [(1,)] * 3


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("embd") / "m.gguf", SynthSpec(arch="qwen2", n_layer=2, dtype="q8_0"))


def _ours(model, pooling, causal, unified=False, encode=False, flash_attn="off", type_kv="f16", backend="numpy"):
    ctx = llamir.Context(model, n_ctx=256, n_seq_max=2, kv_unified=unified, embeddings=True, pooling_type=pooling,
                         attention_type="causal" if causal else "non-causal", flash_attn=flash_attn,
                         type_k=type_kv, type_v=type_kv, backend=backend, numerics=oracle_numerics())
    batch = llamir.Batch(tokens=TOKENS, pos=POS, seq_ids=SEQS)
    assert (ctx.encode(batch) if encode else ctx.decode(batch)) == 0, ctx.last_error
    if pooling == "none":
        return ctx.get_embeddings().copy()
    return np.stack([ctx.get_embeddings_seq(s) for s in (0, 1)])


@pytest.mark.llama_cpp
@pytest.mark.parametrize("backend", ["numpy", "llvm"])
@pytest.mark.parametrize("pooling", ["none", "mean", "cls", "last"])
@pytest.mark.parametrize("causal", [True, False])
def test_pooled_embeddings_match_llama_cpp(model_path, nmse, pooling, causal, backend):
    ours = _ours(llamir.load_model(model_path), pooling, causal, backend=backend)
    with LlamaCppOracle(model_path, n_ctx=256, n_seq_max=2, embeddings=True, pooling=pooling,
                               causal=causal) as o:
        assert o.decode_batch(TOKENS, POS, SEQS, [True] * len(TOKENS)) == 0
        if pooling == "none":
            theirs = np.stack([o.embeddings_ith(i) for i in range(len(TOKENS))])
        else:
            theirs = np.stack([o.embeddings_seq(s) for s in (0, 1)])
    assert nmse(ours, theirs) == 0.0


@pytest.mark.parametrize("pooling", ["none", "mean", "cls", "last"])
@pytest.mark.parametrize("flash_attn,type_kv", [("off", "f32"), ("on", "f16")])
def test_encode_equals_a_single_ubatch_non_causal_decode(model_path, nmse, pooling, flash_attn, type_kv):
    """encode attends over the batch itself (k/v in f32, or cast to f16 for flash attention, as
    llama.cpp does); a one-ubatch non-causal decode attends over the cache holding the same k/v."""
    model = llamir.load_model(model_path)
    decoded = _ours(model, pooling, causal=False, unified=True, flash_attn=flash_attn, type_kv=type_kv)
    encoded = _ours(model, pooling, causal=False, unified=True, encode=True, flash_attn=flash_attn)
    assert nmse(encoded, decoded) < 1e-12


def test_embedding_getters_refuse_what_was_not_computed(model_path):
    model = llamir.load_model(model_path)
    ctx = llamir.Context(model, n_ctx=256)
    assert ctx.decode(llamir.Batch.from_tokens([1, 2, 3])) == 0
    with pytest.raises(llamir.OutputError, match="embeddings are off"):
        ctx.get_embeddings()
    ctx = llamir.Context(model, n_ctx=256, embeddings=True, pooling_type="none")
    assert ctx.decode(llamir.Batch.from_tokens([1, 2, 3])) == 0
    assert ctx.get_embeddings().shape == (3, model.hparams.n_embd)   # embeddings force every token out
    with pytest.raises(llamir.OutputError, match="pooling is none"):
        ctx.get_embeddings_seq(0)
    ctx = llamir.Context(model, n_ctx=256, embeddings=True, pooling_type="mean")
    assert ctx.decode(llamir.Batch.from_tokens([1, 2, 3])) == 0
    with pytest.raises(llamir.OutputError, match="no pooled embedding for sequence 1"):
        ctx.get_embeddings_seq(1)
    for bad in ("0", [0], 0.0):
        with pytest.raises(llamir.OutputError, match="no pooled embedding for sequence"):
            ctx.get_embeddings_seq(bad)
    assert ctx.get_embeddings_seq(np.int64(0)).shape == (model.hparams.n_embd,)
