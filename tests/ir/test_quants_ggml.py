"""quants.quantize against ggml itself: quantize_row_<type>_ref from the libggml-base that
llama-cpp-python ships, byte for byte, for every block type, on rows with varied scales, zero
sub-blocks and one-signed data."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

from llamir.ir import quants
from llamir.ir.dtypes import QUANT_DTYPES

llama_cpp = pytest.importorskip("llama_cpp")


@pytest.fixture(scope="module")
def ggml():
    path = Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"
    if not path.exists():
        pytest.skip(f"{path} is not there")
    return ctypes.CDLL(str(path))


def _ggml_quantize(lib, x: np.ndarray, dtype) -> np.ndarray:
    rows, n = x.shape
    out = np.zeros((rows, dtype.row_bytes(n)), np.uint8)
    fn = getattr(lib, f"quantize_row_{dtype.name.replace('_k', '_K')}_ref")
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    fn(x.ctypes.data, out.ctypes.data, x.size)
    return out


def _rows(rng) -> np.ndarray:
    x = rng.standard_normal((12, 512)).astype(np.float32)
    x[0:3] *= np.float32(1e-3)
    x[3:6] *= np.float32(40.0)
    x[6, :64] = 0                      # zero sub-blocks
    x[7] = 0                           # a zero row
    x[8] = np.abs(x[8])                # one-signed: the K-quant mins are 0
    x[9] = -np.abs(x[9])
    x[10, ::7] = np.float32(3.5)       # ties and repeats
    return x


@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=str)
def test_quantize_matches_ggml(ggml, dtype):
    rng = np.random.default_rng(7)
    for _ in range(3):
        x = _rows(rng)
        np.testing.assert_array_equal(quants.quantize(x, dtype).reshape(x.shape[0], -1),
                                      _ggml_quantize(ggml, x, dtype))
