"""GGUF block types in kernels: element j of a block dequantized to f32, and a block of f32
values quantized, bit for bit as llamir's reference (llamir/ir/quants.py) does both.

Decoding is ggml's dequantize_row_* arithmetic. Encoding is what the reference's cpy and
set_rows store (ggml-cpu's from_float): quantize_row_*_ref for q4_0, q4_1, q5_0, q5_1 and the
K-quants (quants_k.py), and for q8_0 the x86 path (d = amax / 127, q = x * (127 / amax)
rounded half to even). Layouts are ggml-common.h's; blocks are read and written a byte (an
fp16 field two bytes) at a time, as blocks of 18 or 34 bytes align no wider.
"""

from __future__ import annotations

from collections.abc import Callable

from llvmlite import ir

from llamir.ir import dtype_named
from llamir_cuda import kir
from llamir_cuda.kir import F32
from llamir_cuda.quants_k import ENCODERS_K, q3_k_scale, scale_min_k4
from llamir_cuda.scalar import Array, Bytes, Val, Var, fabs, fmax, imin, loop, nearest_int, select, to_float, to_int

LEGACY = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")
K_QUANTS = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k")
QUANTS = LEGACY + K_QUANTS  # the block types kernels decode and encode


def block_size(dtype: str) -> int:
    """Elements per block."""
    return dtype_named(dtype).block_size


def dequant_block(k: kir.KernelBuilder, dtype: str, ptr: ir.Value, block: ir.Value, j: ir.Value) -> ir.Value:
    """Element j (i32, below the block size) of the `dtype` block at byte `block` (i64) of
    `ptr`, as f32."""
    return DECODERS[dtype](Bytes(k, ptr, block), Val(k, j)).v


def quantize_block(k: kir.KernelBuilder, dtype: str, load: Callable[[ir.Value], ir.Value], ptr: ir.Value,
                   block: ir.Value) -> None:
    """Encode one `dtype` block, whose element j (an i32) `load(j)` gives as f32, into byte
    `block` (i64) of `ptr`. The values are first copied into a thread-private array."""
    qx = Array(k, F32, block_size(dtype))
    with loop(k, 0, block_size(dtype)) as j:
        qx[j] = Val(k, load(j.v))
    ENCODERS[dtype](k, Bytes(k, ptr, block), qx)


# -- decoders: (block, j) -> element j ---------------------------------------------------------------
def _nibble(q: Bytes, at: int, j: Val) -> Val:
    """Level j of 32 packed from byte `at`: byte j % 16's low nibble for j < 16, its high one after."""
    return (q.u8(at + (j & 15)) >> ((j >> 4) * 4)) & 0xF


def _bit(q: Bytes, at: int, j: Val) -> Val:
    """Bit j of the little-endian bit field at byte `at`."""
    return (q.u8(at + (j >> 3)) >> (j & 7)) & 1


def _crumb(q: Bytes, at: int, j: Val) -> Val:
    """2-bit level j of 256 as q2_K and q3_K pack them: per 128 levels, byte l holds l, l + 32,
    l + 64 and l + 96 from its low bits up."""
    return (q.u8(at + 32 * (j >> 7) + (j & 31)) >> (2 * ((j >> 5) & 3))) & 3


def _q4_0(q: Bytes, j: Val) -> Val:  # d, qs[16]: (q - 8) d
    return to_float(_nibble(q, 2, j) - 8) * q.f16(0)


def _q4_1(q: Bytes, j: Val) -> Val:  # d, m, qs[16]: q d + m
    return to_float(_nibble(q, 4, j)) * q.f16(0) + q.f16(2)


def _q5_0(q: Bytes, j: Val) -> Val:  # d, qh (bit j: level j's bit 4), qs[16]: (q - 16) d
    return to_float((_nibble(q, 6, j) | (_bit(q, 2, j) << 4)) - 16) * q.f16(0)


