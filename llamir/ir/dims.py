"""Dimensions: concrete ints, or symbolic polynomials such as `T`, `4*T`, `T*n_kv` or `T+3`.

Dims that change per batch (tokens, KV cells, outputs) stay symbolic in a graph, so one graph
(and one compiled kernel) serves every batch; a binding {"T": 7} makes them concrete.
Almost every dim is a monomial (closed under products and exact division, which is what shapes,
byte strides and reshapes need); sums appear where a symbolic length is joined to a fixed one,
as Mamba's conv window (d_conv - 1 cached columns, then the ubatch's tokens).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True, slots=True)
class Sym:
    """A sum of terms coef * product(factors), in canonical order (factors sorted, repeated for
    powers; terms sorted by their factors, the constant term last); at least one term has factors
    and no coef is 0. Most dims are one term (`T`, `4*T`, `T*n_kv`); a sum comes from a concat
    of a symbolic and a fixed length (`rs_seq_tokens+3`)."""

    terms: tuple[tuple[int, tuple[str, ...]], ...]

    def __str__(self) -> str:
        parts = []
        for coef, factors in self.terms:
            body = "*".join(factors)
            parts.append(str(coef) if not factors else body if coef == 1 else f"{coef}*{body}")
        return "".join(p if i == 0 or p.startswith("-") else "+" + p for i, p in enumerate(parts))

    def __repr__(self) -> str:
        return f"Sym({self})"


Dim = int | Sym
Bindings = Mapping[str, int]


def sym(name: str) -> Sym:
    """The symbolic dim called `name`."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"invalid dim name {name!r}")
    return Sym(((1, (name,)),))


def _make(poly: Mapping[tuple[str, ...], int]) -> Dim:
    """The dim of {factors: coef} (factors sorted): an int when no term has factors."""
    terms = [(c, f) for f, c in poly.items() if c != 0]
    if not any(f for _, f in terms):
        return sum(c for c, _ in terms)
    terms.sort(key=lambda t: (not t[1], t[1]))
    return Sym(tuple(terms))


def _poly(d: Dim) -> dict[tuple[str, ...], int]:
    if isinstance(d, Sym):
        return {f: c for c, f in d.terms}
    if isinstance(d, (int,)) and not isinstance(d, bool):
        return {(): int(d)}
    raise TypeError(f"not a dim: {d!r}")


def add(a: Dim, b: Dim) -> Dim:
    out = _poly(a)
    for f, c in _poly(b).items():
        out[f] = out.get(f, 0) + c
    return _make(out)


def mul(a: Dim, b: Dim) -> Dim:
    out: dict[tuple[str, ...], int] = {}
    for fa, ca in _poly(a).items():
        for fb, cb in _poly(b).items():
            f = tuple(sorted(fa + fb))
            out[f] = out.get(f, 0) + ca * cb
    return _make(out)


def prod(dims: Iterable[Dim]) -> Dim:
    out: Dim = 1
    for d in dims:
        out = mul(out, d)
    return out


def _term_div(a: tuple[int, tuple[str, ...]], b: tuple[int, tuple[str, ...]]) -> tuple[int, tuple[str, ...]] | None:
    """The monomial a / b, or None when it is not one."""
    (ca, fa), (cb, fb) = a, b
    if cb == 0 or ca % cb or Counter(fb) - Counter(fa):
        return None
    rest = Counter(fa)
    rest.subtract(fb)
    return ca // cb, tuple(sorted(rest.elements()))


