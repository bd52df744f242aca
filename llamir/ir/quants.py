"""ggml's block formats in numpy: dequantize, reference quantize, and the CPU matmul precision.

Layouts follow ggml-common.h, arithmetic follows ggml-quants.c (reference code, compiled without
FMA contraction, float sums in loop order), and the activation conversion follows
ggml-cpu/arch/x86/quants.c (AVX2 path)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from llamir.ir.dtypes import (
    BF16,
    F16,
    F32,
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    Q8_1,
    Q8_K,
    DType,
)

QK_K = 256
_F32 = np.float32
# gguf's GGML_QUANT_SIZES still has the old float d/s block_q8_1 (40 bytes); ggml's is 2 fp16 + 32.
_BLOCK_BYTES_OVERRIDE = {Q8_1.name: 36}

# ---------------------------------------------------------------------------------- helpers


def block_bytes(dtype: DType) -> int:
    """sizeof(block) in ggml: dtype.type_size, except Q8_1 whose gguf entry is stale (40 -> 36)."""
    return _BLOCK_BYTES_OVERRIDE.get(dtype.name, dtype.type_size)


def quant_shape(byte_shape: tuple[int, ...], dtype: DType) -> tuple[int, ...]:
    """Logical shape [..., n] of a tensor stored as bytes [..., row_bytes]."""
    *lead, nbytes = byte_shape
    size = block_bytes(dtype)
    if nbytes % size:
        raise ValueError(f"{nbytes} bytes per row is not a whole number of {dtype} blocks of {size} bytes")
    return (*lead, nbytes // size * dtype.block_size)


def byte_shape(shape: tuple[int, ...], dtype: DType) -> tuple[int, ...]:
    """Byte shape [..., row_bytes] of a tensor of logical shape [..., n]."""
    *lead, n = shape
    if n % dtype.block_size:
        raise ValueError(f"a {dtype} row of {n} elements is not a whole number of "
                         f"{dtype.block_size}-element blocks")
    return (*lead, n // dtype.block_size * block_bytes(dtype))


def fp32_to_fp16_bits(x: np.ndarray) -> np.ndarray:
    """uint16 bits of ggml's GGML_FP32_TO_FP16: round-to-nearest-even, any NaN -> sign|0x7E00."""
    x = np.asarray(x, dtype=_F32)
    with np.errstate(over="ignore", invalid="ignore"):
        bits = x.astype(np.float16).view(np.uint16)
    nan = np.isnan(x)
    if nan.any():  # numpy keeps part of the payload, ggml emits the canonical quiet NaN
        sign = (x.view(np.uint32) >> 16).astype(np.uint16) & np.uint16(0x8000)
        bits = np.where(nan, sign | np.uint16(0x7E00), bits)
    return bits


def fp32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """uint16 bits of ggml's GGML_FP32_TO_BF16: round-to-nearest-even, NaN forced quiet."""
    u = np.ascontiguousarray(x, dtype=_F32).view(np.uint32).astype(np.uint64)
    rounded = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
    quiet_nan = (u >> 16) | 64
    return np.where((u & 0x7FFFFFFF) > 0x7F800000, quiet_nan, rounded).astype(np.uint16)


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The fp16 field at byte `offset` of each block, as float32 [nb, 1]."""
    return np.ascontiguousarray(blocks[:, offset:offset + 2]).view(np.float16).astype(_F32)


def _u32(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The little-endian uint32 field at byte `offset` of each block, [nb, 1]."""
    return np.ascontiguousarray(blocks[:, offset:offset + 4]).view("<u4")


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    """[nb, 1] float32 -> [nb, 2] bytes of the fp16 value, as ggml stores a ggml_half."""
    return fp32_to_fp16_bits(x).reshape(-1, 1).view(np.uint8)