def _q5_1(q: Bytes, j: Val) -> Val:  # d, m, qh, qs[16]: q d + m
    return to_float(_nibble(q, 8, j) | (_bit(q, 4, j) << 4)) * q.f16(0) + q.f16(2)


def _q8_0(q: Bytes, j: Val) -> Val:  # d, qs[32] int8: q d
    return to_float(q.i8(2 + j)) * q.f16(0)


def _q2_k(q: Bytes, j: Val) -> Val:
    """scales[16] (scale | min << 4 per 16 levels), qs[64], d, dmin: d sc q - dmin m."""
    sc = q.u8(j >> 4)
    return q.f16(80) * to_float(sc & 0xF) * to_float(_crumb(q, 16, j)) - q.f16(82) * to_float(sc >> 4)


def _q3_k(q: Bytes, j: Val) -> Val:
    """hmask[32] (bit j / 32 of byte j % 32: level j's bit 2, clear meaning -4), qs[64],
    scales[12] (16 6-bit scales biased by 32: low nibbles, then 2-bit high parts), d."""
    dl = q.f16(108) * to_float(q3_k_scale(q, j >> 4))
    hm = (q.u8(j & 31) >> (j >> 5)) & 1
    return dl * to_float(_crumb(q, 32, j) - 4 + 4 * hm)


def _q4_k(q: Bytes, j: Val) -> Val:
    """d, dmin, scales[12] (8 6-bit scale / min pairs), qs[128]: sub-block 2c + h is the low
    (h = 0) or high nibbles of qs[32c .. 32c + 31]; d sc q - dmin m."""
    s = j >> 5
    sc, m = scale_min_k4(q, 4, s)
    level = (q.u8(16 + 32 * (s >> 1) + (j & 31)) >> (4 * (s & 1))) & 0xF
    return q.f16(0) * to_float(sc) * to_float(level) - q.f16(2) * to_float(m)


def _q5_k(q: Bytes, j: Val) -> Val:
    """d, dmin, scales[12], qh[32] (bit s of qh[l]: bit 4 of sub-block s's level l), qs[128]."""
    s = j >> 5
    sc, m = scale_min_k4(q, 4, s)
    level = ((q.u8(48 + 32 * (s >> 1) + (j & 31)) >> (4 * (s & 1))) & 0xF) | (((q.u8(16 + (j & 31)) >> s) & 1) << 4)
    return q.f16(0) * to_float(sc) * to_float(level) - q.f16(2) * to_float(m)


def _q6_k(q: Bytes, j: Val) -> Val:
    """ql[128], qh[64], scales[16] int8, d: level j = 128h + 32c + l has its low nibble in
    ql[64h + 32(c & 1) + l] (the high nibble for c >= 2), its top two bits at 2c of qh[32h + l];
    d sc (q - 32)."""
    h, c, lane = j >> 7, (j >> 5) & 3, j & 31
    low = (q.u8(64 * h + 32 * (c & 1) + lane) >> (4 * (c >> 1))) & 0xF
    high = (q.u8(128 + 32 * h + lane) >> (2 * c)) & 3
    return q.f16(208) * to_float(q.i8(192 + (j >> 4))) * to_float((low | (high << 4)) - 32)


DECODERS: dict[str, Callable[[Bytes, Val], Val]] = {
    "q4_0": _q4_0, "q4_1": _q4_1, "q5_0": _q5_0, "q5_1": _q5_1, "q8_0": _q8_0,
    "q2_k": _q2_k, "q3_k": _q3_k, "q4_k": _q4_k, "q5_k": _q5_k, "q6_k": _q6_k,
}


# -- encoders of the 32-value types --------------------------------------------------------------------
def _put_levels(k: kir.KernelBuilder, q: Bytes, at: int, level: Callable[[Val], Val]) -> None:
    """Levels 0..31 packed as ggml packs them: byte j holds level j in its low nibble and level
    j + 16 in its high one."""
    with loop(k, 0, 16) as j:
        q.put_u8(at + j, (level(j) & 0xF) | ((level(j + 16) & 0xF) << 4))