def _quotient(a: Dim, b: Dim) -> Dim | None:
    """a / b when it is a dim: every term of a over a one-term b, or a single-term quotient of
    two sums (a == q * b)."""
    pa, pb = _poly(a), _poly(b)
    terms_b = [(c, f) for f, c in pb.items() if c != 0]
    if not terms_b:
        return None
    if all(c == 0 for c in pa.values()):
        return 0
    if len(terms_b) == 1:
        out: dict[tuple[str, ...], int] = {}
        for f, c in pa.items():
            q = _term_div((c, f), terms_b[0])
            if q is None:
                return None
            out[q[1]] = out.get(q[1], 0) + q[0]
        return _make(out)
    lead_a = max(((c, f) for f, c in pa.items() if c), key=lambda t: (len(t[1]), t[1]))
    lead_b = max(terms_b, key=lambda t: (len(t[1]), t[1]))
    q = _term_div(lead_a, lead_b)
    if q is None:
        return None
    quotient = _make({q[1]: q[0]})
    return quotient if mul(quotient, b) == _make(pa) else None


def divides(b: Dim, a: Dim) -> bool:
    """Whether a / b is a dim (for one-term dims: b's factors are a sub-multiset of a's and the
    coefs divide)."""
    return _quotient(a, b) is not None


def div(a: Dim, b: Dim) -> Dim:
    """Exact division a / b; ValueError when it is not exact."""
    q = _quotient(a, b)
    if q is None:
        raise ValueError(f"{dim_str(a)} is not divisible by {dim_str(b)}")
    return q


def is_concrete(d: Dim) -> bool:
    return not isinstance(d, Sym)


def evaluate(d: Dim, bindings: Bindings) -> int:
    """The value of `d` under `bindings`; a clear error for an unbound name."""
    total = 0
    for factors, coef in _poly(d).items():
        value = coef
        for name in factors:
            if name not in bindings:
                raise KeyError(f"dim {name!r} has no value (bound: {dict(bindings)})")
            value *= int(bindings[name])
        total += value
    return total


def substitute(d: Dim, bindings: Bindings) -> Dim:
    """`d` with the bound names replaced by their values (others stay symbolic)."""
    out: dict[tuple[str, ...], int] = {}
    for factors, coef in _poly(d).items():
        kept = []
        for name in factors:
            if name in bindings:
                coef *= int(bindings[name])
            else:
                kept.append(name)
        out[tuple(kept)] = out.get(tuple(kept), 0) + coef
    return _make(out)


def names(d: Dim) -> tuple[str, ...]:
    """The names `d` is made of (each once, sorted)."""
    return tuple(sorted({n for factors in _poly(d) for n in factors}))


def terms(d: Dim) -> tuple[tuple[int, tuple[str, ...]], ...]:
    """(coef, factors) of each term: one for an int or a monomial."""
    return d.terms if isinstance(d, Sym) else ((int(d), ()),)


def dim_str(d: Dim) -> str:
    return str(d)


_COUNT = re.compile(r"[0-9]{1,19}", re.ASCII)   # a dim is a size: >= 0, and ggml's ne[] are int64
INT64_MAX = 2**63 - 1


def _parse_term(text: str, part_of: str) -> tuple[int, tuple[str, ...]]:
    coef, factors = 1, []
    for part in text.split("*"):
        part = part.strip()
        if _COUNT.fullmatch(part):
            coef *= int(part)
            if coef > INT64_MAX:
                raise ValueError(f"invalid dim {part_of[:40]!r}: its coefficient does not fit in int64")
        elif _NAME.fullmatch(part):
            factors.append(part)
        else:
            raise ValueError(f"invalid dim {part_of[:40]!r}: {part[:40]!r} is neither a count nor a name")
    return coef, tuple(sorted(factors))


def parse_dim(text: str) -> Dim:
    """Inverse of dim_str: "576", "T", "4*T", "T*n_kv", "rs_seq_tokens+3". ValueError for anything
    else, including negative counts and coefficients past int64."""
    text = text.strip()
    out: dict[tuple[str, ...], int] = {}
    for part in text.split("+"):
        coef, factors = _parse_term(part, text)
        out[factors] = out.get(factors, 0) + coef
    return _make(out)


def broadcast_ok(small: Dim, big: Dim) -> bool:
    """ggml_can_repeat for one axis: `small` tiles `big` a whole number of times."""
    return small == 1 or small == big or divides(small, big)
