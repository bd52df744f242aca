"""Dimensions: concrete ints, or symbolic monomials such as `T`, `4*T` or `T*n_kv`.

Dims that change per batch (tokens, KV cells, outputs) stay symbolic in a graph, so one graph
(and one compiled kernel) serves every batch; a binding {"T": 7} makes them concrete.
Monomials are closed under products and exact division, which is all shapes, byte strides
and reshapes of an LLM graph need.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True, slots=True)
class Sym:
    """coef * product(factors); factors sorted, repeated for powers. Never factor-free."""

    coef: int
    factors: tuple[str, ...]

    def __str__(self) -> str:
        body = "*".join(self.factors)
        return body if self.coef == 1 else f"{self.coef}*{body}"

    def __repr__(self) -> str:
        return f"Sym({self})"


Dim = int | Sym
Bindings = Mapping[str, int]


def sym(name: str) -> Sym:
    """The symbolic dim called `name`."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"invalid dim name {name!r}")
    return Sym(1, (name,))


def _make(coef: int, factors: Iterable[str]) -> Dim:
    factors = tuple(sorted(factors))
    return Sym(coef, factors) if factors and coef != 0 else coef


def _parts(d: Dim) -> tuple[int, tuple[str, ...]]:
    if isinstance(d, Sym):
        return d.coef, d.factors
    if isinstance(d, (int,)) and not isinstance(d, bool):
        return int(d), ()
    raise TypeError(f"not a dim: {d!r}")


def mul(a: Dim, b: Dim) -> Dim:
    ca, fa = _parts(a)
    cb, fb = _parts(b)
    return _make(ca * cb, fa + fb)


def prod(dims: Iterable[Dim]) -> Dim:
    out: Dim = 1
    for d in dims:
        out = mul(out, d)
    return out


def divides(b: Dim, a: Dim) -> bool:
    """Whether a / b is a dim (b's factors are a sub-multiset of a's, and coefs divide)."""
    ca, fa = _parts(a)
    cb, fb = _parts(b)
    if cb == 0 or ca % cb:
        return False
    return not (Counter(fb) - Counter(fa))


def div(a: Dim, b: Dim) -> Dim:
    """Exact division a / b; ValueError when it is not exact."""
    if not divides(b, a):
        raise ValueError(f"{dim_str(a)} is not divisible by {dim_str(b)}")
    ca, fa = _parts(a)
    cb, fb = _parts(b)
    rest = Counter(fa)
    rest.subtract(fb)
    return _make(ca // cb, rest.elements())


def is_concrete(d: Dim) -> bool:
    return not isinstance(d, Sym)


def evaluate(d: Dim, bindings: Bindings) -> int:
    """The value of `d` under `bindings`; a clear error for an unbound name."""
    coef, factors = _parts(d)
    value = coef
    for name in factors:
        if name not in bindings:
            raise KeyError(f"dim {name!r} has no value (bound: {dict(bindings)})")
        value *= int(bindings[name])
    return value


def substitute(d: Dim, bindings: Bindings) -> Dim:
    """`d` with the bound names replaced by their values (others stay symbolic)."""
    coef, factors = _parts(d)
    kept = []
    for name in factors:
        if name in bindings:
            coef *= int(bindings[name])
        else:
            kept.append(name)
    return _make(coef, kept)


def names(d: Dim) -> tuple[str, ...]:
    return _parts(d)[1]


def dim_str(d: Dim) -> str:
    return str(d)


_COUNT = re.compile(r"[0-9]{1,19}", re.ASCII)   # a dim is a size: >= 0, and ggml's ne[] are int64
INT64_MAX = 2**63 - 1


def parse_dim(text: str) -> Dim:
    """Inverse of dim_str: "576", "T", "4*T", "T*n_kv". ValueError for anything else, including
    negative counts and coefficients past int64."""
    text = text.strip()
    coef, factors = 1, []
    for part in text.split("*"):
        part = part.strip()
        if _COUNT.fullmatch(part):
            coef *= int(part)
            if coef > INT64_MAX:
                raise ValueError(f"invalid dim {text[:40]!r}: its coefficient does not fit in int64")
        elif _NAME.fullmatch(part):
            factors.append(part)
        else:
            raise ValueError(f"invalid dim {text[:40]!r}: {part[:40]!r} is neither a count nor a name")
    return _make(coef, factors)


def broadcast_ok(small: Dim, big: Dim) -> bool:
    """ggml_can_repeat for one axis: `small` tiles `big` a whole number of times."""
    return small == 1 or small == big or divides(small, big)