def _halves(qs: np.ndarray) -> np.ndarray:
    """Nibbles [nb, 16] -> [nb, 32]: element j is the low nibble of qs[j], j+16 the high one."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray, n: int) -> np.ndarray:
    """Bit j of the uint32 qh [nb, 1], for j < n, as uint8 [nb, n]."""
    return ((qh >> np.arange(n, dtype=np.uint32)) & 1).astype(np.uint8)


def _as_bytes(raw: np.ndarray, dtype: DType) -> np.ndarray:
    """View raw storage as uint8 bytes; float types may also come as their numpy element type."""
    raw = np.asarray(raw)
    if raw.dtype == np.uint8:
        return raw
    storage = {F32.name: np.float32, F16.name: np.float16, BF16.name: np.uint16}.get(dtype.name)
    if storage is None or raw.dtype != storage:
        raise TypeError(f"{dtype} data must be uint8 bytes"
                        + (f" or {np.dtype(storage).name}" if storage else "") + f", got {raw.dtype}")
    raw = np.ascontiguousarray(raw)
    return raw.view(np.uint8).reshape(*raw.shape[:-1], raw.shape[-1] * raw.itemsize)


# ------------------------------------------------------------------------------ dequantize
# Each takes blocks [nb, type_size] uint8 and returns [nb, block_size] float32, computed with the
# same float32 operations in the same order as ggml's dequantize_row_*.


def _scaled(q: np.ndarray, d: np.ndarray, m: np.ndarray | None = None) -> np.ndarray:
    """float(q) * d (+ m), each step rounded to float32; one fused cast-multiply pass."""
    out = np.multiply(q, d, dtype=_F32)
    if m is not None:
        out += m
    return out


def _deq_q4_0(b: np.ndarray) -> np.ndarray:
    return _scaled(_halves(b[:, 2:18]).astype(np.int8) - 8, _f16(b, 0))


def _deq_q4_1(b: np.ndarray) -> np.ndarray:
    return _scaled(_halves(b[:, 4:20]), _f16(b, 0), _f16(b, 2))


def _deq_q5_0(b: np.ndarray) -> np.ndarray:
    q = (_halves(b[:, 6:22]) | (_high_bits(_u32(b, 2), 32) << 4)).astype(np.int8) - 16
    return _scaled(q, _f16(b, 0))


def _deq_q5_1(b: np.ndarray) -> np.ndarray:
    return _scaled(_halves(b[:, 8:24]) | (_high_bits(_u32(b, 4), 32) << 4), _f16(b, 0), _f16(b, 2))


def _deq_q8_0(b: np.ndarray) -> np.ndarray:
    return _scaled(b[:, 2:34].view(np.int8), _f16(b, 0))


def _deq_q8_1(b: np.ndarray) -> np.ndarray:
    # ggml has no dequantize_row_q8_1; this is d*q, what vec_dot sees (s = d*sum(q) is derived)
    return _scaled(b[:, 4:36].view(np.int8), _f16(b, 0))


def _deq_q8_k(b: np.ndarray) -> np.ndarray:
    d = np.ascontiguousarray(b[:, 0:4]).view("<f4")
    return _scaled(b[:, 4:260].view(np.int8), d)


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """2-bit fields of qs [nb, 64] in K-quant order -> [nb, 16, 16] (sub-block, element)."""
    shifts = np.arange(0, 8, 2, dtype=np.uint8).reshape(1, 1, 4, 1)
    q = (qs.reshape(-1, 2, 1, 32) >> shifts) & 3  # [nb, half n, shift j, 32]
    return q.reshape(-1, 16, 16)


def _deq_q2_k(b: np.ndarray) -> np.ndarray:
    sc = b[:, 0:16, None]
    dl = _f16(b, 80)[:, :, None] * (sc & 0xF).astype(_F32)
    ml = _f16(b, 82)[:, :, None] * (sc >> 4).astype(_F32)
    return (dl * _crumbs(b[:, 16:80]).astype(_F32) - ml).reshape(-1, QK_K)


def _q3_k_scales(raw12: np.ndarray) -> np.ndarray:
    """The 16 6-bit scales of a Q3_K block, unpacked as dequantize_row_q3_K does, as int [nb, 16]."""
    aux = np.ascontiguousarray(raw12).view("<u4")  # [nb, 3]
    a0, a1, tmp = aux[:, 0], aux[:, 1], aux[:, 2]
    lo, hi = np.uint32(0x0F0F0F0F), np.uint32(0x03030303)
    words = np.stack([(a0 & lo) | (((tmp >> 0) & hi) << 4), (a1 & lo) | (((tmp >> 2) & hi) << 4),
                      ((a0 >> 4) & lo) | (((tmp >> 4) & hi) << 4),
                      ((a1 >> 4) & lo) | (((tmp >> 6) & hi) << 4)], axis=-1).astype("<u4")
    return words.view(np.int8).astype(np.int32)


def _deq_q3_k(b: np.ndarray) -> np.ndarray:
    dl = _f16(b, 108)[:, :, None] * (_q3_k_scales(b[:, 96:108]) - 32)[:, :, None].astype(_F32)
    # high bit of element l' of group (n, j) is bit 4n+j of hmask[l']; a clear bit subtracts 4
    bits = np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    hm = ((b[:, None, 0:32] >> bits) & 1).reshape(-1, 16, 16).astype(np.int8)
    q = _crumbs(b[:, 32:96]).astype(np.int8) - 4 * (1 - hm)
    return (dl * q.astype(_F32)).reshape(-1, QK_K)


def k4_scales_mins(raw12: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's get_scale_min_k4 for all 8 sub-blocks: 12 packed bytes [nb, 12] -> (sc, m) uint8 [nb, 8]."""
    s = raw12
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)], axis=-1)
    m = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=-1)
    return sc, m


