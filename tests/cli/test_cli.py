"""The `llamir` command line: each command against an independent computation."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import llamir
from llamir.cli import main
from llamir.frontend.synth import SynthSpec, write_model
from llamir.ir import parse_graph
from llamir.testing.llama_cpp import LlamaCppOracle, oracle_numerics


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("cli") / "m.gguf", SynthSpec(arch="qwen3", n_layer=2, dtype="q8_0"))


@pytest.mark.llama_cpp
@pytest.mark.parametrize("backend", ["llvm", "numpy"])
def test_logits_writes_every_position(model_path, tmp_path, capsys, backend):
    """llama.cpp's logits of the same batch, bit for bit with the oracle build's --numerics."""
    out = tmp_path / "logits.npy"
    assert main(["logits", str(model_path), "--tokens", "5,6,7,8", "--out", str(out), "--backend", backend,
                 "--numerics", oracle_numerics().name]) == 0
    got = np.load(out)
    assert got.dtype == np.float32 and got.shape == (4, 512)
    with LlamaCppOracle(model_path, n_ctx=512) as o:
        np.testing.assert_array_equal(got, o.eval_logits([5, 6, 7, 8], "batch"))


def test_logits_rejects_bad_tokens(model_path, tmp_path, capsys):
    assert main(["logits", str(model_path), "--tokens", "1,9999", "--out", str(tmp_path / "x.npy")]) == 1
    assert "token id 9999 is out of range [0, 512)" in capsys.readouterr().err
    assert main(["logits", str(model_path), "--tokens", "1,a", "--out", str(tmp_path / "x.npy")]) == 1
    assert "comma-separated integers" in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["run", "-p", "Hi", "-n", "-3"], "-n must be >= 0, got -3"),
    (["run", "-p", "Hi", "--n-parallel", "0"], "--n-parallel must be >= 1, got 0"),
    (["run", "-p", "Hi", "--n-parallel", "300"], "--n-parallel must be <= 256"),
    (["run", "-p", "Hi", "--seed", "-2"], "--seed must be in [0, 2^32) or -1"),
    (["run", "-p", "Hi", "--n-ubatch", "0"], "--n-ubatch must be >= 1, got 0"),
    (["run", "-p", "Hi", "--backend", "nope"], "unknown backend 'nope'"),
    (["run", "-p", ""], "the prompt is empty"),
    (["logits", "--tokens", "1,2", "--out", "/nonexistent/dir/x.npy"], "cannot write /nonexistent/dir/x.npy"),
])
def test_run_and_logits_refuse_bad_arguments_in_one_line(model_path, capsys, args, message):
    """Issue 9: arguments a decode path cannot use are one-line errors (exit 1), not tracebacks."""
    assert main([args[0], str(model_path), *args[1:]]) == 1
    assert message in capsys.readouterr().err


def test_graph_prints_parseable_ir(model_path, capsys):
    assert main(["graph", str(model_path)]) == 0
    text = capsys.readouterr().out
    graph = parse_graph(text)
    assert graph.dim_names == ("T", "n_kv", "n_out") and "logits" in graph.outputs
    assert main(["graph", str(model_path), "--n-tokens", "9"]) == 0
    bound = parse_graph(capsys.readouterr().out)
    assert bound.dim_names == () and bound.leaf("inp_tokens").type.shape == (9,)


@pytest.mark.parametrize("args,message", [
    (["--n-tokens", "0"], "--n-tokens must be at least 1, got 0"),
    (["--n-tokens", "-3"], "--n-tokens must be at least 1, got -3"),
    (["--n-tokens", "600"], "--n-tokens 600 is more than the context's 512 cells (--n-ctx 512)"),
    (["--n-ctx", "-1"], "--n-ctx must be >= 0 (0: the model's training context), got -1"),
    (["--n-ctx", str(10**14)], f"--n-ctx {10**14}: "),                 # no MemoryError traceback
])
def test_graph_bad_arguments_are_one_clear_line(model_path, capsys, args, message):
    """Issue 9: these leaked ValueError (negative dims), MemoryError, or printed a graph whose dims
    overflow int64, which parse_graph refuses."""
    assert main(["graph", str(model_path), *args]) == 1
    err = capsys.readouterr().err
    assert err.startswith("llamir: error: ") and message in err and err.count("\n") == 1


def test_tokenize_ids_is_a_json_list(model_path, capsys):
    assert main(["tokenize", str(model_path), "Hello world", "--ids"]) == 0
    ids = json.loads(capsys.readouterr().out)
    assert ids == llamir.load_model(model_path).vocab.tokenize("Hello world", True, True)


@pytest.mark.llama_cpp
def test_tokenize_ids_matches_llama_cpp(model_path, capsys):
    text = "<|im_start|>user 12345  spaces\tand ünïcode<|im_end|>"
    assert main(["tokenize", str(model_path), text, "--ids"]) == 0
    with LlamaCppOracle(model_path, n_ctx=256) as o:
        assert json.loads(capsys.readouterr().out) == o.tokenize(text, add_special=True, parse_special=True)


@pytest.mark.llama_cpp
def test_run_greedy_continues_the_prompt(model_path, capsys):
    """`run --temp 0` prints the prompt and llama.cpp's greedy continuation (up to an end-of-generation token)."""
    assert main(["run", str(model_path), "-p", "Hello", "-n", "5", "--temp", "0",
                 "--numerics", oracle_numerics().name]) == 0
    printed = capsys.readouterr().out
    model = llamir.load_model(model_path)
    tokens = model.vocab.tokenize("Hello", True, True)
    with LlamaCppOracle(model_path, n_ctx=2048) as o:
        greedy = o.greedy(tokens, 5)
    out = []
    for t in greedy:
        if model.vocab.is_eog(t):
            break
        out.append(t)
    assert printed == "Hello" + model.vocab.detokenize(out) + "\n"


