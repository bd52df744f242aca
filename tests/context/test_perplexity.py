"""Perplexity as llama-perplexity computes it, against llama.cpp scoring the same chunks.

llamir runs the oracle build's numerics profile (ggml's activation quantization and accumulation
orders), so the figures are llama.cpp's exactly, on the Q4_1 file and on its F32 rewrite.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import llamir
from llamir.context.perplexity import chunk_plan, perplexity
from llamir.frontend.default_model import default_model_path, smollm2_truncated
from llamir.testing.llama_cpp import llama_cpp_perplexity, oracle_numerics

TEXT = (Path(__file__).parent.parent / "data" / "ppl_text.txt").read_text()


def _ours(model, tokens, n_ctx, n_batch, n_chunks=-1, backend="numpy"):
    bos = model.vocab.bos if model.vocab.add_bos else None

    def make(n, b, s):
        return llamir.Context(model, n_ctx=n, n_batch=b, n_ubatch=min(512, b), n_seq_max=s, flash_attn="off",
                              backend=backend, numerics=oracle_numerics())

    return perplexity(make, tokens, bos, n_ctx, n_batch, n_chunks)


def _theirs(path, model, tokens, n_ctx, n_batch, n_chunks=-1):
    bos = model.vocab.bos if model.vocab.add_bos else None
    return llama_cpp_perplexity(path, tokens, bos, n_ctx, n_batch, n_chunks=n_chunks, flash_attn=False)


@pytest.mark.llama_cpp
@pytest.mark.parametrize("backend", ["numpy", "llvm"])
def test_smollm2_first_layers_perplexity_is_llama_cpps_exactly(backend):
    """Both backends, with the oracle build's numerics, give llama.cpp's perplexity to the last bit."""
    path = smollm2_truncated(4)
    model = llamir.load_model(path)
    tokens = model.vocab.tokenize(TEXT, add_special=True, parse_special=False)
    ours = _ours(model, tokens, 128, 256, n_chunks=4, backend=backend)
    theirs = _theirs(path, model, tokens, 128, 256, n_chunks=4)
    assert ours.n_chunks == theirs.n_chunks == 4
    assert ours.ppl == theirs.ppl and ours.running == theirs.running


@pytest.mark.slow
@pytest.mark.llama_cpp
@pytest.mark.parametrize("dtype", [None, "f32"], ids=["q4_1", "f32"])
def test_smollm2_full_model_perplexity_is_llama_cpps_exactly(dtype):
    """The whole model, Q4_1 and its dequantized F32 rewrite, on the LLVM backend: every chunk's
    running perplexity is llama.cpp's to the last bit."""
    path = default_model_path(progress=False) if dtype is None else smollm2_truncated(30, dtype)
    model = llamir.load_model(path)
    tokens = model.vocab.tokenize(TEXT, add_special=True, parse_special=False)
    ours = _ours(model, tokens, 128, 512, backend="llvm")
    theirs = _theirs(path, model, tokens, 128, 512)
    assert ours.n_chunks == theirs.n_chunks == len(tokens) // 128
    assert ours.ppl == theirs.ppl and ours.running == theirs.running
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