def _k4_affine(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-sub-block d*sc and dmin*m of a Q4_K/Q5_K block, float32 [nb, 8, 1]."""
    sc, m = k4_scales_mins(b[:, 4:16])
    return (_f16(b, 0) * sc.astype(_F32))[:, :, None], (_f16(b, 2) * m.astype(_F32))[:, :, None]


def _nibble_pairs(qs: np.ndarray) -> np.ndarray:
    """qs [nb, 128] -> [nb, 8, 32]: chunk c's low nibbles are sub-block 2c, high nibbles 2c+1."""
    q = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(-1, 8, 32)


def _deq_q4_k(b: np.ndarray) -> np.ndarray:
    d1, m1 = _k4_affine(b)
    return (d1 * _nibble_pairs(b[:, 16:144]).astype(_F32) - m1).reshape(-1, QK_K)


def _deq_q5_k(b: np.ndarray) -> np.ndarray:
    d1, m1 = _k4_affine(b)
    high = (b[:, None, 16:48] >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1  # bit sb
    q = _nibble_pairs(b[:, 48:176]) + 16 * high
    return (d1 * q.astype(_F32) - m1).reshape(-1, QK_K)


def _deq_q6_k(b: np.ndarray) -> np.ndarray:
    ql = b[:, 0:128].reshape(-1, 2, 2, 32)  # [nb, half, ql+0 / ql+32, l]
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2)  # k = 0..3 of y[l + 32k]
    qh = (b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    q = ((low | (qh << 4)).astype(np.int8) - 32).reshape(-1, 16, 16)
    scale = _f16(b, 208) * b[:, 192:208].view(np.int8).astype(_F32)  # d * sc[is], then * q
    return (scale[:, :, None] * q.astype(_F32)).reshape(-1, QK_K)


_DEQUANT: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    Q4_0.name: _deq_q4_0, Q4_1.name: _deq_q4_1, Q5_0.name: _deq_q5_0, Q5_1.name: _deq_q5_1,
    Q8_0.name: _deq_q8_0, Q8_1.name: _deq_q8_1, Q8_K.name: _deq_q8_k, Q2_K.name: _deq_q2_k,
    Q3_K.name: _deq_q3_k, Q4_K.name: _deq_q4_k, Q5_K.name: _deq_q5_k, Q6_K.name: _deq_q6_k,
}


def dequantize(raw: np.ndarray, dtype: DType) -> np.ndarray:
    """float32 [..., n] from bytes [..., row_bytes], equal bit for bit to ggml's dequantize_row_*.

    F32/F16/BF16 also accept their element arrays (float32, float16, uint16 bf16 bits)."""
    fn = _DEQUANT.get(dtype.name)
    if fn is None and dtype not in (F32, F16, BF16):
        raise ValueError(f"dequantize: {dtype} is not a float or block type")
    data = _as_bytes(raw, dtype)
    out_shape = quant_shape(data.shape, dtype)
    if dtype == F32:
        return np.ascontiguousarray(data).view("<f4").reshape(out_shape)
    if dtype == F16:
        return np.ascontiguousarray(data).view("<f2").astype(_F32).reshape(out_shape)
    if dtype == BF16:
        bits = np.ascontiguousarray(data).view("<u2").astype(np.uint32) << 16
        return bits.view(_F32).reshape(out_shape)
    return fn(data.reshape(-1, block_bytes(dtype))).reshape(out_shape)


# --------------------------------------------------------------------------------- quantize
# Each takes float32 blocks [nb, block_size] and returns [nb, type_size] uint8, as
# ggml's quantize_row_*_ref (float32 arithmetic, C's truncating float->int casts).


def _roundf(v: np.ndarray) -> np.ndarray:
    """C roundf (half away from zero); float64 keeps |v| + 0.5 exact for float32 v."""
    v = v.astype(np.float64)
    return np.copysign(np.floor(np.abs(v) + 0.5), v)


def signed_absmax(x: np.ndarray) -> np.ndarray:
    """The first element of largest magnitude, sign kept, [nb, 1] (ggml's `amax < fabsf(v)` scan
    from amax = max = 0: NaNs never win, a row of zeros or NaNs gives 0)."""
    ax = np.abs(x)
    ax = np.where(np.isnan(ax), _F32(-1), ax)
    at = ax.argmax(axis=-1, keepdims=True)
    return np.where(np.take_along_axis(ax, at, axis=-1) > 0, np.take_along_axis(x, at, axis=-1), _F32(0))


def _inverse(d: np.ndarray) -> np.ndarray:
    """ggml's `id = d ? 1.0f/d : 0.0f`."""
    with np.errstate(divide="ignore", over="ignore"):
        return np.where(d != 0, _F32(1) / d, _F32(0)).astype(_F32)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """[nb, 32] values -> [nb, 16] bytes: low nibble from element j, high from element j+16."""
    return ((q[:, :16] & 0x0F) | ((q[:, 16:] & 0x0F) << 4)).astype(np.uint8)


def _pack_high_bits(q: np.ndarray) -> np.ndarray:
    """Bit 4 of each of the 32 values -> the 4 little-endian qh bytes [nb, 4]."""
    return np.packbits(((q >> 4) & 1).astype(np.uint8), axis=-1, bitorder="little")


def _q_sym(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_0/Q5_0: d = max/-nmax, q = min(2*nmax-1, (int8)(x*id + nmax + 0.5))."""
    d = signed_absmax(x) / _F32(-nmax)
    q = np.trunc(x * _inverse(d) + _F32(nmax + 0.5)).astype(np.int32)
    return d, np.minimum(2 * nmax - 1, q)


def _q_affine(x: np.ndarray, levels: int, clamp: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1/Q5_1: d = (max-min)/levels, q = (int)((x-min)*id + 0.5), clamped for Q4_1 only."""
    lo, hi = x.min(axis=-1, keepdims=True), x.max(axis=-1, keepdims=True)
    d = (hi - lo) / _F32(levels)
    q = np.trunc((x - lo) * _inverse(d) + _F32(0.5)).astype(np.int32)
    return d, lo, np.minimum(levels, q) if clamp else q


def _q_q4_0(x: np.ndarray) -> np.ndarray:
    d, q = _q_sym(x, 8)
    return np.concatenate([_f16_bytes(d), _pack_nibbles(q)], axis=-1)


def _q_q5_0(x: np.ndarray) -> np.ndarray:
    d, q = _q_sym(x, 16)
    return np.concatenate([_f16_bytes(d), _pack_high_bits(q), _pack_nibbles(q)], axis=-1)


def _q_q4_1(x: np.ndarray) -> np.ndarray:
    d, lo, q = _q_affine(x, 15, clamp=True)
    return np.concatenate([_f16_bytes(d), _f16_bytes(lo), _pack_nibbles(q)], axis=-1)


def _q_q5_1(x: np.ndarray) -> np.ndarray:
    d, lo, q = _q_affine(x, 31, clamp=False)
    return np.concatenate([_f16_bytes(d), _f16_bytes(lo), _pack_high_bits(q), _pack_nibbles(q)], axis=-1)


def _q8_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """quantize_row_q8_{0,1}_ref: d = amax/127, q = roundf(x * (1/d))."""
    d = np.abs(x).max(axis=-1, keepdims=True) / _F32(127)
    return d, _roundf(x * _inverse(d)).astype(np.int8)


def _maxps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """x86 maxps: a > b ? a : b, so a NaN in either operand gives b."""
    return np.where(a > b, a, b)


def _x86_block_amax(ax: np.ndarray) -> np.ndarray:
    """max |x| of 32-value blocks [..., 32] as quantize_row_q8_0/1's AVX code takes it: four 8-lane
    vectors folded with maxps, then the 128-bit halves, pairs and the last two (NaNs survive only
    where they are maxps's second operand). [..., 1]."""
    m = ax[..., 0:8]
    for q in (1, 2, 3):
        m = _maxps(m, ax[..., 8 * q:8 * q + 8])
    m = _maxps(m[..., 4:8], m[..., 0:4])
    m = _maxps(m[..., 0:2], m[..., 2:4])
    return _maxps(m[..., 0:1], m[..., 1:2])


def _q8_x86(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml-cpu's AVX quantize_row_q8_{0,1}: id = 127/amax (not 1/d), round half to even. Returns
    (d, q, the int32 sum of the converted values q8_1 stores in s). A NaN product converts to
    the integer indefinite (-2^31): it packs to -128 and enters the wrapping int32 sum as it is."""
    amax = _x86_block_amax(np.abs(x))
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(amax != 0, _F32(127) / amax, _F32(0)).astype(_F32)
        scaled = x * inv
        finite = np.isfinite(scaled)
        q32 = np.where(finite, np.rint(np.where(finite, scaled, 0)), -(2**31)).astype(np.int64)
    isum = (q32.sum(axis=-1, keepdims=True) + 2**31) % 2**32 - 2**31      # _mm256_add_epi32 wraps
    return amax / _F32(127), np.clip(q32, -128, 127).astype(np.int8), isum   # packs saturate


def _q8_0_bytes(d: np.ndarray, q: np.ndarray, isum: np.ndarray | None = None) -> np.ndarray:
    return np.concatenate([_f16_bytes(d), q.view(np.uint8)], axis=-1)


def _q8_1_bytes(d: np.ndarray, q: np.ndarray, isum: np.ndarray | None = None) -> np.ndarray:
    if isum is None:
        isum = q.astype(np.int32).sum(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", over="ignore"):
        s = isum.astype(_F32) * d  # fp16(d * (float) sum)
    return np.concatenate([_f16_bytes(d), _f16_bytes(s), q.view(np.uint8)], axis=-1)


def _q_q8_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q8_K_ref: iscale = -127/max (signed), nearest_int (half to even), d = 1/iscale."""
    mx = signed_absmax(x)
    zero = mx == 0
    with np.errstate(divide="ignore"):
        iscale = np.where(zero, _F32(0), _F32(-127) / np.where(zero, _F32(1), mx)).astype(_F32)
        d = np.where(zero, _F32(0), _F32(1) / np.where(zero, _F32(1), iscale)).astype(_F32)
    with np.errstate(invalid="ignore"):   # nearest_int(NaN) is 0
        scaled = iscale * x
        q = np.minimum(127, np.rint(np.where(np.isnan(scaled), _F32(0), scaled))).astype(np.int8)
    bsums = q.reshape(-1, 16, 16).astype(np.int16).sum(axis=-1, dtype=np.int16)
    return np.concatenate([d.astype("<f4").view(np.uint8), q.view(np.uint8),
                           bsums.astype("<i2").view(np.uint8)], axis=-1)


# K-quant reference quantizers, vectorised over sub-blocks (rows of [G, n]).


def _seq_sum(terms: np.ndarray) -> np.ndarray:
    """Row sums of float32 terms [G, n] added left to right as a C loop does (np.sum is pairwise)."""
    return np.cumsum(terms, axis=1, dtype=_F32)[:, -1]


def _make_qkx2_quants(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float,
                      nstep: int, use_mad: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml's make_qkx2_quants on rows x [G, n]: (scale, the_min, L); the error is weighted
    squared, or absolute with use_mad."""
    f = _F32
    lo, hi = np.minimum(x.min(axis=1), f(0)), x.max(axis=1)
    flat, flat_min = hi == lo, lo  # flat rows return early in C: L = 0, scale 0, the original min
    hi = np.where(flat, lo + f(1), hi)  # any nonzero span; flat rows are overwritten at the end
    sum_w, sum_x = _seq_sum(w), _seq_sum(w * x)

    def levels(iscale: np.ndarray, mn: np.ndarray) -> np.ndarray:
        return np.clip(np.rint(iscale[:, None] * (x - mn[:, None])), 0, nmax).astype(f)

    def error(scale: np.ndarray, mn: np.ndarray, q: np.ndarray) -> np.ndarray:
        diff = (scale[:, None] * q + mn[:, None]) - x
        return _seq_sum(w * (np.abs(diff) if use_mad else np.square(diff)))

    iscale = f(nmax) / (hi - lo)
    scale = f(1) / iscale
    q = levels(iscale, lo)
    best = error(scale, lo, q)
    for step in range(nstep + 1):
        # C updates `min` in place when a step wins, so later steps search from the fitted min
        q_try = levels((f(rmin) + f(rdelta) * f(step) + f(nmax)) / (hi - lo), lo)
        wq = w * q_try
        sum_l, sum_l2, sum_xl = _seq_sum(wq), _seq_sum(wq * q_try), _seq_sum(wq * x)
        det = sum_w * sum_l2 - sum_l * sum_l
        with np.errstate(divide="ignore", invalid="ignore"):
            s_try = (sum_w * sum_xl - sum_x * sum_l) / det
            m_try = (sum_l2 * sum_x - sum_l * sum_xl) / det
            s_try = np.where(m_try > 0, sum_xl / sum_l2, s_try)
        m_try = np.where(m_try > 0, f(0), m_try)
        cur = error(s_try, m_try, q_try)
        better = (det > 0) & (cur < best)
        q = np.where(better[:, None], q_try, q)
        best, scale, lo = (np.where(better, a, b) for a, b in ((cur, best), (s_try, scale), (m_try, lo)))
    return np.where(flat, f(0), scale), -np.where(flat, flat_min, lo), np.where(flat[:, None], f(0), q)


def _make_qx_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml's make_qx_quants with rmse_type=1 and no weights on rows x [G, n]: (scale, L in [0, 2*nmax))."""
    f = _F32
    mx = signed_absmax(x)[:, 0]
    zero = np.abs(mx) < f(1e-15)
    mx = np.where(zero, f(1), mx)
    w = x * x

    def attempt(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        q = np.clip(np.rint(iscale[:, None] * x), -nmax, nmax - 1).astype(f)
        return q, _seq_sum(w * x * q), _seq_sum(w * q * q)

    q, sumlx, suml2 = attempt(f(-nmax) / mx)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(suml2 != 0, sumlx / suml2, f(0))
        best = scale * sumlx
        for step in (*range(-9, 0), *range(1, 10)):
            q_try, sumlx, suml2 = attempt(-(f(nmax) + f(0.1) * f(step)) / mx)
            better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            q = np.where(better[:, None], q_try, q)
            scale = np.where(better, sumlx / suml2, scale)
            best = np.where(better, scale * sumlx, best)
    return np.where(zero, f(0), scale), np.where(zero[:, None], 0, q.astype(np.int32) + nmax)


def _requantize(x: np.ndarray, d: np.ndarray, q_old: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """clip(nearest_int(x / d)) per sub-block; sub-blocks with d == 0 keep q_old (ggml's `continue`)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.clip(np.rint(x / np.where(d == 0, _F32(1), d)), lo, hi)
    return np.where(d == 0, q_old, q).astype(np.int32)


def _k4_fit(x: np.ndarray, nmax: int, rmin: float, nstep: int) -> tuple[np.ndarray, np.ndarray]:
    """What quantize_row_q4_K_ref and q5_K_ref share: per 32-sub-block affine fit, 6-bit
    scales/mins packed as get_scale_min_k4 reads them. Returns (d, dmin, 12 scale bytes as
    [nb, 16] bytes) and the levels [nb, 8, 32] in 0..nmax."""
    nb, f = x.shape[0], _F32
    xs = x.reshape(nb * 8, 32)
    av_x = np.sqrt(_seq_sum(xs * xs) / f(32))
    scales, mins, q = _make_qkx2_quants(xs, av_x[:, None] + np.abs(xs), nmax, rmin, 0.1, nstep)
    scales, mins = scales.reshape(nb, 8), mins.reshape(nb, 8)
    max_scale = np.maximum(scales.max(axis=1, keepdims=True), f(0))
    max_min = np.maximum(mins.max(axis=1, keepdims=True), f(0))
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, f(63) / max_scale, f(0))
        inv_min = np.where(max_min > 0, f(63) / max_min, f(0))
    # uint8_t ls = nearest_int(...) wraps negatives before MIN(63, ls)
    ls = np.minimum(63, np.rint(inv_scale * scales).astype(np.int64) & 0xFF).astype(np.uint8)
    lm = np.minimum(63, np.rint(inv_min * mins).astype(np.int64) & 0xFF).astype(np.uint8)
    packed = np.concatenate([ls[:, :4] | ((ls[:, 4:] >> 4) << 6), lm[:, :4] | ((lm[:, 4:] >> 4) << 6),
                             (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)], axis=1)
    d, dmin = max_scale / f(63), max_min / f(63)
    sc, m = k4_scales_mins(packed)
    d_sub = (_f16_bytes(d).view(np.float16).astype(f) * sc.astype(f)).reshape(-1, 1)
    dm_sub = (_f16_bytes(dmin).view(np.float16).astype(f) * m.astype(f)).reshape(-1, 1)
    q = _requantize(xs + dm_sub, d_sub, q, 0, nmax).reshape(nb, 8, 32)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), packed], axis=1), q


def _q_q4_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q4_K_ref: 4-bit levels, two sub-blocks per 32 bytes of nibbles."""
    head, q = _k4_fit(x, 15, -1.0, 20)
    q = q.reshape(-1, 4, 2, 32)
    return np.concatenate([head, (q[:, :, 0] | (q[:, :, 1] << 4)).astype(np.uint8).reshape(-1, 128)], axis=1)


def _q_q5_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q5_K_ref: 5-bit levels, the low nibbles as in Q4_K, bit 4 of sub-block s
    in bit s of qh[j]."""
    head, q = _k4_fit(x, 31, -0.5, 15)
    qh = sum(((q[:, s] >> 4) & 1) << s for s in range(8)).astype(np.uint8)
    low = (q & 0xF).reshape(-1, 4, 2, 32)
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).astype(np.uint8).reshape(-1, 128)
    return np.concatenate([head, qh, qs], axis=1)


def _pack_2bit(q: np.ndarray) -> np.ndarray:
    """Levels [nb, 256] in 0..3 -> [nb, 64] bytes: per 128 values, byte l holds l, l+32, l+64, l+96."""
    q = q.reshape(-1, 2, 4, 32)
    return sum(q[:, :, k] << (2 * k) for k in range(4)).astype(np.uint8).reshape(-1, 64)


def _q_q2_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q2_K_ref: per 16-sub-block affine fit (absolute error), 4-bit scale and min."""
    nb, f = x.shape[0], _F32
    xs = x.reshape(nb * 16, 16)
    scales, mins, q = _make_qkx2_quants(xs, np.abs(xs), 3, -0.5, 0.1, 15, use_mad=True)
    scales, mins = scales.reshape(nb, 16), mins.reshape(nb, 16)
    max_scale = np.maximum(scales.max(axis=1, keepdims=True), f(0))
    max_min = np.maximum(mins.max(axis=1, keepdims=True), f(0))
    with np.errstate(divide="ignore", invalid="ignore"):   # 15/0 * 0 in the rows it leaves out
        ls = np.where(max_scale > 0, np.rint((f(15) / max_scale) * scales), 0).astype(np.int64)
        lm = np.where(max_min > 0, np.rint((f(15) / max_min) * mins), 0).astype(np.int64)
    packed = ((ls | (lm << 4)) & 0xFF).astype(np.uint8)   # uint8 stores of ints
    d = np.where(max_scale > 0, max_scale / f(15), f(0))
    dmin = np.where(max_min > 0, max_min / f(15), f(0))
    d_sub = (_f16_bytes(d).view(np.float16).astype(f) * (packed & 0xF).astype(f)).reshape(-1, 1)
    dm_sub = (_f16_bytes(dmin).view(np.float16).astype(f) * (packed >> 4).astype(f)).reshape(-1, 1)
    q = _requantize(xs + dm_sub, d_sub, q, 0, 3).reshape(nb, 256)
    return np.concatenate([packed, _pack_2bit(q), _f16_bytes(d), _f16_bytes(dmin)], axis=1)


def _make_q3_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml's make_q3_quants with do_rmse on rows x [G, n]: (scale, L in 0..2*nmax-1).

    After the first fit, up to 5 sweeps move one level at a time when that improves
    sumlx^2/suml2; each sweep visits the elements in order, so the loop runs over elements
    with all rows at once, and a row stops after a sweep that changed nothing."""
    f = _F32
    mx = signed_absmax(x)
    zero = np.abs(mx[:, 0]) < f(1e-15)
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = f(-nmax) / np.where(zero[:, None], f(1), mx)
    L = np.clip(np.rint(iscale * x), -nmax, nmax - 1).astype(f)
    w = x * x
    sumlx, suml2 = _seq_sum(w * x * L), _seq_sum(w * L * L)
    active = ~zero
    for _ in range(5):
        changed = np.zeros_like(active)
        for i in range(x.shape[1]):
            xi, wi, li = x[:, i], w[:, i], L[:, i]
            slx = sumlx - wi * xi * li
            sl2 = suml2 - wi * li * li
            with np.errstate(divide="ignore", invalid="ignore"):
                new_l = np.clip(np.rint(xi * sl2 / slx), -nmax, nmax - 1).astype(f)
            slx_new, sl2_new = slx + wi * xi * new_l, sl2 + wi * new_l * new_l
            better = slx_new * slx_new * suml2 > sumlx * sumlx * sl2_new
            take = active & (slx > 0) & (new_l != li) & (sl2_new > 0) & better
            L[:, i] = np.where(take, new_l, li)
            sumlx, suml2 = np.where(take, slx_new, sumlx), np.where(take, sl2_new, suml2)
            changed |= take
        active &= changed
        if not active.any():
            break
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(suml2 > 0, sumlx / suml2, f(0))
    return np.where(zero, f(0), scale), np.where(zero[:, None], 0, L.astype(np.int32) + nmax)


def _q_q3_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q3_K_ref: per 16-sub-block symmetric fit, 6-bit scales (4 low bits in
    nibbles, 2 high bits in the last 4 bytes), 3-bit levels with the high bit in hmask."""
    nb, f = x.shape[0], _F32
    xs = x.reshape(nb * 16, 16)
    scales, q = _make_q3_quants(xs, 4)
    scales = scales.reshape(nb, 16)
    max_scale = signed_absmax(scales)
    some = max_scale != 0
    with np.errstate(divide="ignore"):
        iscale = np.where(some, f(-32) / np.where(some, max_scale, f(1)), f(0))
    ls = np.where(some, np.clip(np.rint(iscale * scales), -32, 31) + 32, 0).astype(np.uint8)
    high = ls >> 4
    scale_bytes = np.concatenate([(ls[:, :8] & 0xF) | ((ls[:, 8:] & 0xF) << 4),
                                  sum(high[:, 4 * k:4 * k + 4] << (2 * k) for k in range(4))], axis=1)
    with np.errstate(divide="ignore"):
        d = np.where(some, f(1) / np.where(some, iscale, f(1)), f(0))
    sc = ls.astype(np.int32) - 32   # the 6-bit scales read back from those bytes
    d_sub = (_f16_bytes(d).view(np.float16).astype(f) * sc.astype(f)).reshape(-1, 1)
    q = (_requantize(xs, d_sub, q - 4, -4, 3) + 4).reshape(nb, 256)
    hmask = sum(((q[:, 32 * k:32 * k + 32] >> 2) & 1) << k for k in range(8)).astype(np.uint8)
    return np.concatenate([hmask, _pack_2bit(q & 3), scale_bytes.astype(np.uint8), _f16_bytes(d)], axis=1)


def _q_q6_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q6_K_ref: per 16-sub-block symmetric fit, int8 scales, 6-bit levels, d last."""
    nb, f = x.shape[0], _F32
    xs = x.reshape(nb * 16, 16)
    scales, q = _make_qx_quants(xs, 32)
    scales = scales.reshape(nb, 16)
    max_scale = signed_absmax(scales)
    zero = np.abs(max_scale) < f(1e-15)
    iscale = f(-128) / np.where(zero, f(1), max_scale)
    d = np.where(zero, f(0), f(1) / iscale)
    sc = np.where(zero, 0, np.minimum(127, np.rint(iscale * scales))).astype(np.int8)
    d_sub = (_f16_bytes(d).view(np.float16).astype(f) * sc.astype(f)).reshape(-1, 1)
    q = _requantize(xs, d_sub, q - 32, -32, 31) + 32
    q = np.where(zero, 0, q.reshape(nb, 256)).reshape(nb, 2, 4, 32)  # [half, k of y[l+32k], l]
    ql = (q[:, :, :2] & 0xF) | ((q[:, :, 2:] & 0xF) << 4)  # ql[l] = y[l] | y[l+64], ql[l+32] likewise
    qh = sum((q[:, :, k] >> 4) << (2 * k) for k in range(4))
    return np.concatenate([ql.astype(np.uint8).reshape(nb, 128), qh.astype(np.uint8).reshape(nb, 64),
                           sc.view(np.uint8), _f16_bytes(d)], axis=1)


_QUANT: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    Q4_0.name: _q_q4_0, Q4_1.name: _q_q4_1, Q5_0.name: _q_q5_0, Q5_1.name: _q_q5_1,
    Q8_0.name: lambda x: _q8_0_bytes(*_q8_ref(x)), Q8_1.name: lambda x: _q8_1_bytes(*_q8_ref(x)),
    Q8_K.name: _q_q8_k, Q2_K.name: _q_q2_k, Q3_K.name: _q_q3_k, Q4_K.name: _q_q4_k, Q5_K.name: _q_q5_k,
    Q6_K.name: _q_q6_k,
}

# ggml-cpu's type_traits_cpu[...].from_float on x86 with AVX: only q8_0/q8_1 differ from the ref.
_FROM_FLOAT_CPU: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    **_QUANT,
    Q8_0.name: lambda x: _q8_0_bytes(*_q8_x86(x)), Q8_1.name: lambda x: _q8_1_bytes(*_q8_x86(x)),
}


def _encode(x: np.ndarray, dtype: DType, table: dict[str, Callable[[np.ndarray], np.ndarray]],
            what: str) -> np.ndarray:
    x = np.asarray(x, dtype=_F32)
    shape = byte_shape(x.shape, dtype)
    if dtype == F32:
        return np.ascontiguousarray(x).view(np.uint8).reshape(shape)
    if dtype == F16:
        return fp32_to_fp16_bits(x).view(np.uint8).reshape(shape)
    if dtype == BF16:
        return fp32_to_bf16_bits(x).view(np.uint8).reshape(shape)
    fn = table.get(dtype.name)
    if fn is None:
        raise ValueError(f"{what}: {dtype} is not a float or block type")
    return fn(x.reshape(-1, dtype.block_size)).reshape(shape)


def quantize(x: np.ndarray, dtype: DType) -> np.ndarray:
    """uint8 bytes [..., row_bytes] of float32 x [..., n], equal bit for bit to ggml's quantize_row_*_ref.

    Supports every float and block type (F32, F16, BF16, Q4_0..Q8_1, Q2_K..Q8_K)."""
    return _encode(x, dtype, _QUANT, "quantize")


def cpu_from_float(x: np.ndarray, dtype: DType) -> np.ndarray:
    """uint8 bytes of x as ggml-cpu's from_float for `dtype` on x86 AVX2 converts matmul activations.

    Differs from quantize() for Q8_0/Q8_1: id = 127/amax and round half to even."""
    return _encode(x, dtype, _FROM_FLOAT_CPU, "cpu_from_float")


# ----------------------------------------------------------------------------- CPU mul_mat

_VEC_DOT_TYPE: dict[str, DType] = {
    F32.name: F32, F16.name: F16, BF16.name: BF16,
    Q4_0.name: Q8_0, Q5_0.name: Q8_0, Q8_0.name: Q8_0, Q4_1.name: Q8_1, Q5_1.name: Q8_1,
    Q8_1.name: Q8_1, Q2_K.name: Q8_K, Q3_K.name: Q8_K, Q4_K.name: Q8_K, Q5_K.name: Q8_K,
    Q6_K.name: Q8_K,
}


def vec_dot_type(dtype: DType) -> DType:
    """The type ggml-cpu converts a mul_mat's activations to for a weight of `dtype`."""
    try:
        return _VEC_DOT_TYPE[dtype.name]
    except KeyError:
        raise ValueError(f"no CPU vec_dot_type for {dtype}: mul_mat weights are float or block types") from None


def activation_roundtrip(b: np.ndarray, dtype: DType) -> np.ndarray:
    """b float32 [..., K] as the dot product with a `dtype` weight sees it, back in float32."""
    vdt = vec_dot_type(dtype)
    return dequantize(cpu_from_float(b, vdt), vdt)


def split_scale_min(a_raw: np.ndarray, dtype: DType) -> tuple[np.ndarray, np.ndarray]:
    """Q4_1/Q5_1 weight [M, row_bytes] -> (d*q float32 [M, K], per-block min m float32 [M, K/32])."""
    if dtype not in (Q4_1, Q5_1):
        raise ValueError(f"split_scale_min is for Q4_1/Q5_1, got {dtype}")
    data = _as_bytes(a_raw, dtype)
    blocks = data.reshape(-1, block_bytes(dtype))
    q = _halves(blocks[:, 4:20]) if dtype == Q4_1 else (
        _halves(blocks[:, 8:24]) | (_high_bits(_u32(blocks, 4), 32) << 4))
    scaled = _scaled(q, _f16(blocks, 0))
    k_shape = quant_shape(data.shape, dtype)
    return scaled.reshape(k_shape), _f16(blocks, 2).reshape(*k_shape[:-1], -1)


def prepare_weight(a_raw: np.ndarray, a_dtype: DType) -> tuple[np.ndarray, np.ndarray | None]:
    """The cacheable float32 pieces of a weight for mul_mat_prepared: (dequantized or d*q, mins or None)."""
    if a_dtype in (Q4_1, Q5_1):
        return split_scale_min(a_raw, a_dtype)
    return dequantize(a_raw, a_dtype), None


def mul_mat_prepared(weight: np.ndarray, mins: np.ndarray | None, a_dtype: DType,
                     b: np.ndarray) -> np.ndarray:
    """mul_mat_ggml from prepare_weight's pieces: float32 [N, M], matmul done in float32."""
    b = np.asarray(b, dtype=_F32)
    vdt = vec_dot_type(a_dtype)
    packed = cpu_from_float(b, vdt)
    out = dequantize(packed, vdt) @ weight.T
    if mins is not None:
        # vec_dot_q4_1_q8_1 adds m_a * s_b per block, with s_b = fp16(d_b * sum(q_b)) as stored
        s_b = _f16(packed.reshape(-1, block_bytes(Q8_1)), 2).reshape(*b.shape[:-1], -1)
        out += s_b @ mins.T
    return out


def mul_mat_ggml(a_raw: np.ndarray, a_dtype: DType, b: np.ndarray) -> np.ndarray:
    """b @ a.T (float32 [N, M]) at ggml-cpu's precision: b goes through vec_dot_type(a_dtype).

    a [M, K] is bytes [M, row_bytes], or float32 / float16 / uint16 (bf16 bits) for F32/F16/BF16."""
    weight, mins = prepare_weight(a_raw, a_dtype)
    return mul_mat_prepared(weight, mins, a_dtype, b)
