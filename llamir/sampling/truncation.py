"""The samplers that cut the candidates down: top_k, top_p, min_p, typical, xtc and top_n_sigma,
as llama-sampler.cpp does them (float arithmetic, running sums in order, its sort orders)."""

from __future__ import annotations

import struct

import numpy as np

from llamir.sampling import stl
from llamir.sampling.candidates import TokenDataArray
from llamir.sampling.floats import fold_max, logf, logf1, running_sum_f32, sum_f32
from llamir.sampling.ordering import bucket_partial_sort, partial_sort_inplace, softmax, top_k
from llamir.sampling.rng import LLAMA_DEFAULT_SEED, Mt19937, canonical_float, check_seed, rng_seed
from llamir.sampling.sampler import Sampler, check_float, check_int, check_size

f32 = np.float32
_FLT_MAX = np.finfo(f32).max


def _first(mask: np.ndarray) -> int | None:
    hits = np.flatnonzero(mask)
    return int(hits[0]) if len(hits) else None


class TopK(Sampler):
    """The k candidates with the highest logits, sorted; k <= 0 is off."""

    NAME = "top-k"

    def __init__(self, k: int):
        self.k = check_int("TopK", "k", k)
        self.empty = self.k <= 0

    def apply(self, cur: TokenDataArray) -> None:
        if not self.empty:
            top_k(cur, self.k)


class TopP(Sampler):
    """Nucleus: the fewest highest-probability candidates whose float running sum of p reaches p
    (and at least min_keep of them); p >= 1 is off."""

    NAME = "top-p"

    def __init__(self, p: float, min_keep: int = 1):
        self.p = check_float("TopP", "p", p)
        self.min_keep = check_size("TopP", "min_keep", min_keep)
        self.empty = self.p >= 1

    def _cut(self, probs: np.ndarray, start: int, cum: np.float32) -> tuple[int | None, np.float32]:
        """Continue the running sum from `cum` over probs (positions start...): the kept count, or None."""
        sums = np.add.accumulate(np.concatenate([[cum], probs]).astype(f32))[1:]
        hit = _first((sums >= self.p) & (np.arange(start + 1, start + 1 + len(probs)) >= self.min_keep))
        return (None if hit is None else start + hit + 1), (sums[-1] if len(sums) else cum)

    def apply(self, cur: TokenDataArray) -> None:
        if self.empty:
            return
        softmax(cur, False)
        if not cur.sorted and cur.size > 1024:
            self._apply_two_phase(cur)
            return
        if not cur.sorted:
            partial_sort_inplace(cur, cur.size)
        kept, _ = self._cut(cur.p, 0, f32(0))
        cur.truncate(cur.size if kept is None else kept)

    def _apply_two_phase(self, cur: TokenDataArray) -> None:
        """Many unsorted candidates: the top 256 first, the whole array sorted only if they fall short."""
        k = 256
        order = bucket_partial_sort(cur.logits, k)
        kept, cum = self._cut(cur.p[order], 0, f32(0))
        if kept is None:
            order = bucket_partial_sort(cur.logits, cur.size)
            kept, _ = self._cut(cur.p[order[k:]], k, cum)
            kept = cur.size if kept is None else kept
        cur.take(order[:kept])
        cur.sorted = True


class MinP(Sampler):
    """Keeps candidates with logit >= max + ln p (p_i >= p * p_max), at least min_keep; p <= 0 is off."""

    NAME = "min-p"

    def __init__(self, p: float, min_keep: int = 1):
        self.p = check_float("MinP", "p", p)
        self.min_keep = check_size("MinP", "min_keep", min_keep)
        self.empty = self.p <= 0

    def apply(self, cur: TokenDataArray) -> None:
        if self.empty or cur.size == 0:
            return
        log_p = logf1(self.p)
        if not cur.sorted:
            min_logit = fold_max(cur.logits, -_FLT_MAX) + log_p
            keep = np.flatnonzero(cur.logits >= min_logit)
            if len(keep) and len(keep) >= self.min_keep:
                cur.take(keep)
                return
            partial_sort_inplace(cur, cur.size)
        min_logit = cur.logits[0] + log_p
        stop = _first((cur.logits[1:] < min_logit) & (np.arange(1, cur.size) >= self.min_keep))
        cur.truncate(cur.size if stop is None else stop + 1)


