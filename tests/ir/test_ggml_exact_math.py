"""llamir.ir.ggml_math against independent oracles: exact rational arithmetic for the float32 fma,
and this machine's glibc (through ctypes) for the expf/sinf/cosf/tanhf/expm1f ports that ggml's
scalar code calls. (ggml_v_expf itself is checked against libggml in test_ggml_exact.py.)"""

from __future__ import annotations

import ctypes
import ctypes.util
from fractions import Fraction

import numpy as np
import pytest

from llamir.ir import ggml_math

f32 = np.float32


def round_to_f32(x: Fraction) -> np.float32:
    """x rounded to the nearest float32, ties to even (finite, normal-range x)."""
    near = f32(float(x))
    candidates = [np.nextafter(near, f32(-np.inf)), near, np.nextafter(near, f32(np.inf))]
    return min(candidates, key=lambda c: (abs(Fraction(float(c)) - x), int(np.array(c).view(np.uint32)) & 1))


def test_fma_matches_exact_rounding():
    rng = np.random.default_rng(7)
    a, b, c = (rng.normal(0, 1, 2000).astype(f32) * f32(2.0) ** rng.integers(-20, 20, 2000) for _ in range(3))
    c[:100] = np.abs(a[:100] * b[:100]) * f32(2.0**35)  # a*b under float64's resolution of c
    want = [round_to_f32(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)))
            for x, y, z in zip(a, b, c, strict=True)]
    np.testing.assert_array_equal(ggml_math.fma(a, b, c), np.array(want, dtype=f32))


@pytest.mark.parametrize("scale", [1.0, 2.0**-30, 2.0**40, -1.0])
def test_fma_breaks_float64_ties_by_the_lost_bits(scale):
    """24929 * 673 = 2^24 + 1, halfway between two float32s; a tiny c decides the rounding,
    though float64 rounds it away and would leave the tie to round-to-even."""
    a, b = f32(24929 * scale), f32(673)
    tiny = f32(2.0**-40 * abs(scale))
    up, down = f32((2**24 + 2) * scale), f32(2**24 * scale)
    assert ggml_math.fma(a, b, tiny)[0] == (up if scale > 0 else down)
    assert ggml_math.fma(a, b, -tiny)[0] == (down if scale > 0 else up)


def test_fma_breaks_float64_ties_of_float32_subnormal_results():
    """641 * 6700417 = 2^32 + 1: a*b = 2^-150 + 2^-182, whose last bit float64 loses beside
    c = 2^-128, leaving a tie between two float32 subnormals that the lost bit decides."""
    a, b = f32(641 * 2.0**-100), f32(6700417 * 2.0**-82)
    c = np.array([2.0**-128, -2.0**-128, 2.0**-128 + 2.0**-148, 0.0], dtype=f32)
    got = ggml_math.fma(np.array([a, a, -a, a]), b, c)
    want = [2.0**-128 + 2.0**-149, -2.0**-128 + 2.0**-149, 2.0**-128 + 2.0**-149, 2.0**-149]
    np.testing.assert_array_equal(got, np.array(want, dtype=f32))


@pytest.fixture(scope="module")
def glibc_libm():
    path = ctypes.util.find_library("m")
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    assert path is not None and hasattr(libc, "gnu_get_libc_version"), \
        "the oracle for ggml_math's ports is glibc's libm, which this machine lacks"
    lib = ctypes.CDLL(path)
    for name in ("expf", "sinf", "cosf", "tanhf", "expm1f", "logf", "erff"):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
    return lib


def _libm(lib, name: str, x: np.ndarray) -> np.ndarray:
    fn = getattr(lib, name)
    return np.array([fn(float(v)) for v in x], dtype=f32)


def _inputs(rng, name: str) -> np.ndarray:
    if name == "expf":
        body = rng.uniform(-104, 89, 40000)
    elif name == "logf":   # every binade, subnormals, around 1
        body = np.concatenate([10.0 ** rng.uniform(-44, 38, 40000), rng.uniform(0.5, 2, 20000), -rng.uniform(0, 1, 10)])
    elif name in ("tanhf", "expm1f", "erff"):   # every branch: tiny, |x| < 1, |x| >= 1, the k = +-1 and far reductions
        body = np.concatenate([rng.normal(0, 1, 20000) * 10.0 ** rng.uniform(-20, 1.3, 20000),
                               np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float64)])
        body = body[np.isfinite(body)]
        if name == "expm1f":
            body = body[np.abs(body) < 18.7]   # the range tanhf hands it (27*ln2)
    else:  # small, fast-reduced (< 120) and large-reduced arguments, rope angles up to 1e5 rad
        body = rng.uniform(-1, 1, 40000) * 10.0 ** rng.uniform(-5, 5, 40000)
    special = [0.0, -0.0, 1e-30, -1e-30, 88.0, 88.8, -103.0, -104.5, 120.0, 119.99, 2e5,
               np.inf, -np.inf, np.nan]
    return np.concatenate([body, special]).astype(f32)


@pytest.mark.parametrize("name", ["expf", "sinf", "cosf", "tanhf", "expm1f", "logf", "erff"])
def test_glibc_ports_match_libm(glibc_libm, name):
    x = _inputs(np.random.default_rng(3), name)
    got, want = getattr(ggml_math, name)(x), _libm(glibc_libm, name, x)
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    assert same.all(), (f"{int((~same).sum())} differ, e.g. {name}({x[~same][:3]}) = {got[~same][:3]}, "
                        f"glibc says {want[~same][:3]}")
