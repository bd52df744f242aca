"""Quantized-weight mul_mat and mul_mat_id (src0 in a GGUF block type), as ggml's CPU computes them.

b (f32 or f16 activations) is first converted to the weight's vec_dot_type (llamir/ir/quants.py):
q8_0 for q4_0 / q5_0 / q8_0 and q8_1 for q4_1 / q5_1 (as ggml-cpu's x86 from_float: id = 127/amax,
round half to even), q8_K for the K-quants (quantize_row_q8_K_ref). `_quantize_b_kernel` writes it into
scratch memory, one row per column of b:

    qs int8[K] | d f32[K / QK] | sums[K / 32 * SW]      (each field 16-aligned: BLayout)

d is the block's scale as the CPU sees it (q8_0 / q8_1: its f16 value); sums per 32-element chunk
are q8_0's int sum of qs, q8_1's s = f16(d * sum) as f32, or q8_K's two int bsums (SW = 2).

Every weight type decodes by 32-element chunks (`Chunk`: eight words of four unsigned levels, the
scales and mins of the chunk's halves); a level minus the type's `offset` is the signed value,
which the products correct with b's sums (integer dot products stay exact). A chunk's part of one
output is then, with dot_h the dp4a sum of half h (one half when the chunk has one scale):

    q8_0:  d_a * d_b * (dot - offset * sum_b)
    q8_1:  d_a * d_b * dot + m_a * s_b
    q8_K:  d_b * sum_h (d_h * (dot_h - offset * bsum_h) + m_h * bsum_h)     (m_h = -dmin * min)

Paths: up to MV_MAX_COLS columns, a matrix-vector kernel (one warp per row of a, a lane per chunk,
reading the weight once for all columns); more, a tiled kernel (a BM x BN tile of the output per
block; the weight tile decoded once into shared memory as int8 words with its scales, b's tile
next to it, dp4a over both). mul_mat_id: per (token, slot) matrix-vector for few tokens; else a
helper kernel lists, per expert, the (token, slot) pairs that chose it, and the tiled kernel runs
per (row tile, expert) over those pairs as its columns.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from llvmlite import ir

from llamir.backends import BackendError
from llamir.ir import ops
from llamir_cuda import kir
from llamir_cuda.kir import F32, I8, I16, I32, I64, scalar, tensor
from llamir_cuda.lowering import MAX_GRID_Y, ceil_div, device_ptr, tensor_args

MV_MAX_COLS = 8  # b columns up to which mul_mat takes the matrix-vector kernel (ggml's MMVQ batch)
MV_ROWS = 4  # rows of a per matrix-vector block (a warp each)
BM, BN, KC = 64, 32, 8  # tile: BM rows x BN columns, KC 32-element chunks of K per step
TILE_THREADS = 128
TR, TC = 16, 8  # the tile's threads as TR x TC: a thread computes rows tr + TR*i, columns tc + TC*j
QUANT_WARPS = 4  # warps per block of the b conversion (a warp per block of b)
LISTS_THREADS = 256
LO4, LO2, LO1 = 0x0F0F0F0F, 0x03030303, 0x01010101
B_TYPES = ("f32", "f16")


# -- block decoders ----------------------------------------------------------------------------------
@dataclass
class Chunk:
    """32 elements of a weight row: `q` eight i32 words (element 4w + j in byte j of word w) of
    unsigned levels, `d` the scale of each half (one value: of all 32), `m` the mins (none, or
    one per scale) that multiply b's sums."""

    q: list[ir.Value]
    d: list[ir.Value]
    m: list[ir.Value]


def _u8(k: kir.KernelBuilder, ptr, off) -> ir.Value:
    return k.b.zext(k.load(ptr, I8, off), I32)


def _f16(k: kir.KernelBuilder, ptr, off) -> ir.Value:
    return k.h2f(k.load(ptr, I16, off, align=2))


def words(k: kir.KernelBuilder, ptr, off, n: int, align: int) -> list[ir.Value]:
    """n little-endian i32 words at byte `off`, `align` the alignment the address is known to have
    (vector loads from 8 bytes up; below 4, LLVM splits each word into aligned pieces)."""
    b = k.b
    width = 4 if align >= 16 and n % 4 == 0 else 2 if align >= 8 and n % 2 == 0 else 1
    out: list[ir.Value] = []
    for i in range(0, n, width):
        at = b.add(off, ir.Constant(off.type, 4 * i))
        if width == 1:
            out.append(k.load(ptr, I32, at, align=min(align, 4)))
            continue
        v = k.load(ptr, ir.VectorType(I32, width), at, align=4 * width)
        out += [b.extract_element(v, k.i32(j)) for j in range(width)]
    return out


def nibbles(k: kir.KernelBuilder, qs: list[ir.Value], high) -> list[ir.Value]:
    """The low (high=0) or high (high=1, or an i32 0/1) nibble of each byte of the words."""
    b = k.b
    shift = k.i32(4 * high) if isinstance(high, int) else b.shl(high, k.i32(2))
    return [b.and_(b.lshr(w, shift), k.i32(LO4)) for w in qs]


def spread_bits(k: kir.KernelBuilder, bits: ir.Value, to: int) -> ir.Value:
    """Bits 0..3 of `bits` moved to bit `to` of bytes 0..3 (q5's fifth bit of four levels)."""
    b = k.b
    out = None
    for j in range(4):
        part = b.and_(b.shl(bits, k.i32(8 * j + to - j)), k.i32(1 << (8 * j + to)))
        out = part if out is None else b.or_(out, part)
    return out


def scale_min_k4(k: kir.KernelBuilder, ptr, off, j: ir.Value) -> tuple[ir.Value, ir.Value]:
    """ggml's get_scale_min_k4: the 6-bit scale and min of sub-block j (0..7) of the 12 packed
    bytes at `off` (Q4_K / Q5_K), as i32."""
    b = k.b
    low = b.and_(j, k.i32(3))
    b0, b1, b2 = (_u8(k, ptr, b.add(off, b.sext(b.add(low, k.i32(4 * i)), I64))) for i in range(3))
    sc_lo, m_lo = b.and_(b0, k.i32(63)), b.and_(b1, k.i32(63))
    sc_hi = b.or_(b.and_(b2, k.i32(0xF)), b.shl(b.lshr(b0, k.i32(6)), k.i32(4)))
    m_hi = b.or_(b.lshr(b2, k.i32(4)), b.shl(b.lshr(b1, k.i32(6)), k.i32(4)))
    first = b.icmp_unsigned("<", j, k.i32(4))
    return k.select(first, sc_lo, sc_hi), k.select(first, m_lo, m_hi)


