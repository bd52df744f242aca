"""`llamir tokenize` and load_model(vocab_only=True) on all 19 vocab files of llama.cpp's tree, whatever
their architecture (gpt2, phi3, starcoder2, bert, command-r, nomic-bert-moe, ...), against llama.cpp's
tokenizer on the same text and against the files' own .inp/.out vectors.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path

import llama_cpp  # noqa: F401  (the oracle: a missing llama-cpp-python fails this module, never skips it)
import pytest
from tokenizer_corpus import CORPUS, random_strings
from tokenizer_fixtures import (
    ALL_VOCABS,
    LARGE,
    WITH_VECTORS,
    oracle,
    read_vectors,
)

from llamir.cli import main
from llamir.frontend.arch import ARCHS
from llamir.frontend.gguf_file import read_metadata
from llamir.frontend.model import ModelError, load_model

pytestmark = pytest.mark.llama_cpp


def _names(names: list[str]) -> list:
    return [pytest.param(n, marks=pytest.mark.slow) if n in LARGE else n for n in names]


# every corner of the corpus in one argument (a vocab load per call is the cost here), ending in
# argv's surrogate escapes of the invalid UTF-8 bytes ff e2 82
CLI_TEXT = "\n".join([*CORPUS, *random_strings(40, seed=11), "invalid \udcff\udce2\udc82 bytes"])
N_VECTORS = 3   # vectors per file through the CLI (test_tokenizer.py checks all of them on the Vocab)


def cli_ids(capsys: pytest.CaptureFixture[str], path: Path, text: str, *flags: str) -> list[int]:
    capsys.readouterr()
    status = main(["tokenize", str(path), text, "--ids", *flags])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    return json.loads(captured.out)


@pytest.mark.parametrize("name", _names(ALL_VOCABS))
def test_vocab_only_load_takes_any_architecture(vocab_dir: Path, name: str) -> None:
    path = vocab_dir / f"ggml-vocab-{name}.gguf"
    model, llama = load_model(path, vocab_only=True), oracle(path)
    buf = ctypes.create_string_buffer(256)
    assert llama.lib.llama_model_meta_val_str(llama.llm.model, b"general.architecture", buf, 256) > 0
    assert model.arch_name == buf.value.decode() and model.vocab_only
    assert model.vocab.n_tokens == llama.n_tokens and model.hparams is None
    with pytest.raises(ModelError, match="vocab-only"):
        model.build_graph(None)


@pytest.mark.parametrize("name", ALL_VOCABS)
def test_a_full_load_names_an_architecture_llamir_cannot_build(vocab_dir: Path, name: str) -> None:
    path = vocab_dir / f"ggml-vocab-{name}.gguf"
    arch = read_metadata(path)["general.architecture"]
    with pytest.raises(ModelError) as err:
        load_model(path)        # a vocab file has no weights: no full load can succeed
    if arch in ARCHS:
        assert "missing tensor 'token_embd.weight'" in str(err.value)
    else:
        assert f"unknown model architecture '{arch}'" in str(err.value)
        assert "load_model(path, vocab_only=True) reads the vocab of any architecture" in str(err.value)


def test_most_of_llama_cpps_vocab_files_are_of_architectures_llamir_cannot_build(vocab_dir: Path) -> None:
    archs = {n: read_metadata(vocab_dir / f"ggml-vocab-{n}.gguf")["general.architecture"] for n in ALL_VOCABS}
    assert sum(a not in ARCHS for a in archs.values()) == 8, archs   # 12 before gpt2, phi3, starcoder2 and bert


@pytest.mark.parametrize("name", _names(ALL_VOCABS))
def test_cli_tokenize_is_llama_cpps(vocab_dir: Path, name: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = vocab_dir / f"ggml-vocab-{name}.gguf"
    raw = CLI_TEXT.encode("utf-8", "surrogateescape")
    for flags, add, parse in (((), True, True), (("--no-bos", "--no-parse-special"), False, False)):
        want, got = oracle(path).tokenize(raw, add, parse), cli_ids(capsys, path, CLI_TEXT, *flags)
        first = next((i for i, (w, g) in enumerate(zip(want, got)) if w != g), min(len(want), len(got)))
        assert got == want, f"{' '.join(flags)}: from token {first}: want {want[first:first + 8]}, " \
                            f"got {got[first:first + 8]} ({len(want)} and {len(got)} tokens)"


@pytest.mark.parametrize("name", _names(WITH_VECTORS))
def test_cli_tokenize_reproduces_the_test_vectors(vocab_dir: Path, name: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = vocab_dir / f"ggml-vocab-{name}.gguf"
    vectors = read_vectors(path)
    longest = max(range(len(vectors)), key=lambda i: len(vectors[i][0]))
    picked = sorted({longest, *range(0, len(vectors), max(1, len(vectors) // (N_VECTORS - 1)))})
    wrong = []
    for i in picked:
        text, want = vectors[i]
        got = cli_ids(capsys, path, text.decode("utf-8", "surrogateescape"), "--no-bos", "--no-parse-special")
        if got != want:
            wrong.append(f"vector {i} {text[:60]!r}: want {want}, got {got}")
    assert not wrong, "\n".join(wrong)


def test_console_script_tokenizes_a_vocab_llamir_cannot_run(vocab_dir: Path) -> None:
    path = vocab_dir / "ggml-vocab-nomic-bert-moe.gguf"       # nomic-bert-moe, UGM tokenizer
    text = "Hello  world <mask>!"
    run = [sys.executable, "-m", "llamir.cli", "tokenize", str(path), text]
    ids = json.loads(subprocess.run([*run, "--ids"], capture_output=True, text=True, check=True).stdout)
    assert ids == oracle(path).tokenize(text.encode(), True, True)
    lines = subprocess.run(run, capture_output=True, text=True, check=True).stdout.splitlines()
    pieces = [oracle(path).token_to_piece(t, 0, True).decode() for t in ids]
    assert lines == [f"{t:6d} -> {p!r}" for t, p in zip(ids, pieces, strict=True)]
