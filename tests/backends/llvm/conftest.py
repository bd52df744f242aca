"""Fixtures for the LLVM backend tests: one backend per session (its code cache in memory only),
and `check`, which runs a graph on it and on the numpy interpreter and compares the outputs."""

from __future__ import annotations

import numpy as np
import pytest

from llamir.ir import Graph, run_graph


@pytest.fixture(scope="module", autouse=True)
def _close_shared_backends():
    """The backends a module took from shared_backends, closed when it ends."""
    yield
    from shared_backends import close_shared_backends

    close_shared_backends()


def nmse(actual: np.ndarray, expected: np.ndarray) -> float:
    a = np.asarray(actual, dtype=np.float64)
    b = np.asarray(expected, dtype=np.float64)
    finite = np.isfinite(b)
    assert np.array_equal(np.isfinite(a), finite), "inf/nan positions differ"
    if not finite.all():
        assert np.array_equal(a[~finite], b[~finite]) or np.isnan(b[~finite]).all()
    a, b = a[finite], b[finite]
    ref = float(np.sum(b * b))
    err = float(np.sum((a - b) ** 2))
    return 0.0 if err == 0.0 else err / max(ref, 1e-300)


@pytest.fixture(scope="session")
def llvm_backend():
    from llamir.backends.llvm import LLVMBackend

    backend = LLVMBackend(n_threads=2, disk_cache=False)
    yield backend
    backend.close()


@pytest.fixture
def check(llvm_backend):
    """check(graph, values, bindings, tol=1e-12, exact=False, fresh=None): outputs (and the state
    leaves named in `fresh`, rebuilt per run by their factories) agree with the numpy reference."""

    def run(graph: Graph, values: dict, bindings: dict | None = None, tol: float = 1e-12, exact: bool = False,
            fresh: dict | None = None):
        bindings = bindings or {}
        ours, theirs = dict(values), dict(values)
        for name, make in (fresh or {}).items():
            ours[name], theirs[name] = make(), make()
        want = run_graph(graph, theirs, bindings)
        got = llvm_backend.compile(graph)(ours, bindings)
        for name in want:
            assert got[name].shape == want[name].shape and got[name].dtype == want[name].dtype, name
            _compare(name, got[name], want[name], tol, exact)
        for name in fresh or {}:
            _compare(name, ours[name], theirs[name], tol, exact)
        return got

    return run


def _compare(name, got, want, tol, exact):
    if exact or got.dtype.kind in "iu":
        if got.dtype.kind == "f":
            same = (got == want) | (np.isnan(got) & np.isnan(want))
        else:
            same = got == want
        assert same.all(), f"{name}: {int((~same).sum())} of {same.size} values differ"
        return
    err = nmse(got, want)
    assert err <= tol, f"{name}: NMSE {err:.3g} > {tol:.3g}"
