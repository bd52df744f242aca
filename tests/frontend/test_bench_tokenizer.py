"""bench/bench_tokenizer.py end to end on two small vocab files: its table reports llama.cpp's token
count for the bench text and that both engines gave the same ids."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import llama_cpp  # noqa: F401  (the oracle: a missing llama-cpp-python fails this module, never skips it)
import pytest
from tokenizer_fixtures import VocabFilesUnavailable, oracle, vocab_files_dir

BENCH = Path(__file__).parents[2] / "bench" / "bench_tokenizer.py"


def test_bench_tokenizer_prints_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("bench_tokenizer", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    try:
        paths = [vocab_files_dir() / f"ggml-vocab-{n}.gguf" for n in ("bert-bge", "nomic-bert-moe")]
    except VocabFilesUnavailable as err:   # never skip: CI must fetch them
        pytest.fail(f"llama.cpp vocab files are unavailable: {err}")
    assert bench.main([*map(str, paths), "--reps", "2", "--kib", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split() for line in lines[3:]}
    text = bench.bench_text(1)
    assert lines[0].startswith(f"text: {len(text)} bytes")
    for path, name in zip(paths, ("bert-bge", "nomic-bert-moe"), strict=True):
        assert int(rows[name][4]) == len(oracle(path).tokenize(text, True, True))
        assert rows[name][-1] == "yes"