def scale_q3_k(k: kir.KernelBuilder, ptr, off, i: ir.Value) -> ir.Value:
    """Scale i (0..15) of a Q3_K block's 12 packed bytes at `off`, as dequantize_row_q3_K unpacks
    it: 4 low bits from byte i % 8 (nibble i // 8), 2 high bits from byte 8 + i % 4 (pair i // 4),
    minus 32, as i32."""
    b = k.b
    lo = _u8(k, ptr, b.add(off, b.zext(b.and_(i, k.i32(7)), I64)))
    lo = b.and_(b.lshr(lo, b.shl(b.lshr(i, k.i32(3)), k.i32(2))), k.i32(0xF))
    hi = _u8(k, ptr, b.add(off, b.zext(b.add(b.and_(i, k.i32(3)), k.i32(8)), I64)))
    hi = b.and_(b.lshr(hi, b.shl(b.lshr(i, k.i32(2)), k.i32(1))), k.i32(3))
    return b.sub(b.or_(lo, b.shl(hi, k.i32(4))), k.i32(32))


def _at(k, off: ir.Value, delta) -> ir.Value:
    """off + delta bytes (delta an int or an i32)."""
    d = ir.Constant(I64, delta) if isinstance(delta, int) else k.b.zext(delta, I64)
    return k.b.add(off, d)


def _fl(k, v: ir.Value) -> ir.Value:
    return k.b.sitofp(v, F32)


def _decode_q4_0(k, p, off, c, al):
    return Chunk(nibbles(k, q := words(k, p, _at(k, off, 2), 4, math.gcd(al, 2)), 0) + nibbles(k, q, 1),
                 [_f16(k, p, off)], [])


def _decode_q4_1(k, p, off, c, al):
    q = words(k, p, _at(k, off, 4), 4, math.gcd(al, 4))
    return Chunk(nibbles(k, q, 0) + nibbles(k, q, 1), [_f16(k, p, off)], [_f16(k, p, _at(k, off, 2))])


def _q5_levels(k, q: list[ir.Value], qh: ir.Value) -> list[ir.Value]:
    b = k.b
    lo, hi = nibbles(k, q, 0), nibbles(k, q, 1)
    return ([b.or_(lo[i], spread_bits(k, b.lshr(qh, k.i32(4 * i)), 4)) for i in range(4)]
            + [b.or_(hi[i], spread_bits(k, b.lshr(qh, k.i32(16 + 4 * i)), 4)) for i in range(4)])


def _decode_q5_0(k, p, off, c, al):
    qh = words(k, p, _at(k, off, 2), 1, math.gcd(al, 2))[0]
    q = words(k, p, _at(k, off, 6), 4, math.gcd(al, 2))
    return Chunk(_q5_levels(k, q, qh), [_f16(k, p, off)], [])


def _decode_q5_1(k, p, off, c, al):
    qh = words(k, p, _at(k, off, 4), 1, math.gcd(al, 4))[0]
    q = words(k, p, _at(k, off, 8), 4, math.gcd(al, 8))
    return Chunk(_q5_levels(k, q, qh), [_f16(k, p, off)], [_f16(k, p, _at(k, off, 2))])


def _decode_q8_0(k, p, off, c, al):
    return Chunk(words(k, p, _at(k, off, 2), 8, math.gcd(al, 2)), [_f16(k, p, off)], [])


def _decode_q2_k(k, p, off, c, al):
    """Chunk c = 4h + j: 2-bit fields at shift 2j of qs[32h + l]; scales/mins bytes 2c, 2c + 1."""
    b = k.b
    h, j = b.lshr(c, k.i32(2)), b.and_(c, k.i32(3))
    q = words(k, p, _at(k, off, b.add(k.i32(16), b.shl(h, k.i32(5)))), 8, math.gcd(al, 16))
    q = [b.and_(b.lshr(w, b.shl(j, k.i32(1))), k.i32(LO2)) for w in q]
    d, dmin = _f16(k, p, _at(k, off, 80)), _f16(k, p, _at(k, off, 82))
    sc = [_u8(k, p, _at(k, off, b.add(b.shl(c, k.i32(1)), k.i32(t)))) for t in (0, 1)]
    return Chunk(q, [b.fmul(d, _fl(k, b.and_(s, k.i32(0xF)))) for s in sc],
                 [b.fneg(b.fmul(dmin, _fl(k, b.lshr(s, k.i32(4))))) for s in sc])


def _decode_q3_k(k, p, off, c, al):
    """Chunk c = 4h + j: 2-bit fields at shift 2j of qs[32h + l], plus 4 when bit 4h + j of
    hmask[l] is set (level - 4 is the value); scales 2c, 2c + 1."""
    b = k.b
    h, j = b.lshr(c, k.i32(2)), b.and_(c, k.i32(3))
    q = words(k, p, _at(k, off, b.add(k.i32(32), b.shl(h, k.i32(5)))), 8, math.gcd(al, 32))
    hm = words(k, p, off, 8, math.gcd(al, 32))
    q = [b.or_(b.and_(b.lshr(w, b.shl(j, k.i32(1))), k.i32(LO2)),
               b.shl(b.and_(b.lshr(m, c), k.i32(LO1)), k.i32(2))) for w, m in zip(q, hm, strict=True)]
    d = _f16(k, p, _at(k, off, 108))
    sc = [scale_q3_k(k, p, _at(k, off, 96), b.add(b.shl(c, k.i32(1)), k.i32(t))) for t in (0, 1)]
    return Chunk(q, [b.fmul(d, _fl(k, s)) for s in sc], [])


def _decode_q4_k(k, p, off, c, al):
    """Chunk c: nibble c % 2 of qs[32 (c // 2) + l]; scale and min from get_scale_min_k4(c)."""
    b = k.b
    q = words(k, p, _at(k, off, b.add(k.i32(16), b.shl(b.lshr(c, k.i32(1)), k.i32(5)))), 8, math.gcd(al, 16))
    sc, mn = scale_min_k4(k, p, _at(k, off, 4), c)
    return Chunk(nibbles(k, q, b.and_(c, k.i32(1))), [b.fmul(_f16(k, p, off), _fl(k, sc))],
                 [b.fneg(b.fmul(_f16(k, p, _at(k, off, 2)), _fl(k, mn)))])


