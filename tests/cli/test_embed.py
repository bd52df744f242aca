"""`llamir embed`: llama-embedding's embeddings and output, against llama.cpp on the built-in
all-MiniLM-L6-v2 and on random-weight bert models."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llamir.cli import main
from llamir.cli_embed import cosine, embd_normalize
from llamir.frontend.default_model import default_embedding_model_path
from llamir.frontend.synth import SynthSpec, write_model
from llamir.testing.llama_cpp import LlamaCppOracle

SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.", "A man is riding a horse.",
             "The new movie is awesome.", "The new movie is so great."]


@pytest.fixture(scope="module")
def minilm():
    return default_embedding_model_path(progress=False)


@pytest.fixture(scope="module")
def bert_path(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("embed") / "bert.gguf", SynthSpec(arch="bert", n_layer=2))


def _json(capsys, argv) -> np.ndarray:
    assert main(["embed", *argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["object"] == "list" and [d["index"] for d in out["data"]] == list(range(len(out["data"])))
    return np.array([d["embedding"] for d in out["data"]], dtype=np.float64)


def _llama_cpp(path, texts, pooling="mean") -> np.ndarray:
    """llama.cpp's embeddings of each text alone, L2-normalised as llama-embedding does."""
    rows = []
    with LlamaCppOracle(path, n_ctx=512, embeddings=True, pooling=pooling) as o:
        for text in texts:
            tokens = o.tokenize(text, add_special=True, parse_special=True)
            assert o.decode_batch(tokens, list(range(len(tokens))), [(0,)] * len(tokens), [True] * len(tokens)) == 0
            rows.append(embd_normalize(o.embeddings_seq(0), 2))
            o.clear()
    return np.stack(rows)


@pytest.mark.llama_cpp
def test_the_default_model_gives_llama_cpps_embeddings(minilm, capsys):
    """No MODEL: all-MiniLM-L6-v2, L2-normalised; each row has cosine >= 0.9999 with llama.cpp's on
    the same GGUF, and similar sentences are closer (sentence-transformers' published behaviour)."""
    ours = _json(capsys, SENTENCES)
    theirs = _llama_cpp(minilm, SENTENCES)
    assert ours.shape == (5, 384)
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-6)
    for a, b in zip(ours, theirs, strict=True):
        assert cosine(a, b) >= 0.9999
    sim = ours @ ours.T
    assert sim[0, 1] > sim[0, 2] + 0.2 and sim[3, 4] > sim[3, 0] + 0.2


def test_text_output_is_llama_embeddings(minilm, capsys):
    assert main(["embed", str(minilm), SENTENCES[0], SENTENCES[1]]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.startswith("embedding ")]
    assert len(rows) == 2 and all(len(r.split(":")[1].split()) == 16 for r in rows)   # the first 16 of several
    assert "cosine similarity matrix:" in lines
    matrix = [line for line in lines if line.endswith("A man is e")]
    assert len(matrix) == 2 and matrix[0].split()[0] == "1.00"
    assert main(["embed", str(minilm), SENTENCES[0]]) == 0     # one text: every value
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("embedding 0:")][0]
    assert len(row.split(":")[1].split()) == 384


@pytest.mark.llama_cpp
@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_a_model_file_and_its_pooling(bert_path, capsys, pooling):
    texts = ["The capital of France is Paris.", "Hello, world!"]
    ours = _json(capsys, [str(bert_path), *texts, "--pooling", pooling])
    theirs = _llama_cpp(bert_path, texts, pooling)
    for a, b in zip(ours, theirs, strict=True):
        assert cosine(a, b) >= 0.9999


def test_pooling_none_prints_every_token(bert_path, capsys):
    assert main(["embed", str(bert_path), "Hello, world!", "--pooling", "none"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("embedding ")]
    assert len(rows) > 2 and all(" ... " in r for r in rows)
    ours = _json(capsys, [str(bert_path), "Hello, world!", "--pooling", "none", "--embd-normalize", "-1"])
    assert ours.shape == (len(rows), 64)


def test_normalisations():
    x = np.array([3.0, -4.0, 0.0], dtype=np.float32)
    assert np.allclose(embd_normalize(x, 2), [0.6, -0.8, 0.0])
    assert np.array_equal(embd_normalize(x, -1), x)
    assert np.allclose(embd_normalize(x, 0), x * 32760.0 / 4.0)
    assert np.allclose(embd_normalize(x, 3), x / np.cbrt(27 + 64))
    assert np.array_equal(embd_normalize(np.zeros(3), 2), np.zeros(3))
    assert cosine(np.zeros(3), np.zeros(3)) == 1.0 and cosine(x, np.zeros(3)) == 0.0


def test_bad_arguments_are_clear_errors(bert_path, tmp_path, capsys):
    assert main(["embed", str(tmp_path / "missing.gguf"), "text"]) == 1
    assert "model file not found" in capsys.readouterr().err
    assert main(["embed", str(bert_path)]) == 1
    assert "give at least one TEXT" in capsys.readouterr().err
    assert main(["embed", str(bert_path), "word " * 600, "--n-ctx", "64"]) == 1
    assert "more than the batch size 64" in capsys.readouterr().err
