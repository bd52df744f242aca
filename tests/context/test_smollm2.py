"""The default model, SmolLM2-135M-Instruct (Q4_1, a real trained model), against llama.cpp; llamir
runs the oracle build's numerics profile, so the logits are bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

import llamir
from llamir.cli import main
from llamir.frontend.default_model import default_model_path, smollm2_truncated
from llamir.testing.llama_cpp import LlamaCppOracle, oracle_numerics

PROMPT = "The capital of France is Paris. The capital of Germany is"


def _greedy(model, prompt_tokens, n, backend):
    ctx = llamir.Context(model, n_ctx=512, flash_attn="off", backend=backend, numerics=oracle_numerics())
    assert ctx.decode(llamir.Batch.from_tokens(prompt_tokens)) == 0
    out = []
    for i in range(n):
        out.append(int(np.argmax(ctx.get_logits_ith(-1))))
        assert ctx.decode(llamir.Batch.from_tokens([out[-1]], pos0=len(prompt_tokens) + i)) == 0
    return out


@pytest.mark.llama_cpp
@pytest.mark.parametrize("backend", ["numpy", "llvm"])
def test_first_four_layers_match_llama_cpp(nmse, backend):
    path = smollm2_truncated(4)
    model = llamir.load_model(path)
    tokens = model.vocab.tokenize(PROMPT, add_special=True, parse_special=True)
    ctx = llamir.Context(model, n_ctx=512, flash_attn="off", backend=backend, numerics=oracle_numerics())
    assert ctx.decode(llamir.Batch.from_tokens(tokens, logits="all")) == 0
    with LlamaCppOracle(path, n_ctx=512) as o:
        theirs = o.eval_logits(tokens, "batch")
        greedy = o.greedy(tokens, 16)
    assert nmse(ctx.get_logits(), theirs) == 0.0
    assert _greedy(model, tokens, 16, backend) == greedy


@pytest.mark.slow
@pytest.mark.llama_cpp
def test_full_model_greedy_continuation_matches_llama_cpp():
    path = default_model_path(progress=False)
    model = llamir.load_model(path)
    tokens = model.vocab.tokenize("The capital of France is", add_special=True, parse_special=True)
    with LlamaCppOracle(path, n_ctx=512) as o:
        want = o.greedy(tokens, 8)
    got = _greedy(model, tokens, 8, "llvm")
    assert got == want
    assert model.vocab.detokenize(got).startswith(" Paris")


@pytest.mark.slow
def test_readme_command_prints_the_continuation(capsys):
    assert main(["run", "-p", "The capital of France is", "-n", "4", "--temp", "0"]) == 0
    assert capsys.readouterr().out.startswith("The capital of France is Paris")