def _decode_q5_k(k, p, off, c, al):
    """Q4_K's nibbles (at qs = 48) plus 16 times bit c of qh[l]."""
    b = k.b
    q = words(k, p, _at(k, off, b.add(k.i32(48), b.shl(b.lshr(c, k.i32(1)), k.i32(5)))), 8, math.gcd(al, 16))
    qh = words(k, p, _at(k, off, 16), 8, math.gcd(al, 16))
    q = [b.or_(lo, b.shl(b.and_(b.lshr(h, c), k.i32(LO1)), k.i32(4)))
         for lo, h in zip(nibbles(k, q, b.and_(c, k.i32(1))), qh, strict=True)]
    sc, mn = scale_min_k4(k, p, _at(k, off, 4), c)
    return Chunk(q, [b.fmul(_f16(k, p, off), _fl(k, sc))], [b.fneg(b.fmul(_f16(k, p, _at(k, off, 2)), _fl(k, mn)))])


def _decode_q6_k(k, p, off, c, al):
    """Chunk c = 4h + j: nibble j // 2 of ql[64h + 32 (j % 2) + l], 2 high bits at shift 2j of
    qh[32h + l] (level - 32 is the value); int8 scales 2c, 2c + 1."""
    b = k.b
    h, j = b.lshr(c, k.i32(2)), b.and_(c, k.i32(3))
    ql_at = b.add(b.shl(h, k.i32(6)), b.shl(b.and_(j, k.i32(1)), k.i32(5)))
    lo = nibbles(k, words(k, p, _at(k, off, ql_at), 8, math.gcd(al, 32)), b.lshr(j, k.i32(1)))
    qh = words(k, p, _at(k, off, b.add(k.i32(128), b.shl(h, k.i32(5)))), 8, math.gcd(al, 32))
    shift = b.shl(j, k.i32(1))
    q = [b.or_(x, b.shl(b.and_(b.lshr(w, shift), k.i32(LO2)), k.i32(4))) for x, w in zip(lo, qh, strict=True)]
    d = _f16(k, p, _at(k, off, 208))
    sc = [b.sext(k.load(p, I8, _at(k, off, b.add(k.i32(192 + t), b.shl(c, k.i32(1))))), I32) for t in (0, 1)]
    return Chunk(q, [b.fmul(d, _fl(k, s)) for s in sc], [])


@dataclass(frozen=True)
class QuantSpec:
    """A weight type: block of `qk` elements in `size` bytes, b's vec_dot_type, the level offset,
    scales (and mins) per 32-element chunk, and its chunk decoder
    decode(k, ptr, block byte offset i64, chunk index in the block i32, alignment) -> Chunk."""

    qk: int
    size: int
    vdt: str
    offset: int
    halves: int
    mins: bool
    decode: Callable

    @property
    def chunks(self) -> int:
        return self.qk // 32


SPECS: dict[str, QuantSpec] = {
    "q4_0": QuantSpec(32, 18, "q8_0", 8, 1, False, _decode_q4_0),
    "q4_1": QuantSpec(32, 20, "q8_1", 0, 1, True, _decode_q4_1),
    "q5_0": QuantSpec(32, 22, "q8_0", 16, 1, False, _decode_q5_0),
    "q5_1": QuantSpec(32, 24, "q8_1", 0, 1, True, _decode_q5_1),
    "q8_0": QuantSpec(32, 34, "q8_0", 0, 1, False, _decode_q8_0),
    "q2_k": QuantSpec(256, 84, "q8_k", 0, 2, True, _decode_q2_k),
    "q3_k": QuantSpec(256, 110, "q8_k", 4, 2, False, _decode_q3_k),
    "q4_k": QuantSpec(256, 144, "q8_k", 0, 1, True, _decode_q4_k),
    "q5_k": QuantSpec(256, 176, "q8_k", 0, 1, True, _decode_q5_k),
    "q6_k": QuantSpec(256, 210, "q8_k", 32, 2, False, _decode_q6_k),
}


# -- b in its vec_dot_type (scratch rows) ------------------------------------------------------------
def b_block(vdt: str) -> int:
    return 256 if vdt == "q8_k" else 32


