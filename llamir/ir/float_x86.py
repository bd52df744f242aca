"""ggml's x86 float matmuls (f32, f16 and bf16 weights or KV caches), bit for bit per numerics profile.

ggml_compute_forward_mul_mat rounds src1 to the weight's vec_dot_type, then offers the matmul
to llamafile's tinyBLAS; when tinyBLAS declines (or is not offered) each output is one
ggml_vec_dot_* call. Both keep per-output lane accumulators whose width is the build's vector:

- tinyBLAS (N >= 2, K % KN == 0, M % 4 == 0): one fma accumulator per output over steps of KN
  = lanes (32 for bf16 with vdpbf16ps), then hsum: _mm512_reduce_add_ps or the 128-bit one.
- ggml_vec_dot_f32/f16: four accumulators over steps of 4*lanes, GGML_F32_VEC_REDUCE, then the
  leftovers (a float64 sum for f16; f32 sums them in float, as GCC compiles that loop).
- ggml_vec_dot_bf16: two vdpbf16ps accumulators over 64-wide steps (AVX512_BF16), or four
  8-lane fma accumulators over 32-wide steps (AVX2), each reduced into a float64, then the
  leftovers into it.

f16 x f16 and bf16 x bf16 products are exact in float32, so their fmas are plain float adds.
"""

from __future__ import annotations

import numpy as np

from llamir.ir.ggml_math import fma, hsum_8, reduce_accumulators, reduce_add_16, vector_sum
from llamir.ir.numerics import Numerics

f32, f64 = np.float32, np.float64
_CHUNK = 1 << 21  # elements of the [N, M, lanes] accumulator tile processed at once
_BF16 = np.dtype(np.uint16)


def _values(x: np.ndarray) -> np.ndarray:
    """float32 values of a float32, float16 or bf16-bits (uint16) array."""
    if x.dtype == _BF16:
        return (x.astype(np.uint32) << 16).view(f32)
    return x.astype(f32, copy=False)


def _exact_products(a: np.ndarray) -> bool:
    return a.dtype in (np.dtype(np.float16), _BF16)


def _lane_sums(a: np.ndarray, b: np.ndarray, stop: int, width: int) -> np.ndarray:
    """[n, m, width] float32: lane j accumulates b[:, l+j] * a[:, l+j] for l = 0, width, ... < stop,
    in order, each step one fma (a plain add where the products are exact)."""
    a32, b32 = _values(a), _values(b)
    acc = np.zeros((b.shape[0], a.shape[0], width), dtype=f32)
    product = np.empty_like(acc)
    for l0 in range(0, stop, width):
        bl, al = b32[:, None, l0:l0 + width], a32[None, :, l0:l0 + width]
        if _exact_products(a):
            np.multiply(bl, al, out=product)
            acc += product
        else:
            acc = fma(bl, al, acc)
    return acc


def _ftz(x: np.ndarray) -> np.ndarray:
    """Denormals to signed zero, as vdpbf16ps treats its inputs and results (DAZ, FTZ)."""
    tiny = np.abs(x) < np.finfo(f32).tiny
    return np.where(tiny, np.copysign(f32(0), x), x).astype(f32)


def _dpbf16_sums(a: np.ndarray, b: np.ndarray, start: int, stop: int, step: int) -> np.ndarray:
    """[n, m, 16] float32 vdpbf16ps accumulators over columns [start, stop) in blocks of `step`
    (32 values per instruction): lane j adds the odd product 2j+1 first, then the even one 2j,
    each a float add of an exact product with denormals flushed."""
    a32, b32 = _ftz(_values(a)), _ftz(_values(b))
    acc = np.zeros((b.shape[0], a.shape[0], 16), dtype=f32)
    for l0 in range(start, stop, step):
        for parity in (1, 0):
            cols = slice(l0 + parity, l0 + 32, 2)
            acc = _ftz(fma(b32[:, None, cols], a32[None, :, cols], acc))
    return acc


def _tinyblas(a: np.ndarray, b: np.ndarray, numerics: Numerics) -> np.ndarray:
    k = a.shape[-1]
    if a.dtype == _BF16 and numerics.bf16_dot:
        return reduce_add_16(_dpbf16_sums(a, b, 0, k, 32))
    return vector_sum(_lane_sums(a, b, k, numerics.lanes), numerics)


def _leftovers_f64(a: np.ndarray, b: np.ndarray, total: np.ndarray, start: int) -> np.ndarray:
    a32, b32 = _values(a), _values(b)
    total = total.astype(f64)
    for i in range(start, a.shape[-1]):
        total += b32[:, None, i] * a32[None, :, i]
    return total


