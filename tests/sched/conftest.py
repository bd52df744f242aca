"""Fixtures for the scheduler tests: tiny synthetic llama models and a batch's input values."""

from __future__ import annotations

import numpy as np
import pytest

import llamir
from llamir.frontend.synth import SynthSpec, write_model

N_CTX = 64


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


def batch_values(graph, n_tokens: int, n_kv: int, n_out: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs of one sequence's first batch (cells 0..T-1, causal mask) and zeroed KV caches."""
    rng = np.random.default_rng(seed)
    values: dict[str, np.ndarray] = {}
    for leaf in graph.leafs:
        shape = tuple(int(d) for d in leaf.type.shape)
        name = leaf.name
        if leaf.kind == "state":
            values[name] = np.zeros(shape, dtype=leaf.dtype.np_dtype)
        elif name == "inp_tokens":
            values[name] = rng.integers(0, 200, size=shape).astype(np.int32)
        elif name == "inp_pos":
            values[name] = np.arange(n_tokens, dtype=np.int32)
        elif name == "attn_inp_k_idxs":
            values[name] = np.arange(n_tokens, dtype=np.int64)
        elif name == "attn_inp_v_idxs":
            gqa = shape[0] // n_tokens
            t, c = np.meshgrid(np.arange(n_tokens), np.arange(gqa), indexing="ij")
            values[name] = (c * n_kv + t).reshape(-1).astype(np.int64)
        elif name == "attn_inp_kq_mask":
            mask = np.where(np.arange(n_kv)[None, :] <= np.arange(n_tokens)[:, None], 0.0, -np.inf)
            values[name] = mask.reshape(shape).astype(leaf.dtype.np_dtype)
        elif name == "inp_out_ids":
            values[name] = np.arange(n_tokens - n_out, n_tokens, dtype=np.int32)
    return values