def test_run_seeded_sampling_is_reproducible(model_path, capsys):
    args = ["run", str(model_path), "-p", "Hi", "-n", "6", "--temp", "0.9", "--seed", "3"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first


def test_chat_applies_the_template(model_path, monkeypatch, capsys):
    import io

    from llamir.cli import render_chat

    model = llamir.load_model(model_path)
    prompt = render_chat(model, [{"role": "user", "content": "hi"}])
    assert prompt.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nhi<|im_end|>" in prompt
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\nagain\n"))
    assert main(["chat", str(model_path), "-n", "4", "--temp", "0"]) == 0


def test_missing_model_is_one_line_error(tmp_path, capsys):
    assert main(["graph", str(tmp_path / "absent.gguf")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("llamir: error: model file not found") and "Traceback" not in err


def test_bad_gguf_is_one_line_error(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" * 10)
    assert main(["tokenize", str(bad), "x"]) == 1
    err = capsys.readouterr().err
    assert "bad magic" in err and "Traceback" not in err


def test_console_script_is_installed(model_path):
    res = subprocess.run(["llamir", "tokenize", str(model_path), "abc", "--ids"], capture_output=True, text=True,
                         check=True)
    assert isinstance(json.loads(res.stdout), list)


def test_run_parallel_sequences_share_the_prompt(model_path, capsys):
    assert main(["run", str(model_path), "-p", "Hi", "-n", "4", "--n-parallel", "3", "--temp", "0"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[sequence")]
    assert len(lines) == 3
    # greedy: every sequence continues the same prompt identically
    assert len({line.split("] ", 1)[1] for line in lines}) == 1


def test_run_context_shift_keeps_generating(model_path, capsys):
    args = ["run", str(model_path), "-p", "Hi", "-n", "300", "--n-ctx", "256", "--temp", "0.7", "--seed", "1"]
    assert main(args) == 0
    short = capsys.readouterr().out
    assert main(args + ["--ctx-shift", "--perf"]) == 0
    captured = capsys.readouterr()
    assert len(captured.out) > len(short)            # went past the full context
    assert "graphs reused" in captured.err and "eval time" in captured.err
