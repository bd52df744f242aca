"""The random numbers of llama.cpp's samplers: std::mt19937 and libstdc++'s distributions over it.

std::mt19937's 32-bit stream comes from numpy's MT19937 bit generator, seeded the way the C++
constructor seeds (init_genrand, not numpy's SeedSequence). On top of it, libstdc++'s
generate_canonical: a double takes two draws, (r0 + r1 * 2^32) / 2^64 with the sum rounded once to
53 bits; a float takes one, float(r0) / 2^32; a result that rounds to 1 becomes the largest value
below 1. uniform_real_distribution(0, 1) returns that value; discrete_distribution normalises its
weights in double, takes their running sums (the last one set to 1) and returns the lower_bound
of one canonical double.
"""

from __future__ import annotations

import secrets

import numpy as np

LLAMA_DEFAULT_SEED = 0xFFFFFFFF   # "pick a random seed"
_TWO_32 = 4294967296.0
_TWO_64 = 18446744073709551616.0
_BELOW_ONE_F64 = float(np.nextafter(1.0, 0.0))
_BELOW_ONE_F32 = np.nextafter(np.float32(1), np.float32(0))


def check_seed(owner: str, seed) -> int:
    """A uint32_t seed, or a ValueError naming the sampler."""
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or not 0 <= int(seed) <= 0xFFFFFFFF:
        raise ValueError(f"{owner}: seed must be an integer in [0, 2^32) (0xFFFFFFFF: random), got {seed!r}")
    return int(seed)


def rng_seed(seed: int) -> int:
    """get_rng_seed: the seed itself, or a fresh random one for LLAMA_DEFAULT_SEED."""
    return secrets.randbits(32) if seed == LLAMA_DEFAULT_SEED else seed


def _init_genrand(seed: int) -> np.ndarray:
    """std::mt19937(seed)'s state: x[0] = seed, x[i] = 1812433253 * (x[i-1] ^ (x[i-1] >> 30)) + i (mod 2^32)."""
    key = [seed & 0xFFFFFFFF]
    for i in range(1, 624):
        prev = key[-1]
        key.append((1812433253 * (prev ^ (prev >> 30)) + i) & 0xFFFFFFFF)
    return np.array(key, dtype=np.uint32)


class Mt19937:
    """std::mt19937: seed(s) restarts it, next(n) returns its next n 32-bit outputs."""

    def __init__(self, seed: int = 5489):
        self._bits = np.random.MT19937()
        self.seed(seed)

    def seed(self, seed: int) -> None:
        self._bits.state = {"bit_generator": "MT19937", "state": {"key": _init_genrand(seed), "pos": 624}}

    def next(self, n: int = 1) -> np.ndarray:
        return self._bits.random_raw(n)

    def copy(self) -> Mt19937:
        twin = Mt19937.__new__(Mt19937)
        twin._bits = np.random.MT19937()
        twin._bits.state = self._bits.state
        return twin

    def __deepcopy__(self, memo) -> Mt19937:
        return self.copy()


def canonical_double(rng: Mt19937) -> float:
    """std::generate_canonical<double, 53>: two draws, (r0 + r1 * 2^32) / 2^64 in double."""
    r0, r1 = rng.next(2)
    value = (float(r0) + float(r1) * _TWO_32) / _TWO_64
    return _BELOW_ONE_F64 if value >= 1.0 else value


def canonical_float(rng: Mt19937) -> np.float32:
    """std::generate_canonical<float, 24>: one draw, float(r0) / 2^32 in float."""
    value = np.float32(rng.next(1)[0]) / np.float32(_TWO_32)
    return _BELOW_ONE_F32 if value >= np.float32(1) else value


def lower_bound(values, x) -> int:
    """std::lower_bound: the first index whose value is not less than x (the same comparisons, so
    NaNs land where C++ puts them)."""
    first, count = 0, len(values)
    while count > 0:
        step = count // 2
        if values[first + step] < x:
            first += step + 1
            count -= step + 1
        else:
            count = step
    return first


def discrete_distribution(rng: Mt19937, weights: np.ndarray) -> int:
    """std::discrete_distribution<int>(weights)(rng). Fewer than two weights give 0 without a draw."""
    if len(weights) < 2:
        return 0
    w = np.asarray(weights, dtype=np.float64)
    total = np.add.accumulate(np.concatenate([[0.0], w]))[-1]   # std::accumulate(..., 0.0), in order
    with np.errstate(invalid="ignore", divide="ignore"):
        cumulative = np.add.accumulate(w / total)
    cumulative[-1] = 1.0
    return lower_bound(cumulative.tolist(), canonical_double(rng))
