"""The samplers that pick, rescale or bias: greedy, dist, temp, temp_ext (dynamic temperature) and
logit_bias, as llama-sampler.cpp does them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from llamir.sampling.candidates import TokenDataArray
from llamir.sampling.floats import exp_double, expf, fold_max, logf, logf1, powf1, sum_f32, sum_f64
from llamir.sampling.ordering import first_max_index, softmax, temperature
from llamir.sampling.rng import LLAMA_DEFAULT_SEED, Mt19937, canonical_double, check_seed, rng_seed
from llamir.sampling.sampler import Sampler, check_float, check_int

f32, f64 = np.float32, np.float64


class Greedy(Sampler):
    """Selects the first candidate with the highest logit (ties: the earliest in the array)."""

    NAME = "greedy"

    def apply(self, cur: TokenDataArray) -> None:
        cur.selected = first_max_index(cur.logits) if cur.size else 0


class Dist(Sampler):
    """Draws from softmax(logits) with std::mt19937(seed): p_i = expf(l_i - max) / sum in float, the
    sum in double; one canonical double u picks the first i whose running sum reaches u * sum.
    seed = LLAMA_DEFAULT_SEED (0xFFFFFFFF) draws a random seed (again on every reset)."""

    NAME = "dist"

    def __init__(self, seed: int = LLAMA_DEFAULT_SEED):
        self.seed = check_seed("Dist", seed)
        self.seed_cur = rng_seed(self.seed)
        self.rng = Mt19937(self.seed_cur)

    def apply(self, cur: TokenDataArray) -> None:
        if cur.size == 0:
            cur.selected = -1
            return
        cur.selected = 0
        if cur.size == 1:
            canonical_double(self.rng)          # one draw per output, as the backend sampler takes
            cur.p[0] = 1.0
            return
        max_l = cur.logits[0] if cur.sorted else fold_max(cur.logits[1:], cur.logits[0])
        with np.errstate(all="ignore"):
            p = expf(cur.logits - max_l).astype(f64)
        sum_cum = sum_f64(p)
        target = sum_cum * canonical_double(self.rng)
        hits = np.flatnonzero(np.add.accumulate(p) >= target)
        cur.selected = int(hits[0]) if len(hits) else cur.size - 1
        with np.errstate(all="ignore"):
            cur.p = (p / sum_cum).astype(f32)

    def reset(self) -> None:
        self.seed_cur = rng_seed(self.seed)
        self.rng.seed(self.seed_cur)

    def backend_uniform(self) -> float:
        """llama_sampler_dist's backend_set_input: the next canonical double of the same RNG, as
        the f32 the graph compares the cumulative probabilities with (one per graph run)."""
        return float(np.float32(canonical_double(self.rng)))


class Temp(Sampler):
    """logit / t; t <= 0 keeps only the first highest logit (the rest become -inf); t == 1 is off."""

    NAME = "temp"

    def __init__(self, t: float):
        self.t = check_float("Temp", "t", t)
        self.empty = self.t == 1

    def apply(self, cur: TokenDataArray) -> None:
        if not self.empty:
            temperature(cur, self.t)


class TempExt(Sampler):
    """Dynamic temperature (delta > 0): with H the entropy of softmax(logits) and H_max = ln(n),
    T = max(0, t - delta) + 2 delta (H / H_max)^exponent; then logit / T and p = exp(l - l_0) / sum
    in double. delta <= 0 is Temp(t)."""

    NAME = "temp-ext"

    def __init__(self, t: float, delta: float, exponent: float):
        self.t = check_float("TempExt", "t", t)
        self.delta = check_float("TempExt", "delta", delta)
        self.exponent = check_float("TempExt", "exponent", exponent)
        self.empty = self.t == 1 and self.delta <= 0

    def apply(self, cur: TokenDataArray) -> None:
        if self.empty:
            return
        if not self.delta > 0:
            temperature(cur, self.t)
            return
        zero = f32(0)
        min_temp = self.t - self.delta if zero < self.t - self.delta else zero   # std::max(0.0f, t - delta)
        max_temp = self.t + self.delta
        if cur.size <= 1:
            return
        max_entropy = -logf1(f32(1) / f32(cur.size))
        softmax(cur, True)
        live = cur.p[cur.p > 0]
        entropy = sum_f32(-(live * logf(live)))
        with np.errstate(all="ignore"):
            normalized = entropy / max_entropy
            dyn_temp = min_temp + (max_temp - min_temp) * powf1(normalized, self.exponent)
        temperature(cur, dyn_temp)
        with np.errstate(all="ignore"):
            p = exp_double(cur.logits.astype(f64) - f64(cur.logits[0]))
        total = sum_f64(p)
        with np.errstate(all="ignore"):
            cur.p = (p.astype(f32).astype(f64) / total).astype(f32)


class LogitBias(Sampler):
    """logit += bias for the given tokens. The candidate at index `token` is biased directly when it
    holds that token; otherwise the first bias listed for the token applies wherever it is."""

    NAME = "logit-bias"

    def __init__(self, n_vocab: int, biases: Mapping[int, float] | Iterable[tuple[int, float]]):
        self.n_vocab = check_int("LogitBias", "n_vocab", n_vocab, 1)
        pairs = list(biases.items()) if isinstance(biases, Mapping) else [tuple(b) for b in biases]
        checked = []
        for token, bias in pairs:
            token = check_int("LogitBias", "token", token, 0, self.n_vocab - 1)
            checked.append((token, check_float("LogitBias", f"bias of token {token}", bias)))
        self.biases = tuple(checked)
        self.empty = not self.biases

    def apply(self, cur: TokenDataArray) -> None:
        if self.empty:
            return
        to_search = []
        for token, bias in self.biases:
            if cur.size > token and cur.ids[token] == token:
                cur.logits[token] += bias
            else:
                to_search.append((token, bias))
        seen = set()
        for token, bias in to_search:       # each candidate takes the first matching bias
            if token not in seen:
                seen.add(token)
                cur.logits[cur.ids == token] += bias
