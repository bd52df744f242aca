"""Mirostat 1.0 and 2.0 (https://arxiv.org/abs/2007.14966), as llama-sampler.cpp does them: both
keep mu (starting at 2 tau), cut the candidates by it, draw with std::discrete_distribution over
std::mt19937(seed), and move mu by eta * (observed surprise - tau)."""

from __future__ import annotations

import numpy as np

from llamir.sampling.candidates import TokenDataArray
from llamir.sampling.floats import log2f1, logf, powf1, sum_f32, to_int
from llamir.sampling.ordering import softmax, top_k
from llamir.sampling.rng import Mt19937, check_seed, discrete_distribution, rng_seed
from llamir.sampling.sampler import Sampler, check_float, check_int

f32 = np.float32


class _MirostatBase(Sampler):
    def __init__(self, owner: str, seed: int, tau: float, eta: float):
        self.seed = check_seed(owner, seed)
        self.tau = check_float(owner, "tau", tau)
        self.eta = check_float(owner, "eta", eta)
        self.seed_cur = rng_seed(self.seed)
        self.rng = Mt19937(self.seed_cur)
        self.mu = f32(2) * self.tau

    def _draw(self, cur: TokenDataArray) -> None:
        """Select by the distribution, then mu -= eta * (-log2 p_selected - tau)."""
        idx = discrete_distribution(self.rng, cur.p)
        cur.selected = idx
        with np.errstate(all="ignore"):
            surprise = -log2f1(cur.p[idx])
            self.mu = self.mu - self.eta * (surprise - self.tau)

    def reset(self) -> None:
        self.mu = f32(2) * self.tau
        self.seed_cur = rng_seed(self.seed)
        self.rng.seed(self.seed_cur)


class Mirostat(_MirostatBase):
    """Mirostat 1.0: estimates the Zipf exponent s from the m most probable tokens, keeps the top
    k = ((s - 1) 2^mu / (1 - n_vocab^(1 - s)))^(1/s) and draws."""

    NAME = "mirostat"

    def __init__(self, n_vocab: int, seed: int, tau: float, eta: float, m: int = 100):
        super().__init__("Mirostat", seed, tau, eta)
        self.n_vocab = check_int("Mirostat", "n_vocab", n_vocab, 1)
        self.m = check_int("Mirostat", "m", m, 1)

    def apply(self, cur: TokenDataArray) -> None:
        softmax(cur, True)
        n = min(self.m - 1, cur.size - 1)
        i = np.arange(n)
        with np.errstate(all="ignore"):
            t = logf((i + 2).astype(f32) / (i + 1).astype(f32))
            b = logf(cur.p[:n] / cur.p[1:n + 1])
            s_hat = sum_f32(t * b) / sum_f32(t * t)
            epsilon_hat = s_hat - f32(1)
            k = powf1((epsilon_hat * powf1(2, self.mu)) / (f32(1) - powf1(f32(self.n_vocab), -epsilon_hat)),
                      f32(1) / s_hat)
        top_k(cur, max(to_int(k), 1))
        softmax(cur, True)
        self._draw(cur)

    def clone(self) -> Mirostat:
        twin = Mirostat(self.n_vocab, self.seed, self.tau, self.eta, self.m)
        twin.mu, twin.rng = self.mu, self.rng.copy()
        return twin


class MirostatV2(_MirostatBase):
    """Mirostat 2.0: keeps the candidates whose surprise -log2 p is at most mu (at least one) and draws."""

    NAME = "mirostat-v2"

    def __init__(self, seed: int, tau: float, eta: float):
        super().__init__("MirostatV2", seed, tau, eta)

    def apply(self, cur: TokenDataArray) -> None:
        softmax(cur, True)
        cur.truncate(max(_first_surprise_above(cur.p, self.mu), 1))
        softmax(cur, True)
        self._draw(cur)

    def clone(self) -> MirostatV2:
        twin = MirostatV2(self.seed, self.tau, self.eta)
        twin.mu, twin.rng = self.mu, self.rng.copy()
        return twin


def _first_surprise_above(p: np.ndarray, mu: np.float32) -> int:
    """The first i with -log2f(p_i) > mu (len(p) if none). float64's log2 decides every case more than
    a few float ulps from mu; the close (and NaN) ones are asked of libm's log2f itself."""
    with np.errstate(all="ignore"):
        approx = -np.log2(p.astype(np.float64))
    margin = np.abs(approx) * 2.0**-20 + 2.0**-120
    above = approx > float(mu) + margin
    unsure = ~above & ~(approx < float(mu) - margin)
    for i in np.flatnonzero(above | unsure).tolist():
        if above[i] or -log2f1(p[i]) > mu:
            return i
    return len(p)
