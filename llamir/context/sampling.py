"""Token samplers after llama.cpp's llama_sampler chain: greedy, or top-k -> top-p -> min-p ->
temperature -> a seeded draw (the order common/sampling.cpp uses by default)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class SamplerParams:
    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None


class Sampler:
    """sample(logits) -> token id. temp <= 0 is greedy (argmax)."""

    def __init__(self, params: SamplerParams | None = None):
        self.params = params or SamplerParams()
        self.rng = np.random.default_rng(self.params.seed)

    def sample(self, logits: np.ndarray) -> int:
        p = self.params
        logits = np.asarray(logits, dtype=np.float32)
        if p.temp <= 0:
            return int(np.argmax(logits))
        ids = np.argsort(-logits, kind="stable")
        if p.top_k > 0:
            ids = ids[: p.top_k]
        vals = logits[ids].astype(np.float64)
        probs = _softmax(vals)
        if 0 < p.top_p < 1:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
            ids, vals = ids[:keep], vals[:keep]
            probs = _softmax(vals)
        if p.min_p > 0:
            keep = probs >= p.min_p * probs[0]
            ids, vals = ids[keep], vals[keep]
        probs = _softmax(vals / p.temp)
        return int(ids[self.rng.choice(len(ids), p=probs)])


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()