class Typical(Sampler):
    """Locally typical: candidates ordered by |-ln p_i - H| (std::sort), kept until their running
    sum of p exceeds p (and at least min_keep); p >= 1 is off. Leaves the array unsorted."""

    NAME = "typical"

    def __init__(self, p: float, min_keep: int = 1):
        self.p = check_float("Typical", "p", p)
        self.min_keep = check_size("Typical", "min_keep", min_keep)
        self.empty = self.p >= 1

    def apply(self, cur: TokenDataArray) -> None:
        if self.empty:
            return
        softmax(cur, True)
        with np.errstate(all="ignore"):
            log_p = logf(cur.p)
            entropy = sum_f32(-cur.p * log_p)
            shifted = np.abs(-log_p - entropy)
        order = stl.sort_perm(shifted)
        sums = running_sum_f32(cur.p[order])
        counted = np.arange(len(order))
        hit = _first((sums > self.p) & ((self.min_keep == 0) | (counted >= self.min_keep - 1)))
        cur.take(order[:len(order) if hit is None else hit + 1])
        cur.sorted = False


class XTC(Sampler):
    """Exclude top choices: with probability p (one canonical float per apply), drops every
    candidate whose p >= t except the least likely of them; off for p <= 0 or t > 0.5."""

    NAME = "xtc"

    def __init__(self, p: float, t: float, min_keep: int = 1, seed: int = LLAMA_DEFAULT_SEED):
        self.probability = check_float("XTC", "p", p)
        self.threshold = check_float("XTC", "t", t)
        self.min_keep = check_size("XTC", "min_keep", min_keep)
        self.seed = check_seed("XTC", seed)
        self.seed_cur = rng_seed(self.seed)
        self.rng = Mt19937(self.seed_cur)
        self.empty = self.probability <= 0 or self.threshold > 0.5

    def apply(self, cur: TokenDataArray) -> None:
        if self.empty or cur.size < 2:
            return
        if canonical_float(self.rng) > self.probability:
            return
        softmax(cur, True)
        below = _first(~(cur.p >= self.threshold))
        pos_last = max((cur.size if below is None else below) - 1, 0)
        if cur.size - pos_last >= self.min_keep and pos_last > 0:
            cur.take(np.arange(pos_last, cur.size))

    def reset(self) -> None:
        self.seed_cur = rng_seed(self.seed)
        self.rng.seed(self.seed_cur)

    def clone(self) -> XTC:
        twin = XTC(self.probability, self.threshold, self.min_keep, self.seed)
        twin.rng = self.rng.copy()
        return twin


class TopNSigma(Sampler):
    """Masks (-inf) logits below max - n * std over the finite-or-+inf logits; n <= 0 is off."""

    NAME = "top-n-sigma"

    def __init__(self, n: float):
        self.n = check_float("TopNSigma", "n", n)
        self.empty = self.n <= 0

    def apply(self, cur: TokenDataArray) -> None:
        if self.empty or cur.size <= 1:
            return
        valid = cur.logits[cur.logits != -np.inf]
        top = fold_max(valid, cur.logits[0])
        count = len(valid)
        with np.errstate(all="ignore"):
            mean = sum_f32(valid) / f32(count) if count else f32(0)
            std = np.sqrt(_sum_squares(valid - mean) / f32(count)) if count else f32(0)
            cur.logits = np.where(cur.logits < top - self.n * std, f32(-np.inf), cur.logits).astype(f32)


_F32 = struct.Struct("f")


def _sum_squares(d: np.ndarray) -> np.float32:
    """`float acc = 0; acc += pow(d_i, 2);` in order: each d_i^2 exact in double, each sum rounded to
    double and then to float."""
    pack, unpack = _F32.pack, _F32.unpack
    acc = 0.0
    for x in d.astype(np.float64).tolist():
        total = acc + x * x
        try:
            acc = unpack(pack(total))[0]
        except OverflowError:       # beyond FLT_MAX: float's +inf
            acc = float("inf")
    return f32(acc)