def _vec_dot_bf16(a: np.ndarray, b: np.ndarray, numerics: Numerics) -> np.ndarray:
    k = a.shape[-1]
    if numerics.bf16_dot:   # c1 over [i, i+32), c2 over [i+32, i+64), each reduced into the double
        main = k - k % 64
        c1 = reduce_add_16(_dpbf16_sums(a, b, 0, main, 64))
        c2 = reduce_add_16(_dpbf16_sums(a, b, 32, main, 64))
        total = c1.astype(f64) + c2.astype(f64)
    else:                   # c1..c4 over 8-wide slices of 32, (c1+c3)+(c2+c4), one 128-bit hsum
        main = k - k % 32
        acc = _lane_sums(a, b, main, 32)
        total = hsum_8((acc[..., 0:8] + acc[..., 16:24]) + (acc[..., 8:16] + acc[..., 24:32])).astype(f64)
    return _leftovers_f64(a, b, total, main).astype(f32)


def _vec_dot(a: np.ndarray, b: np.ndarray, numerics: Numerics) -> np.ndarray:
    """ggml_vec_dot_f16/f32/bf16 of every (row of b, row of a) pair."""
    if a.dtype == _BF16:
        return _vec_dot_bf16(a, b, numerics)
    k = a.shape[-1]
    main = k - k % numerics.step
    total = reduce_accumulators(_lane_sums(a, b, main, numerics.step), numerics)
    if a.dtype == np.float16:   # leftovers one by one into a float64 sum
        return _leftovers_f64(a, b, total, main).astype(f32)
    return _leftovers_f32(a, b, total, main, numerics)


def _leftovers_f32(a: np.ndarray, b: np.ndarray, total: np.ndarray, main: int, numerics: Numerics) -> np.ndarray:
    """ggml_vec_dot_f32's `sumf += x[i]*y[i]` after the vector loop, as GCC compiles it: its
    vectorised epilogue rounds the products of whole groups (8 wide, then 4 in the AVX2 build),
    the scalar tail (the last K % numerics.fused_tail) fuses each into an fma."""
    a32, b32 = _values(a), _values(b)
    k = a.shape[-1]
    fused_from = k - k % numerics.fused_tail
    for i in range(main, k):
        if i < fused_from:
            total = total + b32[:, None, i] * a32[None, :, i]
        else:
            total = fma(b32[:, None, i], a32[None, :, i], total)
    return total.astype(f32)


def vec_dots(a: np.ndarray, b: np.ndarray, numerics: Numerics) -> np.ndarray:
    """[N, M]: ggml_vec_dot_* of every row of b [N, K] with every row of a [M, K], both already of
    a's type (float32, float16 or bf16 bits)."""
    n, m = b.shape[0], a.shape[0]
    out = np.empty((n, m), dtype=f32)
    rows = max(1, _CHUNK // max(1, m * numerics.step))
    for n0 in range(0, n, rows):
        out[n0:n0 + rows] = _vec_dot(a, b[n0:n0 + rows], numerics)
    return out


def _block(a: np.ndarray, b: np.ndarray, tinyblas: bool, numerics: Numerics) -> np.ndarray:
    return _tinyblas(a, b, numerics) if tinyblas else _vec_dot(a, b, numerics)


def tinyblas_takes(n: int, m: int, k: int, is_bf16: bool, numerics: Numerics) -> bool:
    """Whether llamafile_sgemm accepts an offered float matmul of b [n, k] x a [m, k]."""
    kn = 32 if is_bf16 and numerics.bf16_dot else numerics.lanes
    return n >= 2 and k % kn == 0 and m % 4 == 0


def mul_mat_float(a: np.ndarray, b: np.ndarray, numerics: Numerics, sgemm: bool = True) -> np.ndarray:
    """b [N, K] f32 @ a.T for a [M, K] float32, float16 or bf16 bits (uint16), as ggml's CPU backend
    of the profile's build sums: b is rounded to a's type (the vec_dot_type), then tinyBLAS takes
    the matmul when offered (`sgemm`) and able, ggml_vec_dot_* otherwise."""
    from llamir.ir.interp_kernels import f32_to_bf16

    n, k = b.shape
    m = a.shape[0]
    b = f32_to_bf16(b) if a.dtype == _BF16 else b.astype(a.dtype)
    tinyblas = sgemm and tinyblas_takes(n, m, k, a.dtype == _BF16, numerics)
    out = np.empty((n, m), dtype=f32)
    width = 16 if a.dtype == _BF16 else numerics.step
    rows = max(1, _CHUNK // max(1, m * width))
    cols = m if rows > 1 else max(1, _CHUNK // width)
    for n0 in range(0, n, rows):
        for m0 in range(0, m, cols):
            out[n0:n0 + rows, m0:m0 + cols] = _block(a[m0:m0 + cols], b[n0:n0 + rows], tinyblas, numerics)
    return out
