"""Fixtures for the scheduler tests: tiny synthetic llama models and a batch's input values."""

from __future__ import annotations

import pytest
from sched_helpers import N_CTX  # noqa: F401  (the sched tests' context size)

import llamir
from llamir.frontend.synth import SynthSpec, write_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """2 layers, tied output (like SmolLM2): token_embd doubles as the output matrix."""
    path = tmp_path_factory.mktemp("sched") / "tiny_tied.gguf"
    spec = SynthSpec(
        arch="llama", n_layer=2, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, n_vocab=300, tied=True
    )
    return llamir.load_model(write_model(path, spec))


@pytest.fixture(scope="session")
def tiny_llama_q8(tmp_path_factory):
    """2 layers, q8_0 matrices and an untied output."""
    path = tmp_path_factory.mktemp("sched") / "tiny_q8.gguf"
    spec = SynthSpec(
        arch="llama", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=96, n_vocab=320, dtype="q8_0"
    )
    return llamir.load_model(write_model(path, spec))
