"""Integer expressions over the run-time dims (T, n_kv, n_out, ..., and the thread count).

Shapes, byte offsets and buffer sizes of a split are known at compile time only up to these
dims, so the plan writes them as small expression trees; the native entry point evaluates each
distinct one once per call, and Python evaluates the same trees to size the arena.

    Expr = int | ("v", name) | ("+", terms) | ("*", factors) | ("max", a, b) | ("align", a, k)
         | ("//", a, k) | ("cdiv", a, k)

Sums and products are flattened, sorted and constant-folded, so equal expressions compare equal.
"""

from __future__ import annotations

from collections.abc import Mapping

from llamir.ir import dims
from llamir.ir.dims import Dim

Expr = int | tuple

NTH = "__nth"   # the number of threads running the split, a run-time value like the dims


def var(name: str) -> Expr:
    return ("v", name)


def lit(value: int) -> Expr:
    """An integer passed at run time although known now (so it does not split a kernel's key)."""
    return ("lit", value)


def _terms(op: str, e: Expr) -> tuple:
    return e[1] if isinstance(e, tuple) and e[0] == op else (e,)


def add(*parts: Expr) -> Expr:
    const, terms = 0, []
    for p in parts:
        for t in _terms("+", p):
            if isinstance(t, int):
                const += t
            else:
                terms.append(t)
    if not terms:
        return const
    if const:
        terms.append(const)
    if len(terms) == 1:
        return terms[0]
    return ("+", tuple(sorted(terms, key=repr)))


def mul(*parts: Expr) -> Expr:
    const, factors = 1, []
    for p in parts:
        for f in _terms("*", p):
            if isinstance(f, int):
                const *= f
            else:
                factors.append(f)
    if const == 0 or not factors:
        return const
    if const != 1:
        factors.append(const)
    if len(factors) == 1:
        return factors[0]
    return ("*", tuple(sorted(factors, key=repr)))


def sub(a: Expr, b: Expr) -> Expr:
    return add(a, mul(b, -1))


def max_(a: Expr, b: Expr) -> Expr:
    if isinstance(a, int) and isinstance(b, int):
        return max(a, b)
    if a == b:
        return a
    if a == 0 and _nonneg(b):
        return b
    if b == 0 and _nonneg(a):
        return a
    return ("max",) + tuple(sorted((a, b), key=repr))


def _nonneg(e: Expr) -> bool:
    if isinstance(e, int):
        return e >= 0
    if e[0] in ("v", "lit"):
        return True
    if e[0] in ("+", "*"):
        return all(_nonneg(t) for t in e[1])
    return e[0] in ("max", "align", "//", "cdiv") and _nonneg(e[1])


def align(a: Expr, k: int) -> Expr:
    """a rounded up to a multiple of k."""
    if isinstance(a, int):
        return -(-a // k) * k
    if k == 1:
        return a
    return ("align", a, k)


def floordiv(a: Expr, k: int) -> Expr:
    if isinstance(a, int):
        return a // k
    if k == 1:
        return a
    return ("//", a, k)


def cdiv(a: Expr, k: int) -> Expr:
    if isinstance(a, int):
        return -(-a // k)
    if k == 1:
        return a
    return ("cdiv", a, k)


def from_dim(d: Dim) -> Expr:
    """A dims.Dim (int or polynomial) as an expression."""
    if isinstance(d, int):
        return d
    return add(*(mul(coef, *(var(n) for n in factors)) for coef, factors in dims.terms(d)))


def prod(parts) -> Expr:
    out: Expr = 1
    for p in parts:
        out = mul(out, p)
    return out


def names(e: Expr) -> set[str]:
    if isinstance(e, int):
        return set()
    if e[0] == "v":
        return {e[1]}
    if e[0] == "lit":
        return set()
    if e[0] in ("+", "*"):
        return set().union(*(names(t) for t in e[1]))
    out = set()
    for part in e[1:]:
        if not isinstance(part, int) or e[0] == "max":
            out |= names(part)
    return out


def evaluate(e: Expr, env: Mapping[str, int]) -> int:
    if isinstance(e, int):
        return e
    op = e[0]
    if op == "v":
        return int(env[e[1]])
    if op == "lit":
        return e[1]
    if op == "+":
        return sum(evaluate(t, env) for t in e[1])
    if op == "*":
        out = 1
        for f in e[1]:
            out *= evaluate(f, env)
        return out
    if op == "max":
        return max(evaluate(e[1], env), evaluate(e[2], env))
    a = evaluate(e[1], env)
    if op == "align":
        return -(-a // e[2]) * e[2]
    if op == "//":
        return a // e[2]
    if op == "cdiv":
        return -(-a // e[2])
    raise ValueError(f"unknown expression {e!r}")


def is_const(e: Expr) -> bool:
    return isinstance(e, int)


def dim_names_of(d: Dim) -> tuple[str, ...]:
    return dims.names(d)
