"""Perplexity as llama-perplexity computes it, against llama.cpp scoring the same chunks.

The issue's bounds are 1% on the Q4_1 file (llama.cpp quantizes activations) and 0.1% on its
dequantized F32 rewrite; llamir emulates ggml's arithmetic, so the figures agree far closer.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import llamir
from llamir.context.perplexity import chunk_plan, perplexity
from llamir.frontend.default_model import default_model_path, smollm2_truncated

TEXT = (Path(__file__).parent.parent / "data" / "ppl_text.txt").read_text()


def _ours(model, tokens, n_ctx, n_batch, n_chunks=-1, backend="numpy"):
    bos = model.vocab.bos if model.vocab.add_bos else None

    def make(n, b, s):
        return llamir.Context(model, n_ctx=n, n_batch=b, n_ubatch=min(512, b), n_seq_max=s, flash_attn="off",
                              backend=backend)

    return perplexity(make, tokens, bos, n_ctx, n_batch, n_chunks)


def _theirs(path, model, tokens, n_ctx, n_batch, n_chunks=-1):
    oracle = pytest.importorskip("llamir.testing.llama_cpp")
    pytest.importorskip("llama_cpp")
    bos = model.vocab.bos if model.vocab.add_bos else None
    return oracle.llama_cpp_perplexity(path, tokens, bos, n_ctx, n_batch, n_chunks=n_chunks, flash_attn=False)


@pytest.mark.llama_cpp
def test_smollm2_first_layers_perplexity_is_llama_cpps_exactly():
    """The exact numpy reference gives llama.cpp's perplexity to the last bit."""
    path = smollm2_truncated(4)
    model = llamir.load_model(path)
    tokens = model.vocab.tokenize(TEXT, add_special=True, parse_special=False)
    ours = _ours(model, tokens, 128, 256, n_chunks=4)
    theirs = _theirs(path, model, tokens, 128, 256, n_chunks=4)
    assert ours.n_chunks == theirs.n_chunks == 4
    assert ours.ppl == theirs.ppl and ours.running == theirs.running


@pytest.mark.slow
@pytest.mark.llama_cpp
@pytest.mark.parametrize("dtype,bound", [(None, 0.01), ("f32", 0.001)])
def test_smollm2_full_model_perplexity_matches_llama_cpp(dtype, bound):
    """The issue's bounds: 1% on the Q4_1 file, 0.1% on its dequantized F32 rewrite (run on the
    fast numpy backend: BLAS matmuls, within float32 rounding of ggml's order)."""
    path = default_model_path(progress=False) if dtype is None else smollm2_truncated(30, dtype)
    model = llamir.load_model(path)
    tokens = model.vocab.tokenize(TEXT, add_special=True, parse_special=False)
    ours = _ours(model, tokens, 128, 512, backend="numpy-fast")
    theirs = _theirs(path, model, tokens, 128, 512)
    assert ours.n_chunks == theirs.n_chunks == len(tokens) // 128
    assert abs(ours.ppl / theirs.ppl - 1) < bound
    assert 5 < ours.ppl < 100  # a real model on real English


def test_chunk_plan_follows_llama_perplexity():
    assert chunk_plan(1012, 128, 512) == (7, 4)
    assert chunk_plan(1012, 128, 512, n_chunks=3) == (3, 4)
    with pytest.raises(ValueError, match="at least 1024 tokens"):
        chunk_plan(1012, 512, 2048)


def test_cli_perplexity(capsys, tmp_path):
    from llamir.cli import main
    from llamir.frontend.synth import SynthSpec, write_model

    path = write_model(tmp_path / "m.gguf", SynthSpec(n_layer=1))
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    assert main(["perplexity", str(path), "-f", str(text), "-c", "256", "--n-batch", "256"]) == 0
    out = capsys.readouterr().out
    assert "Final estimate: PPL = " in out
    assert main(["perplexity", str(path), "-f", str(text), "-c", "4096"]) == 1
    assert "you need at least 8192 tokens" in capsys.readouterr().err
