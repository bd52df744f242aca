"""Symbolic dims: monomial algebra checked against integer arithmetic under random bindings."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llamir.ir import dims
from llamir.ir.dims import Sym, sym

NAMES = ["T", "n_kv", "S", "n_outputs"]
monomials = st.builds(
    lambda coef, factors: dims.prod([coef, *map(sym, factors)]),
    st.integers(1, 24), st.lists(st.sampled_from(NAMES), max_size=3))
bindings = st.fixed_dictionaries({n: st.integers(0, 50) for n in NAMES})


def test_basic_forms():
    T = sym("T")
    assert T == Sym(((1, ("T",)),)) and str(T) == "T"
    assert dims.mul(4, T) == Sym(((4, ("T",)),)) and str(dims.mul(T, 4)) == "4*T"
    assert dims.mul(sym("n_kv"), T) == dims.mul(T, sym("n_kv"))          # factors are sorted
    assert str(dims.mul(sym("n_kv"), T)) == "T*n_kv"
    assert str(dims.mul(T, T)) == "T*T"
    assert dims.mul(0, T) == 0 and isinstance(dims.mul(0, T), int)      # never a factor-free Sym
    assert dims.mul(3, 5) == 15 and dims.prod([]) == 1
    assert dims.prod([2, T, 3, T]) == Sym(((6, ("T", "T")),))


def test_division():
    T, n = sym("T"), sym("n_kv")
    assert dims.div(dims.mul(6, dims.mul(T, n)), dims.mul(3, n)) == dims.mul(2, T)
    assert dims.div(dims.mul(4, T), dims.mul(4, T)) == 1
    assert dims.div(12, 4) == 3
    assert dims.divides(2, dims.mul(4, T)) and dims.divides(T, dims.mul(T, n))
    assert not dims.divides(2, T)                   # T may be odd
    assert not dims.divides(n, T) and not dims.divides(T, 4) and not dims.divides(0, 4)
    with pytest.raises(ValueError, match=r"T is not divisible by 2"):
        dims.div(T, 2)
    with pytest.raises(ValueError, match=r"4\*T is not divisible by n_kv"):
        dims.div(dims.mul(4, T), n)


def test_broadcast_ok():
    T = sym("T")
    assert dims.broadcast_ok(1, T) and dims.broadcast_ok(T, T) and dims.broadcast_ok(2, 6)
    assert dims.broadcast_ok(T, dims.mul(3, T)) and dims.broadcast_ok(2, dims.mul(2, T))
    assert not dims.broadcast_ok(2, T) and not dims.broadcast_ok(4, 6) and not dims.broadcast_ok(6, 2)


def test_evaluate_and_substitute():
    d = dims.prod([3, sym("T"), sym("n_kv")])
    assert dims.evaluate(d, {"T": 2, "n_kv": 5}) == 30
    assert dims.evaluate(7, {}) == 7
    assert dims.substitute(d, {"T": 2}) == dims.mul(6, sym("n_kv"))
    whole = dims.substitute(d, {"T": 2, "n_kv": 5})
    assert whole == 30 and isinstance(whole, int)
    assert dims.substitute(d, {"S": 9}) == d
    with pytest.raises(KeyError, match=r"dim 'n_kv' has no value"):
        dims.evaluate(d, {"T": 2})
    assert dims.names(d) == ("T", "n_kv") and dims.names(4) == ()
    assert dims.is_concrete(4) and not dims.is_concrete(d)


def test_parse_errors_and_names():
    for bad in ["", "T+", "2*", "3T", "T*(n)", "1.5", "T-1"]:
        with pytest.raises(ValueError, match="invalid dim"):
            dims.parse_dim(bad)
    for bad in ["1T", "a-b", "", "T "]:
        with pytest.raises(ValueError, match="invalid dim name"):
            sym(bad)
    assert dims.parse_dim(" 2 * T * 3 ") == dims.mul(6, sym("T"))
    assert dims.parse_dim("n_kv*T") == dims.mul(sym("T"), sym("n_kv"))
    with pytest.raises(TypeError, match="not a dim"):
        dims.mul(True, 2)
    with pytest.raises(TypeError, match="not a dim"):
        dims.mul(2.0, sym("T"))


@given(monomials)
def test_text_round_trip(d):
    assert dims.parse_dim(dims.dim_str(d)) == d
    assert dims.parse_dim(str(d)) == d


@given(monomials, monomials, bindings)
def test_mul_is_integer_multiplication(a, b, env):
    assert dims.evaluate(dims.mul(a, b), env) == dims.evaluate(a, env) * dims.evaluate(b, env)
    assert dims.mul(a, b) == dims.mul(b, a)


@given(monomials, monomials, bindings)
def test_div_inverts_mul(a, b, env):
    product = dims.mul(a, b)
    assert dims.divides(b, product) and dims.divides(a, product)
    assert dims.div(product, b) == a
    b_value = dims.evaluate(b, env)
    if b_value:
        assert dims.evaluate(dims.div(product, b), env) == dims.evaluate(product, env) // b_value


@given(monomials, monomials, bindings)
def test_divides_implies_integer_divisibility(a, b, env):
    if dims.divides(b, a) and dims.evaluate(b, env):
        assert dims.evaluate(a, env) % dims.evaluate(b, env) == 0


@given(monomials, bindings, st.sets(st.sampled_from(NAMES)))
def test_substitute_then_evaluate(d, env, bound):
    partial = dims.substitute(d, {n: env[n] for n in bound})
    assert dims.evaluate(partial, env) == dims.evaluate(d, env)
    assert not set(dims.names(partial)) & bound


def test_sums_of_terms():
    """A symbolic length joined to a fixed one (Mamba's conv window) is a sum; products
    distribute, division and parsing work term by term."""
    t = sym("t")
    w = dims.add(t, 3)
    assert str(w) == "t+3" and dims.parse_dim("t+3") == w and dims.parse_dim(" 3 + t ") == w
    assert dims.add(w, dims.mul(-1, t)) == 3 and isinstance(dims.add(w, dims.mul(-1, t)), int)
    nbytes = dims.prod([4, sym("n"), w])
    assert str(nbytes) == "12*n+4*n*t" and dims.parse_dim(str(nbytes)) == nbytes
    assert dims.div(nbytes, 4) == dims.mul(sym("n"), w) and dims.div(nbytes, w) == dims.mul(4, sym("n"))
    assert not dims.divides(8, nbytes) and not dims.divides(t, w)
    assert dims.evaluate(nbytes, {"n": 2, "t": 5}) == 64 and dims.substitute(w, {"t": 1}) == 4
    assert dims.names(nbytes) == ("n", "t") and dims.terms(w) == ((1, ("t",)), (3, ()))
