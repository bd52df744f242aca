"""Helpers of the scheduler tests (a module of its own: test files import it by name)."""

from __future__ import annotations

import numpy as np

N_CTX = 64


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
