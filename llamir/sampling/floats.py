"""C float arithmetic as llama.cpp's samplers do it (libllama is built without FMA contraction).

Element-wise float32 operations are numpy's (IEEE, one rounding each); sums that C runs in a loop
are running sums in that order; glibc's expf and logf are llamir.ir.ggml_math's bit-exact ports;
other libm calls go to this process's libm itself (powf, log2f through ctypes; double exp and pow
through Python's math module, a thin wrapper over the same libm).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math

import numpy as np

from llamir.ir import ggml_math

f32 = np.float32
INT_MIN = -(2**31)


def _libm_float(name: str, n_args: int):
    fn = getattr(_LIBM, name)
    fn.restype = ctypes.c_float
    fn.argtypes = [ctypes.c_float] * n_args
    return fn


_LIBM = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
_POWF = _libm_float("powf", 2)
_LOG2F = _libm_float("log2f", 1)
_LOGF = _libm_float("logf", 1)


def expf(x) -> np.ndarray:
    """glibc expf, element-wise on float32."""
    with np.errstate(all="ignore"):
        return ggml_math.expf(np.asarray(x, dtype=f32))


def logf(x) -> np.ndarray:
    """glibc logf, element-wise on float32 (0 gives -inf, negatives NaN)."""
    with np.errstate(all="ignore"):
        return ggml_math.logf(np.asarray(x, dtype=f32))


def logf1(x) -> np.float32:
    """logf of one float."""
    return f32(_LOGF(float(x)))


def log2f1(x) -> np.float32:
    """log2f of one float."""
    return f32(_LOG2F(float(x)))


def powf1(x, y) -> np.float32:
    """powf of two floats."""
    return f32(_POWF(float(x), float(y)))


def pow_double(x: float, y: float) -> float:
    """libm pow in double."""
    try:
        return math.pow(x, y)
    except OverflowError:
        return math.inf
    except ValueError:
        return math.nan


def exp_double(x: np.ndarray) -> np.ndarray:
    """libm exp in double, element-wise."""
    def one(v: float) -> float:
        try:
            return math.exp(v)
        except OverflowError:
            return math.inf
    return np.array([one(v) for v in np.asarray(x, dtype=np.float64).tolist()], dtype=np.float64)


def to_int(x) -> int:
    """int(x) for a float as x86 converts it (cvttss2si): truncation, INT_MIN for NaN and out of range."""
    x = float(x)
    if not -2147483648.0 <= x < 2147483648.0:     # also false for NaN
        return INT_MIN
    return int(x)


def to_int_array(x: np.ndarray) -> np.ndarray:
    """to_int element-wise, int64."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        ok = (x >= -2147483648.0) & (x < 2147483648.0)
        return np.where(ok, np.trunc(np.where(ok, x, 0.0)), INT_MIN).astype(np.int64)


def running_sum_f32(x: np.ndarray) -> np.ndarray:
    """The float a C loop `float s = 0; s += x[i]` holds after each step."""
    x = np.asarray(x, dtype=f32)
    with np.errstate(all="ignore"):
        return np.add.accumulate(np.concatenate([np.zeros(1, f32), x]))[1:]


def sum_f32(x: np.ndarray) -> np.float32:
    """`float s = 0; for (...) s += x[i];` in order."""
    return running_sum_f32(x)[-1] if len(x) else f32(0)


def sum_f64(x: np.ndarray) -> float:
    """`double s = 0; for (...) s += x[i];` in order."""
    x = np.asarray(x, dtype=np.float64)
    return float(np.add.accumulate(np.concatenate([[0.0], x]))[-1])


def fold_max(x: np.ndarray, init) -> np.float32:
    """`m = init; for (...) m = std::max(m, x[i]);` std::max keeps m unless m < x[i], so NaNs never
    win (and a NaN init stays)."""
    x = np.asarray(x, dtype=f32)
    init = f32(init)
    if np.isnan(init):
        return init
    finite = x[~np.isnan(x)]
    if len(finite) == 0:
        return init
    top = finite.max()
    return top if init < top else init