def _put_high_bits(k: kir.KernelBuilder, q: Bytes, at: int, level: Callable[[Val], Val]) -> None:
    """qh: bit j is bit 4 of level j."""
    qh = Var(k, 0)
    with loop(k, 0, 32) as j:
        qh.set(qh.get() | (((level(j) >> 4) & 1) << j))
    q.put_u32(at, qh.get())


def _symmetric(k: kir.KernelBuilder, q: Bytes, qx: Array, nmax: int) -> None:
    """quantize_row_q4_0_ref (nmax 8) / q5_0 (16): d = max / -nmax with max the first value
    of largest magnitude, level (int8)(x / d + nmax + 0.5), at most 2 nmax - 1."""
    amax, vmax = Var(k, 0.0), Var(k, 0.0)
    with loop(k, 0, 32) as j:
        v = qx[j]
        larger = amax.get() < fabs(v)
        amax.set(select(larger, fabs(v), amax.get()))
        vmax.set(select(larger, v, vmax.get()))
    d = vmax.get() / -float(nmax)
    inv = select(d.ne(0.0), 1.0 / d, 0.0)
    q.put_f16(0, d)

    def level(j: Val) -> Val:
        return imin(to_int(qx[j] * inv + (nmax + 0.5)), 2 * nmax - 1)
    if nmax == 8:
        _put_levels(k, q, 2, level)
    else:
        _put_high_bits(k, q, 2, level)
        _put_levels(k, q, 6, level)


def _affine(k: kir.KernelBuilder, q: Bytes, qx: Array, levels: int) -> None:
    """quantize_row_q4_1_ref (15 levels) / q5_1 (31): d = (max - min) / levels, m = min, level
    (int)((x - min) / d + 0.5), clamped to 15 for q4_1."""
    lo, hi = Var(k, qx[0]), Var(k, qx[0])
    with loop(k, 1, 32) as j:
        v = qx[j]
        lo.set(select(v < lo.get(), v, lo.get()))
        hi.set(select(v > hi.get(), v, hi.get()))
    d = (hi.get() - lo.get()) / float(levels)
    inv = select(d.ne(0.0), 1.0 / d, 0.0)
    q.put_f16(0, d)
    q.put_f16(2, lo.get())
    minimum = lo.get()

    def level(j: Val) -> Val:
        v = to_int((qx[j] - minimum) * inv + 0.5)
        return imin(v, 15) if levels == 15 else v
    if levels == 15:
        _put_levels(k, q, 4, level)
    else:
        _put_high_bits(k, q, 4, level)
        _put_levels(k, q, 8, level)


def _q8_0_x86(k: kir.KernelBuilder, q: Bytes, qx: Array) -> None:
    """ggml-cpu's AVX quantize_row_q8_0: d = amax / 127, q = x * (127 / amax) rounded half to even."""
    amax = Var(k, 0.0)
    with loop(k, 0, 32) as j:
        amax.set(fmax(amax.get(), fabs(qx[j])))
    top = amax.get()
    inv = select(top.ne(0.0), 127.0 / top, 0.0)
    q.put_f16(0, top / 127.0)
    with loop(k, 0, 32) as j:
        q.put_u8(2 + j, nearest_int(qx[j] * inv))


ENCODERS: dict[str, Callable[[kir.KernelBuilder, Bytes, Array], None]] = {
    "q4_0": lambda k, q, qx: _symmetric(k, q, qx, 8),
    "q5_0": lambda k, q, qx: _symmetric(k, q, qx, 16),
    "q4_1": lambda k, q, qx: _affine(k, q, qx, 15),
    "q5_1": lambda k, q, qx: _affine(k, q, qx, 31),
    "q8_0": _q8_0_x86,
    **ENCODERS_K,
}
