"""The llama_sampler interface, and the checks every sampler's parameters go through.

A sampler is any object with `name` (llama.cpp's name for it), `apply(cur)` (narrow or reweight a
TokenDataArray in place, maybe select one), `accept(token)` (see the token the chain picked),
`reset()` and `clone()`. `Sampler` is a convenient base, not a requirement: a Chain takes any
object with those five.

Parameters take the C types of llama.h: int32_t, size_t and uint32_t values must be integers in
range, floats must be numbers (infinities allowed, NaN not). A parameter that llama.cpp treats as
"off" (top_k <= 0, top_p >= 1, ...) gives a sampler that does nothing and is named with a leading
"?" ("?top-k"), as llama.cpp's empty samplers are.
"""

from __future__ import annotations

import copy
import math

import numpy as np

from llamir.sampling.candidates import TokenDataArray

SAMPLER_METHODS = ("apply", "accept", "reset", "clone")
_INT32 = (-(2**31), 2**31 - 1)


class Sampler:
    """Base of llamir's samplers: no-op accept and reset, clone as a deep copy of the state."""

    NAME = "sampler"
    empty = False   # llama.cpp would have built its empty sampler for these parameters

    @property
    def name(self) -> str:
        return "?" + self.NAME if self.empty else self.NAME

    def apply(self, cur: TokenDataArray) -> None:
        raise TypeError(f"{type(self).__name__} does not define apply(cur)")

    def accept(self, token: int) -> None:
        """See the token the chain picked (only samplers with a history use it)."""

    def reset(self) -> None:
        """Back to the state just after construction (a fresh random seed where the seed is random)."""

    def clone(self) -> Sampler:
        """An independent copy in the same state: it continues exactly as this one would."""
        return copy.deepcopy(self)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


def is_sampler(obj) -> bool:
    return isinstance(getattr(obj, "name", None), str) and all(callable(getattr(obj, m, None))
                                                                for m in SAMPLER_METHODS)


def check_float(owner: str, name: str, value) -> np.float32:
    """A C float parameter: any real number but NaN."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise ValueError(f"{owner}: {name} must be a number, got {value!r}")
    if math.isnan(float(value)):
        raise ValueError(f"{owner}: {name} must be a number, got nan")
    return np.float32(value)


def check_int(owner: str, name: str, value, low: int = _INT32[0], high: int = _INT32[1]) -> int:
    """An integer parameter in [low, high] (int32_t unless told)."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or not low <= int(value) <= high:
        raise ValueError(f"{owner}: {name} must be an integer in [{low}, {high}], got {value!r}")
    return int(value)


def check_size(owner: str, name: str, value) -> int:
    """A size_t parameter: an integer >= 0."""
    return check_int(owner, name, value, 0, 2**63 - 1)