@dataclass(frozen=True)
class BLayout:
    """A converted row of b of n_k values: qs at byte 0, d at n_k, the sums at `sums_at`, rows
    `pitch` bytes apart. Every field starts 16-aligned (qs are read as 16-byte vectors, q8_K's
    bsums as pairs)."""

    sums_at: int
    pitch: int

    @classmethod
    def of(cls, vdt: str, n_k: int) -> BLayout:
        d_bytes = 4 * (n_k // b_block(vdt))
        sums_bytes = 4 * (n_k // 32) * (2 if vdt == "q8_k" else 1)
        sums_at = n_k + ceil_div(d_bytes, 16) * 16  # n_k is a multiple of 32
        return cls(sums_at, sums_at + ceil_div(sums_bytes, 16) * 16)


B_LAYOUT_PARAMS = (scalar("qb", "p"), scalar("pitch", "i"), scalar("sums_at", "i"))


def _b_fields(k, n_k: ir.Value) -> tuple[ir.Value, ir.Value]:
    """Byte offsets, within a converted row, of d and of the sums (i64; the kernel's BLayout)."""
    return k.b.zext(n_k, I64), k.b.zext(k.args["sums_at"], I64)


def _quantize_b_kernel(vdt: str, b_dtype: str) -> kir.Kernel:
    """b's rows converted to `vdt`, a warp per block of b (units = rows x blocks per row)."""

    def body(k: kir.KernelBuilder) -> None:
        b, src = k.b, k.args["b"]
        unit = b.add(b.mul(k.ctaid(0), k.i32(QUANT_WARPS)), k.warp())
        with k.if_then(b.icmp_signed("<", unit, k.args["units"])):
            n_blk = b.lshr(src.ne[0], k.i32(8 if vdt == "q8_k" else 5))
            r, blk = b.udiv(unit, n_blk), b.urem(unit, n_blk)
            i1, rest = b.urem(r, src.ne[1]), b.udiv(r, src.ne[1])
            i2, i3 = b.urem(rest, src.ne[2]), b.udiv(rest, src.ne[2])
            base = k.offset(src, None, i1, i2, i3)
            row = b.mul(b.zext(r, I64), b.zext(k.args["pitch"], I64))
            d_at, sums_at = _b_fields(k, src.ne[0])
            fields = (k.args["qb"], row, b.add(row, d_at), b.add(row, sums_at))
            convert = _quantize_q8_k if vdt == "q8_k" else _quantize_q8_01
            convert(k, vdt, b_dtype, src, base, blk, fields)

    params = (tensor("b"), *B_LAYOUT_PARAMS, scalar("units", "i"))
    return kir.define("mmq_quantize_b", (vdt, b_dtype), params, 32 * QUANT_WARPS, body)


def _quantize_q8_01(k, vdt, b_dtype, src, base, blk, fields) -> None:
    """ggml-cpu's x86 quantize_row_q8_0 / _q8_1 for one block, a lane per value: d = amax / 127,
    q = rint(x * (127 / amax)) saturated; d kept as its f16; q8_0 stores sum(q), q8_1 f16(d * sum(q))."""
    b, lane = k.b, k.lane()
    qb, row, d_at, sums_at = fields
    e = b.add(b.shl(blk, k.i32(5)), lane)
    x = k.load_f32(src.ptr, b.add(base, k.offset(src, e)), b_dtype)
    amax = k.warp_max(k.fabs(x))
    d = b.fdiv(amax, k.f32(127.0))
    inv = k.select(b.fcmp_ordered("!=", amax, k.f32(0.0)), b.fdiv(k.f32(127.0), amax), k.f32(0.0))
    # maxnum turns a NaN product into -128, as the x86 conversion's integer indefinite packs
    q = b.fptosi(k.fmin(k.fmax(k.rint(b.fmul(x, inv)), k.f32(-128.0)), k.f32(127.0)), I32)
    k.store(b.trunc(q, I8), qb, b.add(row, b.zext(e, I64)))
    total = k.warp_sum(q)
    with k.if_then(b.icmp_unsigned("==", lane, k.i32(0))):
        k.store(k.h2f(k.f2h(d)), qb, b.add(d_at, b.zext(b.shl(blk, k.i32(2)), I64)))
        at = b.add(sums_at, b.zext(b.shl(blk, k.i32(2)), I64))
        if vdt == "q8_0":
            k.store(total, qb, at)
        else:
            k.store(k.h2f(k.f2h(b.fmul(b.sitofp(total, F32), d))), qb, at)


def _quantize_q8_k(k, vdt, b_dtype, src, base, blk, fields) -> None:
    """quantize_row_q8_K_ref for one block of 256, lane l holding values l + 32 j: max = the first
    value of largest magnitude, iscale = -127 / max, q = min(127, rint(iscale * x)) (NaN: 0),
    d = 1 / iscale, and the 16 bsums (sums of 16 q)."""
    b, lane = k.b, k.lane()
    qb, row, d_at, sums_at = fields
    first = b.shl(blk, k.i32(8))
    idx = [b.add(b.add(first, lane), k.i32(32 * j)) for j in range(8)]
    xs = [k.load_f32(src.ptr, b.add(base, k.offset(src, i)), b_dtype) for i in idx]
    best_a, best_i, best_x = None, None, None
    for i, x in zip(idx, xs, strict=True):
        ax = k.fabs(x)
        ax = k.select(b.fcmp_unordered("uno", ax, ax), k.f32(-1.0), ax)
        if best_a is None:
            best_a, best_i, best_x = ax, i, x
            continue
        take = b.fcmp_ordered(">", ax, best_a)
        best_a, best_i, best_x = k.select(take, ax, best_a), k.select(take, i, best_i), k.select(take, x, best_x)
    m = 16
    while m:
        oa, oi, ox = (k.shfl_xor(v, m) for v in (best_a, best_i, best_x))
        take = b.or_(b.fcmp_ordered(">", oa, best_a),
                     b.and_(b.fcmp_ordered("==", oa, best_a), b.icmp_signed("<", oi, best_i)))
        best_a, best_i, best_x = k.select(take, oa, best_a), k.select(take, oi, best_i), k.select(take, ox, best_x)
        m //= 2
    mx = k.select(b.fcmp_ordered(">", best_a, k.f32(0.0)), best_x, k.f32(0.0))
    zero = b.fcmp_ordered("==", mx, k.f32(0.0))
    iscale = k.select(zero, k.f32(0.0), b.fdiv(k.f32(-127.0), k.select(zero, k.f32(1.0), mx)))
    d = k.select(zero, k.f32(0.0), b.fdiv(k.f32(1.0), k.select(zero, k.f32(1.0), iscale)))
    upper = b.icmp_unsigned("==", b.and_(lane, k.i32(15)), k.i32(0))
    for j, (i, x) in enumerate(zip(idx, xs, strict=True)):
        s = b.fmul(iscale, x)
        q = b.fptosi(k.select(b.fcmp_unordered("uno", s, s), k.f32(0.0), k.fmin(k.rint(s), k.f32(127.0))), I32)
        k.store(b.trunc(q, I8), qb, b.add(row, b.zext(i, I64)))
        group_sum = k.warp_sum(q, width=16)
        with k.if_then(upper):  # lanes 0 and 16: bsums 2j and 2j + 1 of the block
            group = b.add(b.shl(blk, k.i32(4)), b.add(k.i32(2 * j), b.lshr(lane, k.i32(4))))
            k.store(group_sum, qb, b.add(sums_at, b.zext(b.shl(group, k.i32(2)), I64)))
    with k.if_then(b.icmp_unsigned("==", lane, k.i32(0))):
        k.store(d, qb, b.add(d_at, b.zext(b.shl(blk, k.i32(2)), I64)))


@dataclass
class BChunk:
    """32 converted values of b: eight words of int8, the block's d, and the chunk's sums (q8_0: one
    int, q8_1: s as f32, q8_K: the two bsums of its halves, or their total when the weight's
    chunk has one scale)."""

    q: list[ir.Value]
    d: ir.Value
    sums: list[ir.Value]


def b_chunk(k, spec: QuantSpec, qb, row: ir.Value, n_k: ir.Value, g: ir.Value) -> BChunk:
    """Chunk g of the converted row at byte `row` of `qb`."""
    b = k.b
    d_at, sums_at = _b_fields(k, n_k)
    gl = b.zext(g, I64)
    q = words(k, qb, b.add(row, b.shl(gl, ir.Constant(I64, 5))), 8, 16)
    blk = b.lshr(gl, ir.Constant(I64, 3)) if spec.vdt == "q8_k" else gl
    d = k.load(qb, F32, b.add(row, b.add(d_at, b.shl(blk, ir.Constant(I64, 2)))))
    if spec.vdt == "q8_k":
        pair = words(k, qb, b.add(row, b.add(sums_at, b.shl(gl, ir.Constant(I64, 3)))), 2, 8)
        sums = pair if spec.halves == 2 else [b.add(*pair)]
    else:
        s = k.load(qb, I32 if spec.vdt == "q8_0" else F32, b.add(row, b.add(sums_at, b.shl(gl, ir.Constant(I64, 2)))))
        sums = [s]
    return BChunk(q, d, sums)


def chunk_dots(k, spec: QuantSpec, aq: list[ir.Value], bq: list[ir.Value],
               acc: list[ir.Value] | None = None) -> list[ir.Value]:
    """The dp4a sums of a weight chunk's words with b's, per half (one, or two of 16 values)."""
    per = 8 // spec.halves
    dots = list(acc) if acc is not None else [k.i32(0)] * spec.halves
    for w in range(8):
        dots[w // per] = k.dp4a(aq[w], bq[w], dots[w // per])
    return dots


def contribution(k, spec: QuantSpec, dots: list[ir.Value], a_d: list[ir.Value], a_m: list[ir.Value],
                 b_d: ir.Value, b_sums: list[ir.Value]) -> ir.Value:
    """One chunk's part of one output, ggml's vec_dot for the type (see the module's docstring)."""
    b = k.b
    if spec.offset:
        dots = [b.sub(x, b.mul(s, k.i32(spec.offset))) for x, s in zip(dots, b_sums, strict=True)]
    if spec.vdt != "q8_k":
        part = b.fmul(b.fmul(a_d[0], b_d), _fl(k, dots[0]))
        return k.fma(a_m[0], b_sums[0], part) if spec.mins else part
    t = None
    for h in range(spec.halves):
        term = b.fmul(a_d[h], _fl(k, dots[h]))
        if spec.mins:
            term = k.fma(a_m[h], _fl(k, b_sums[h]), term)
        t = term if t is None else b.fadd(t, term)
    return b.fmul(b_d, t)


# -- matrix-vector: a warp per row of a ------------------------------------------------------------------
def _chunk_of(k, spec: QuantSpec, g: ir.Value) -> tuple[ir.Value, ir.Value]:
    """(block, chunk in the block) of a row's chunk g."""
    if spec.chunks == 1:
        return g, k.i32(0)
    return k.b.lshr(g, k.i32(3)), k.b.and_(g, k.i32(7))


def _block_at(k, spec: QuantSpec, row_off: ir.Value, blk: ir.Value) -> ir.Value:
    return k.b.add(row_off, k.b.mul(k.b.zext(blk, I64), ir.Constant(I64, spec.size)))


def _matvec_kernel(type_a: str, n_cols: int, align: int, with_ids: bool) -> kir.Kernel:
    """d[..., j, row] for n_cols columns j: lanes take the row's chunks in turn (consecutive lanes,
    consecutive chunks), each times every column's, then a warp sum. With ids: one column, of
    token ctaid.z and slot ctaid.y, from expert ids[token, slot]."""
    spec = SPECS[type_a]

    def body(k: kir.KernelBuilder) -> None:
        b, a, d, qb = k.b, k.args["a"], k.args["d"], k.args["qb"]
        row = b.add(b.mul(k.ctaid(0), k.i32(MV_ROWS)), k.warp())
        valid = b.icmp_signed("<", row, a.ne[1])
        if with_ids:
            ids, slot, tok = k.args["ids"], k.ctaid(1), k.ctaid(2)
            expert = k.load(ids.ptr, I32, k.offset(ids, slot, tok))
            valid = b.and_(valid, b.icmp_unsigned("<", expert, a.ne[2]))
            a_off = k.offset(a, None, row, expert)
            n_b = k.args["n_b"]
            b_rows = [b.add(b.urem(slot, n_b), b.mul(n_b, tok))]
            d_offs = [k.offset(d, row, slot, tok)]
        else:
            batch = k.ctaid(1)
            i2, i3 = b.urem(batch, d.ne[2]), b.udiv(batch, d.ne[2])
            a_off = k.offset(a, None, row, b.udiv(i2, k.args["r2"]), b.udiv(i3, k.args["r3"]))
            b_rows = [b.add(k.i32(j), b.mul(batch, k.i32(n_cols))) for j in range(n_cols)]
            d_offs = [k.offset(d, row, k.i32(j), i2, i3) for j in range(n_cols)]
        pitch = b.zext(k.args["pitch"], I64)
        rows = [b.mul(b.zext(r, I64), pitch) for r in b_rows]
        with k.if_then(valid):
            lane = k.lane()
            accs = [k.var(F32, k.f32(0.0)) for _ in rows]
            with k.loop(lane, b.lshr(a.ne[0], k.i32(5)), 32) as g:
                blk, c = _chunk_of(k, spec, g)
                chunk = spec.decode(k, a.ptr, _block_at(k, spec, a_off, blk), c, align)
                for acc, r in zip(accs, rows, strict=True):
                    bc = b_chunk(k, spec, qb, r, a.ne[0], g)
                    dots = chunk_dots(k, spec, chunk.q, bc.q)
                    k.set(acc, b.fadd(k.get(acc, F32), contribution(k, spec, dots, chunk.d, chunk.m, bc.d, bc.sums)))
            for j, (acc, at) in enumerate(zip(accs, d_offs, strict=True)):
                total = k.warp_sum(k.get(acc, F32))
                with k.if_then(b.icmp_unsigned("==", lane, k.i32(j))):
                    k.store(total, d.ptr, at)

    tail = (tensor("ids"), scalar("n_b", "i")) if with_ids else (scalar("r2", "i"), scalar("r3", "i"))
    params = (tensor("a"), *B_LAYOUT_PARAMS, tensor("d"), *tail)
    return kir.define("mmq_matvec", (type_a, n_cols, align, with_ids), params, 32 * MV_ROWS, body)


# -- tiles: BM rows x BN columns per block ---------------------------------------------------------------
A_PITCH = KC * 8 + 1  # words per row of the shared weight tile (+1: rows fall in different banks)


class _TileSmem:
    """The block's shared tiles: the weight's words, scales and mins per (row, chunk, half), b's
    words, d and sums per (column, chunk); the column map for mul_mat_id."""

    def __init__(self, k, spec: QuantSpec, with_ids: bool):
        self.h = spec.halves
        self.hs = len_sums(spec)
        self.sp = KC * self.h + 1
        self.ssp = KC * self.hs + 1
        self.a = k.shared(I32, BM * A_PITCH, "a")
        self.ad = k.shared(F32, BM * self.sp, "ad")
        self.am = k.shared(F32, BM * self.sp, "am") if spec.mins else None
        self.b = k.shared(I32, BN * A_PITCH, "b")
        self.bd = k.shared(F32, BN * KC, "bd")
        self.bs = k.shared(F32 if spec.vdt == "q8_1" else I32, BN * self.ssp, "bs")
        self.rows = k.shared(I32, BN, "rows") if with_ids else None  # b's converted row per column
        self.pairs = k.shared(I32, BN, "pairs") if with_ids else None  # token * n_used + slot


def len_sums(spec: QuantSpec) -> int:
    return spec.halves if spec.vdt == "q8_k" else 1


def _idx(k, *terms) -> ir.Value:
    """sum of (i32 value or int) * int pairs, an i32 shared-memory index."""
    b, out = k.b, k.i32(0)
    for v, scale in terms:
        v = k.i32(v) if isinstance(v, int) else v
        out = b.add(out, v if scale == 1 else b.mul(v, k.i32(scale)))
    return out


def _load_tiles(k, spec, sm: _TileSmem, align, a, a_base, m0, kt, b_row_of, qb) -> None:
    """Step kt's chunks of the weight rows m0.. (rows past the end repeat the last) and of b's
    columns into shared memory; chunks past K are zeros."""
    b, t = k.b, k.tid(0)
    n_chunks = b.lshr(a.ne[0], k.i32(5))
    last_row = b.sub(a.ne[1], k.i32(1))
    zero_f, zero_i = k.f32(0.0), k.i32(0)
    for i in range(BM * KC // TILE_THREADS):
        p = b.add(t, k.i32(TILE_THREADS * i))
        r, c = b.lshr(p, k.i32(3)), b.and_(p, k.i32(KC - 1))
        g = b.add(b.mul(kt, k.i32(KC)), c)
        grow = k.select(b.icmp_signed("<", b.add(m0, r), last_row), b.add(m0, r), last_row)
        with k.if_else(b.icmp_signed("<", g, n_chunks)) as (inside, past):
            with inside:
                blk, cin = _chunk_of(k, spec, g)
                row_off = b.add(a_base, k.offset(a, None, grow))
                ch = spec.decode(k, a.ptr, _block_at(k, spec, row_off, blk), cin, align)
                _store_a(k, sm, r, c, ch.q, ch.d, ch.m)
            with past:
                _store_a(k, sm, r, c, [zero_i] * 8, [zero_f] * sm.h, [zero_f] * sm.h)
    for i in range(BN * KC // TILE_THREADS):
        p = b.add(t, k.i32(TILE_THREADS * i))
        col, c = b.lshr(p, k.i32(3)), b.and_(p, k.i32(KC - 1))
        g = b.add(b.mul(kt, k.i32(KC)), c)
        with k.if_else(b.icmp_signed("<", g, n_chunks)) as (inside, past):
            with inside:
                bc = b_chunk(k, spec, qb, b_row_of(col), a.ne[0], g)
                _store_b(k, sm, col, c, bc.q, bc.d, bc.sums)
            with past:
                zs = zero_f if spec.vdt == "q8_1" else zero_i
                _store_b(k, sm, col, c, [zero_i] * 8, zero_f, [zs] * sm.hs)


def _store_a(k, sm: _TileSmem, r, c, q, d, m) -> None:
    for w, v in enumerate(q):
        k.sstore(v, sm.a, _idx(k, (r, A_PITCH), (c, 8), (w, 1)))
    for h in range(sm.h):
        k.sstore(d[h], sm.ad, _idx(k, (r, sm.sp), (c, sm.h), (h, 1)))
        if sm.am is not None:
            k.sstore(m[h], sm.am, _idx(k, (r, sm.sp), (c, sm.h), (h, 1)))


def _store_b(k, sm: _TileSmem, col, c, q, d, sums) -> None:
    for w, v in enumerate(q):
        k.sstore(v, sm.b, _idx(k, (col, A_PITCH), (c, 8), (w, 1)))
    k.sstore(d, sm.bd, _idx(k, (col, KC), (c, 1)))
    for h, s in enumerate(sums):
        k.sstore(s, sm.bs, _idx(k, (col, sm.ssp), (c, sm.hs), (h, 1)))


def _tile_products(k, spec, sm: _TileSmem, accs) -> None:
    """accs[i][j] += the step's KC chunks of row tr + TR i times column tc + TC j."""
    b, t = k.b, k.tid(0)
    tr, tc = b.and_(t, k.i32(TR - 1)), b.lshr(t, k.i32(4))
    rows = [b.add(tr, k.i32(TR * i)) for i in range(BM // TR)]
    cols = [b.add(tc, k.i32(TC * j)) for j in range(BN // TC)]
    with k.loop(k.i32(0), k.i32(KC)) as c:
        dots = [[[k.i32(0)] * spec.halves for _ in cols] for _ in rows]
        for w in range(8):
            aw = [k.sload(sm.a, _idx(k, (r, A_PITCH), (c, 8), (w, 1))) for r in rows]
            bw = [k.sload(sm.b, _idx(k, (col, A_PITCH), (c, 8), (w, 1))) for col in cols]
            h = w // (8 // spec.halves)
            for i in range(len(rows)):
                for j in range(len(cols)):
                    dots[i][j][h] = k.dp4a(aw[i], bw[j], dots[i][j][h])
        ad = [[k.sload(sm.ad, _idx(k, (r, sm.sp), (c, sm.h), (h, 1))) for h in range(sm.h)] for r in rows]
        am = ([[k.sload(sm.am, _idx(k, (r, sm.sp), (c, sm.h), (h, 1))) for h in range(sm.h)] for r in rows]
              if sm.am is not None else [[] for _ in rows])
        bd = [k.sload(sm.bd, _idx(k, (col, KC), (c, 1))) for col in cols]
        bs = [[k.sload(sm.bs, _idx(k, (col, sm.ssp), (c, sm.hs), (h, 1))) for h in range(sm.hs)] for col in cols]
        for i in range(len(rows)):
            for j in range(len(cols)):
                part = contribution(k, spec, dots[i][j], ad[i], am[i], bd[j], bs[j])
                k.set(accs[i][j], b.fadd(k.get(accs[i][j], F32), part))


def _tile(k, spec, sm, align, a, a_base, qb, b_row_of, store) -> None:
    """One output tile: zeroed accumulators, the K steps, then store(row i, column j, value) for
    each of the thread's outputs."""
    b = k.b
    m0 = b.mul(k.ctaid(0), k.i32(BM))
    accs = [[k.var(F32) for _ in range(BN // TC)] for _ in range(BM // TR)]
    for row in accs:
        for acc in row:
            k.set(acc, k.f32(0.0))
    n_steps = b.lshr(b.add(a.ne[0], k.i32(32 * KC - 1)), k.i32(8))
    with k.loop(k.i32(0), n_steps) as kt:
        _load_tiles(k, spec, sm, align, a, a_base, m0, kt, b_row_of, qb)
        k.barrier()
        _tile_products(k, spec, sm, accs)
        k.barrier()
    t = k.tid(0)
    tr, tc = b.and_(t, k.i32(TR - 1)), b.lshr(t, k.i32(4))
    for i, row_accs in enumerate(accs):
        row = b.add(m0, b.add(tr, k.i32(TR * i)))
        for j, acc in enumerate(row_accs):
            store(row, b.add(tc, k.i32(TC * j)), k.get(acc, F32))


def _tile_kernel(type_a: str, align: int, with_ids: bool) -> kir.Kernel:
    """mul_mat: the tile (ctaid.x, ctaid.y) of batch ctaid.z. mul_mat_id: row tile ctaid.x of
    expert ctaid.y, over the column tiles ctaid.z, + nctaid.z, ... of the pairs listed for it."""
    spec = SPECS[type_a]

    def body(k: kir.KernelBuilder) -> None:
        b, a, d, qb = k.b, k.args["a"], k.args["d"], k.args["qb"]
        sm = _TileSmem(k, spec, with_ids)
        pitch = b.zext(k.args["pitch"], I64)
        if not with_ids:
            batch = k.ctaid(2)
            i2, i3 = b.urem(batch, d.ne[2]), b.udiv(batch, d.ne[2])
            a_base = k.offset(a, None, None, b.udiv(i2, k.args["r2"]), b.udiv(i3, k.args["r3"]))
            n0, n = b.mul(k.ctaid(1), k.i32(BN)), d.ne[1]
            last = b.sub(n, k.i32(1))

            def b_row_of(col):
                c = b.add(n0, col)
                c = k.select(b.icmp_signed("<", c, last), c, last)
                return b.mul(b.zext(b.add(c, b.mul(batch, n)), I64), pitch)

            def store(row, col, value):
                c = b.add(n0, col)
                with k.if_then(b.and_(b.icmp_signed("<", row, a.ne[1]), b.icmp_signed("<", c, n))):
                    k.store(value, d.ptr, k.offset(d, row, c, i2, i3))

            _tile(k, spec, sm, align, a, a_base, qb, b_row_of, store)
            return
        expert, lists = k.ctaid(1), k.args["lists"]
        count = k.load(lists, I32, b.shl(b.zext(expert, I64), ir.Constant(I64, 2)))
        first = b.mul(b.zext(b.add(a.ne[2], b.mul(expert, k.args["cap"])), I64), ir.Constant(I64, 4))
        a_base = k.offset(a, None, None, expert)
        n_used, n_b, t = d.ne[1], k.args["n_b"], k.tid(0)
        with k.loop(k.ctaid(2), b.lshr(b.add(count, k.i32(BN - 1)), k.i32(5)), k.nctaid(2)) as tile:
            k.barrier()  # the previous tile's stores have read the column map
            with k.if_then(b.icmp_signed("<", t, k.i32(BN))):
                i = b.add(b.mul(tile, k.i32(BN)), t)
                i = k.select(b.icmp_signed("<", i, count), i, b.sub(count, k.i32(1)))
                pair = k.load(lists, I32, b.add(first, b.shl(b.zext(i, I64), ir.Constant(I64, 2))))
                tok, slot = b.udiv(pair, n_used), b.urem(pair, n_used)
                k.sstore(b.add(b.urem(slot, n_b), b.mul(n_b, tok)), sm.rows, t)
                k.sstore(pair, sm.pairs, t)
            k.barrier()

            def store(row, col, value, tile=tile):
                in_list = b.icmp_signed("<", b.add(b.mul(tile, k.i32(BN)), col), count)
                with k.if_then(b.and_(b.icmp_signed("<", row, a.ne[1]), in_list)):
                    pair = k.sload(sm.pairs, col)
                    k.store(value, d.ptr, k.offset(d, row, b.urem(pair, n_used), b.udiv(pair, n_used)))

            _tile(k, spec, sm, align, a, a_base, qb, lambda col: b.mul(b.zext(k.sload(sm.rows, col), I64), pitch),
                  store)

    tail = (scalar("lists", "p"), scalar("cap", "i"), scalar("n_b", "i")) if with_ids else \
        (scalar("r2", "i"), scalar("r3", "i"))
    params = (tensor("a"), *B_LAYOUT_PARAMS, tensor("d"), *tail)
    return kir.define("mmq_tile", (type_a, align, with_ids), params, TILE_THREADS, body)


def _lists_kernel() -> kir.Kernel:
    """Per expert ctaid.x, the pairs token * n_used + slot with ids[token, slot] == expert, in
    order: counts[e] at lists[e], the pairs from lists[n_expert + e * cap]. Each thread scans a
    run of the pairs, counts, and writes at its prefix sum (a Hillis-Steele scan)."""

    def body(k: kir.KernelBuilder) -> None:
        b, ids, lists = k.b, k.args["ids"], k.args["lists"]
        expert, t = k.ctaid(0), k.tid(0)
        n_used, total = ids.ne[0], b.mul(ids.ne[0], ids.ne[1])
        per = b.udiv(b.add(total, k.i32(LISTS_THREADS - 1)), k.i32(LISTS_THREADS))
        start = b.mul(t, per)
        stop = b.add(start, per)
        stop = k.select(b.icmp_signed("<", stop, total), stop, total)

        def chose(p):
            v = k.load(ids.ptr, I32, k.offset(ids, b.urem(p, n_used), b.udiv(p, n_used)))
            return b.icmp_signed("==", v, expert)

        count = k.var(I32, k.i32(0))
        with k.loop(start, stop) as p:
            k.set(count, b.add(k.get(count, I32), b.zext(chose(p), I32)))
        mine = k.get(count, I32)
        scan = k.shared(I32, LISTS_THREADS, "scan")
        k.sstore(mine, scan, t)
        k.barrier()
        inclusive, step = mine, 1
        while step < LISTS_THREADS:
            behind = k.sload(scan, k.select(b.icmp_signed(">=", t, k.i32(step)), b.sub(t, k.i32(step)), t))
            inclusive = b.add(inclusive, k.select(b.icmp_signed(">=", t, k.i32(step)), behind, k.i32(0)))
            k.barrier()
            k.sstore(inclusive, scan, t)
            k.barrier()
            step *= 2
        first = b.add(k.args["n_expert"], b.mul(expert, k.args["cap"]))
        pos = k.var(I32, b.add(first, b.sub(inclusive, mine)))
        with k.loop(start, stop) as p:
            with k.if_then(chose(p)):
                at = k.get(pos, I32)
                k.store(p, lists, b.shl(b.zext(at, I64), ir.Constant(I64, 2)))
                k.set(pos, b.add(at, k.i32(1)))
        with k.if_then(b.icmp_unsigned("==", t, k.i32(LISTS_THREADS - 1))):
            k.store(inclusive, lists, b.shl(b.zext(expert, I64), ir.Constant(I64, 2)))

    params = (tensor("ids"), scalar("lists", "p"), scalar("n_expert", "i"), scalar("cap", "i"))
    return kir.define("mmq_lists", (), params, LISTS_THREADS, body)


# -- lowering --------------------------------------------------------------------------------------------
def supports(node) -> bool:
    """A MulMat or MulMatId of a block-quantized src0 in one of SPECS' types, b f32 or f16."""
    a, b = node.inputs[0], node.inputs[1]
    if a.dtype.name not in SPECS or b.dtype.name not in B_TYPES or node.dtype.name != "f32":
        return False
    if node.is_op(ops.MulMatId):
        return node.inputs[2].dtype.name == "i32"
    return node.is_op(ops.MulMat)


def lower(k, node, srcs, dst) -> None:
    """Launch the conversion of b and the products for a node `supports` accepts."""
    if node.is_op(ops.MulMatId):
        _lower_mul_mat_id(k, node, srcs, dst)
    else:
        _lower_mul_mat(k, node, srcs, dst)


def _ne(ttype) -> list[int]:
    """ne0..ne3 (ggml's order) of a rank <= 4 type."""
    shape = [int(d) for d in ttype.shape]
    return list(reversed(shape)) + [1] * (4 - len(shape))


def _alignment(ttype, td, spec: QuantSpec) -> int:
    """The alignment (up to 16) every block of the weight has: its address, strides and block size."""
    ptr, *_, nb1, nb2, nb3 = tensor_args(ttype, td)
    return math.gcd(16, spec.size, ptr, nb1, nb2, nb3)


def _scratch(k, nbytes: int) -> int:
    """A 16-byte aligned device address of `nbytes` of scratch memory."""
    return ceil_div(device_ptr(k.scratch(nbytes + 16)), 16) * 16


def _convert_b(k, spec: QuantSpec, b_in, b_td, qb: int, n_rows: int) -> list[int]:
    """Launch b's conversion into scratch at `qb`; returns the kernels' arguments for it."""
    n_k = _ne(b_in.type)[0]
    layout = BLayout.of(spec.vdt, n_k)
    units = n_rows * (n_k // b_block(spec.vdt))
    b_args = [qb, layout.pitch, layout.sums_at]
    k.launch(_quantize_b_kernel(spec.vdt, b_in.dtype.name), (ceil_div(units, QUANT_WARPS), 1, 1),
             [(b_in.type, b_td), *b_args, units])
    return b_args


def _check_grid(node, *dims: int) -> None:
    if max(dims) > MAX_GRID_Y:
        raise BackendError(f"cuda: {node.op.name} {node.name!r} needs a grid axis of {max(dims)} blocks "
                           f"(at most {MAX_GRID_Y})")


def _lower_mul_mat(k, node, srcs, dst) -> None:
    a_in, b_in = node.inputs
    spec = SPECS[a_in.dtype.name]
    ne_a, ne_d = _ne(a_in.type), _ne(node.type)
    n_rows_a, n = ne_a[1], ne_d[1]
    batches = ne_d[2] * ne_d[3]
    if 0 in ne_d:
        return
    qb = _scratch(k, BLayout.of(spec.vdt, ne_a[0]).pitch * n * batches)
    b_args = _convert_b(k, spec, b_in, srcs[1], qb, n * batches)
    align = _alignment(a_in.type, srcs[0], spec)
    args = [(a_in.type, srcs[0]), *b_args, (node.type, dst), ne_d[2] // ne_a[2], ne_d[3] // ne_a[3]]
    if n <= MV_MAX_COLS:
        _check_grid(node, batches)
        k.launch(_matvec_kernel(a_in.dtype.name, n, align, False), (ceil_div(n_rows_a, MV_ROWS), batches, 1), args)
    else:
        _check_grid(node, ceil_div(n, BN), batches)
        k.launch(_tile_kernel(a_in.dtype.name, align, False), (ceil_div(n_rows_a, BM), ceil_div(n, BN), batches), args)


def _lower_mul_mat_id(k, node, srcs, dst) -> None:
    w_in, b_in, ids_in = node.inputs
    spec = SPECS[w_in.dtype.name]
    n_rows_a, n_expert = _ne(w_in.type)[1:3]
    n_b = _ne(b_in.type)[1]
    n_used, n_tok = _ne(node.type)[1:3]
    if 0 in (n_rows_a, n_used, n_tok):
        return
    qb_bytes = BLayout.of(spec.vdt, _ne(w_in.type)[0]).pitch * n_b * n_tok
    align = _alignment(w_in.type, srcs[0], spec)
    if n_tok <= MV_MAX_COLS:
        qb = _scratch(k, qb_bytes)
        b_args = _convert_b(k, spec, b_in, srcs[1], qb, n_b * n_tok)
        _check_grid(node, n_used, n_tok)
        k.launch(_matvec_kernel(w_in.dtype.name, 1, align, True), (ceil_div(n_rows_a, MV_ROWS), n_used, n_tok),
                 [(w_in.type, srcs[0]), *b_args, (node.type, dst), (ids_in.type, srcs[2]), n_b])
        return
    cap = n_tok * n_used
    qb = _scratch(k, qb_bytes + 4 * (n_expert + n_expert * cap))
    lists = qb + qb_bytes
    b_args = _convert_b(k, spec, b_in, srcs[1], qb, n_b * n_tok)
    k.launch(_lists_kernel(), (n_expert, 1, 1), [(ids_in.type, srcs[2]), lists, n_expert, cap])
    n_tiles = ceil_div(cap, BN)
    split = min(n_tiles, ceil_div(n_tiles, n_expert) + 1)  # column tiles of one expert run side by side
    _check_grid(node, n_expert, split)
    k.launch(_tile_kernel(w_in.dtype.name, align, True), (ceil_div(n_rows_a, BM), n_expert, split),
             [(w_in.type, srcs[0]), *b_args, (node.type, dst), lists, cap, n_b])
