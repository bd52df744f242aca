"""Block formats in LLVM IR: scalar dequantisation of every GGUF type llamir reads, and ggml's
reference quantizers (quantize_row_*_ref) for the types a KV cache or a cpy may store.

Arithmetic follows ir/quants.py (itself ggml's dequantize_row_* / quantize_row_*_ref): the same
float32 operations in the same order, so values agree bit for bit.
"""

from __future__ import annotations

import llvmlite.ir as ir

from llamir.backends.llvm.emit import F16, F32, I8, I32, I64, Emitter

DEQUANT_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k")
QUANTIZE_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")


def f16_at(em: Emitter, blk, offset) -> ir.Value:
    return em.b.fpext(em.load(F16, blk, offset), F32)


def byte_at(em: Emitter, blk, offset) -> ir.Value:
    """Unsigned byte as i32."""
    return em.b.zext(em.load(I8, blk, offset), I32)


def _i32(em: Emitter, v: int) -> ir.Constant:
    return ir.Constant(I32, v)


def _nibble(em: Emitter, blk, base: int, j):
    """Element j (< 32) of a 16-byte nibble field at `base`: low nibbles first, then high."""
    b = em.b
    j32 = em.b.trunc(em.i64(j), I32) if not isinstance(j, int) else _i32(em, j)
    high = b.icmp_unsigned(">=", j32, _i32(em, 16))
    byte = byte_at(em, blk, em.add(base, em.rem(j, 16)))
    return b.select(high, b.lshr(byte, _i32(em, 4)), b.and_(byte, _i32(em, 15)))


def _qh_bit(em: Emitter, blk, base: int, j):
    """Bit j of the little-endian u32 at `base`, as 0 or 16."""
    b = em.b
    qh = em.load(I32, blk, base)
    j32 = em.b.trunc(em.i64(j), I32) if not isinstance(j, int) else _i32(em, j)
    return b.shl(b.and_(b.lshr(qh, j32), _i32(em, 1)), _i32(em, 4))


def _k4_scale_min(em: Emitter, blk, sb):
    """get_scale_min_k4(sb, scales at byte 4) -> (sc, m) as i32."""
    b = em.b
    sb = em.i64(sb)
    lo = em.icmp("<", sb, 4)
    s = 4  # scales offset in the block
    q_j = byte_at(em, blk, em.add(s, em.min(sb, 11)))
    q_j4 = byte_at(em, blk, em.add(s, em.min(em.add(sb, 4), 11)))
    q_jm4 = byte_at(em, blk, em.add(s, em.max(em.sub(sb, 4), 0)))
    sc_lo = b.and_(q_j, _i32(em, 63))
    m_lo = b.and_(q_j4, _i32(em, 63))
    sc_hi = b.or_(b.and_(q_j4, _i32(em, 15)), b.shl(b.lshr(q_jm4, _i32(em, 6)), _i32(em, 4)))
    m_hi = b.or_(b.lshr(q_j4, _i32(em, 4)), b.shl(b.lshr(q_j, _i32(em, 6)), _i32(em, 4)))
    return b.select(lo, sc_lo, sc_hi), b.select(lo, m_lo, m_hi)


def dequant_value(em: Emitter, dtype: str, blk, j) -> ir.Value:
    """f32 value of element j of the block at `blk` (ggml's dequantize_row_* arithmetic)."""
    b = em.b

    def f(v):
        return b.sitofp(v, F32)

    if dtype == "q8_0":
        return b.fmul(f(b.sext(em.load(I8, blk, em.add(2, j)), I32)), f16_at(em, blk, 0))
    if dtype == "q4_0":
        return b.fmul(f(b.sub(_nibble(em, blk, 2, j), _i32(em, 8))), f16_at(em, blk, 0))
    if dtype == "q4_1":
        return b.fadd(b.fmul(f(_nibble(em, blk, 4, j)), f16_at(em, blk, 0)), f16_at(em, blk, 2))
    if dtype == "q5_0":
        q = b.or_(_nibble(em, blk, 6, j), _qh_bit(em, blk, 2, j))
        return b.fmul(f(b.sub(q, _i32(em, 16))), f16_at(em, blk, 0))
    if dtype == "q5_1":
        q = b.or_(_nibble(em, blk, 8, j), _qh_bit(em, blk, 4, j))
        return b.fadd(b.fmul(f(q), f16_at(em, blk, 0)), f16_at(em, blk, 2))
    if dtype in ("q4_k", "q5_k"):
        c, l = em.div(j, 64), em.rem(j, 64)
        high = em.icmp(">=", l, 32)
        sb = em.add(em.mul(c, 2), b.zext(high, I64))
        sc, m = _k4_scale_min(em, blk, sb)
        d1 = b.fmul(f16_at(em, blk, 0), f(sc))
        m1 = b.fmul(f16_at(em, blk, 2), f(m))
        qs = 16 if dtype == "q4_k" else 48
        byte = byte_at(em, blk, em.add(qs, em.add(em.mul(c, 32), em.rem(l, 32))))
        q = b.select(high, b.lshr(byte, _i32(em, 4)), b.and_(byte, _i32(em, 15)))
        if dtype == "q5_k":
            hbyte = byte_at(em, blk, em.add(16, em.rem(l, 32)))
            bit = b.and_(b.lshr(hbyte, b.trunc(em.i64(sb), I32)), _i32(em, 1))
            q = b.add(q, b.shl(bit, _i32(em, 4)))
        return b.fsub(b.fmul(d1, f(q)), m1)
    if dtype == "q6_k":
        h, i = em.div(j, 128), em.rem(j, 128)
        k, l = em.div(i, 32), em.rem(i, 32)
        ql = byte_at(em, blk, em.add(em.add(em.mul(h, 64), em.mul(em.rem(k, 2), 32)), l))
        nib = b.select(em.icmp(">=", k, 2), b.lshr(ql, _i32(em, 4)), b.and_(ql, _i32(em, 15)))
        qh = byte_at(em, blk, em.add(128, em.add(em.mul(h, 32), l)))
        hi2 = b.and_(b.lshr(qh, b.trunc(em.i64(em.mul(k, 2)), I32)), _i32(em, 3))
        q = b.sub(b.or_(nib, b.shl(hi2, _i32(em, 4))), _i32(em, 32))
        sub = em.add(em.add(em.mul(h, 8), em.mul(k, 2)), em.div(l, 16))
        sc = b.sext(em.load(I8, blk, em.add(192, sub)), I32)
        return b.fmul(b.fmul(f16_at(em, blk, 208), f(sc)), f(q))
    if dtype == "q2_k":
        return _q2_k(em, blk, j)
    if dtype == "q3_k":
        return _q3_k(em, blk, j)
    raise ValueError(f"no dequantisation for {dtype}")


def _crumb(em: Emitter, blk, qs: int, e):
    """The 2-bit value of element e (< 256) of a K-quant 64-byte qs field at `qs`."""
    b = em.b
    n, rest = em.div(e, 128), em.rem(e, 128)
    shift, l = em.div(rest, 32), em.rem(rest, 32)
    byte = byte_at(em, blk, em.add(qs, em.add(em.mul(n, 32), l)))
    return b.and_(b.lshr(byte, b.trunc(em.i64(em.mul(shift, 2)), I32)), _i32(em, 3))


def _q2_k(em: Emitter, blk, e):
    b = em.b
    sb = em.div(e, 16)
    sc = byte_at(em, blk, sb)
    dl = b.fmul(f16_at(em, blk, 80), b.sitofp(b.and_(sc, _i32(em, 15)), F32))
    ml = b.fmul(f16_at(em, blk, 82), b.sitofp(b.lshr(sc, _i32(em, 4)), F32))
    return b.fsub(b.fmul(dl, b.sitofp(_crumb(em, blk, 16, e), F32)), ml)


def _q3_k(em: Emitter, blk, e):
    b = em.b
    sb = em.div(e, 16)
    w, k = em.div(sb, 4), em.rem(sb, 4)
    a0 = byte_at(em, blk, em.add(96, k))
    a1 = byte_at(em, blk, em.add(100, k))
    tmp = byte_at(em, blk, em.add(104, k))
    w32 = b.trunc(em.i64(w), I32)
    src = b.select(b.icmp_unsigned("<", b.and_(w32, _i32(em, 1)), _i32(em, 1)), a0, a1)
    low = b.and_(b.lshr(src, b.mul(b.lshr(w32, _i32(em, 1)), _i32(em, 4))), _i32(em, 15))
    high = b.and_(b.lshr(tmp, b.mul(w32, _i32(em, 2))), _i32(em, 3))
    scale = b.sub(b.sext(b.trunc(b.or_(low, b.shl(high, _i32(em, 4))), I8), I32), _i32(em, 32))
    dl = b.fmul(f16_at(em, blk, 108), b.sitofp(scale, F32))
    bit, l = em.div(e, 32), em.rem(e, 32)
    hm = b.and_(b.lshr(byte_at(em, blk, l), b.trunc(em.i64(bit), I32)), _i32(em, 1))
    q = b.sub(_crumb(em, blk, 32, e), b.mul(_i32(em, 4), b.sub(_i32(em, 1), hm)))
    return b.fmul(dl, b.sitofp(q, F32))


# -- reference quantizers ----------------------------------------------------------------------
def quantize_block_cpu(em: Emitter, dtype: str, src_value, dst) -> None:
    """Quantize 32 values as ggml-cpu's from_float does (set_rows, cpy): the reference quantizer,
    except q8_0's AVX quantize_row_q8_0 (id = 127/amax, not 1/d; q rounded half to even)."""
    if dtype != "q8_0":
        quantize_block_ref(em, dtype, src_value, dst)
        return
    b = em.b
    amax = em.var(F32, em.f32(0.0))
    with em.loop(0, 32, name="amax") as j:
        em.set(amax, em.fmax(_fabs(em, src_value(j)), em.get(amax)))
    m = em.get(amax)
    inv = b.select(b.fcmp_ordered("!=", m, em.f32(0.0)), b.fdiv(em.f32(127.0), m), em.f32(0.0))
    em.store(b.fptrunc(b.fdiv(m, em.f32(127.0)), F16), dst, 0)
    with em.loop(0, 32, name="q") as j:
        q = em.intrinsic("llvm.rint.f32", F32, [b.fmul(src_value(j), inv)])
        em.store(b.trunc(b.fptosi(q, I32), I8), dst, em.add(2, j))


def quantize_block_ref(em: Emitter, dtype: str, src_value, dst) -> None:
    """Quantize 32 values (src_value(j) -> f32) into the block at `dst`, as quantize_row_*_ref."""
    b = em.b
    if dtype == "q8_0":
        amax = em.var(F32, em.f32(0.0))
        with em.loop(0, 32, name="amax") as j:
            x = _fabs(em, src_value(j))
            em.set(amax, em.fmax(x, em.get(amax)))
        d = b.fdiv(em.get(amax), em.f32(127.0))
        inv = _inverse(em, d)
        em.store(b.fptrunc(d, F16), dst, 0)
        with em.loop(0, 32, name="q") as j:
            q = em.intrinsic("llvm.round.f32", F32, [b.fmul(src_value(j), inv)])
            em.store(b.trunc(b.fptosi(q, I32), I8), dst, em.add(2, j))
        return
    if dtype in ("q4_0", "q5_0"):
        nmax = 8 if dtype == "q4_0" else 16
        amax, mx = em.var(F32, em.f32(0.0)), em.var(F32, em.f32(0.0))
        with em.loop(0, 32, name="amax") as j:
            x = src_value(j)
            ax = _fabs(em, x)
            bigger = b.fcmp_ordered("<", em.get(amax), ax)
            em.set(amax, b.select(bigger, ax, em.get(amax)))
            em.set(mx, b.select(bigger, x, em.get(mx)))
        d = b.fdiv(em.get(mx), em.f32(float(-nmax)))
        inv = _inverse(em, d)
        em.store(b.fptrunc(d, F16), dst, 0)
        qs = 2 if dtype == "q4_0" else 6

        def q_of(j):
            v = b.fadd(b.fmul(src_value(j), inv), em.f32(nmax + 0.5))
            return em.min(b.sext(b.fptosi(v, I32), I64), 2 * nmax - 1)

        _pack(em, dst, qs, q_of, high_bits=2 if dtype == "q5_0" else None)
        return
    if dtype in ("q4_1", "q5_1"):
        levels = 15 if dtype == "q4_1" else 31
        lo, hi = em.var(F32, src_value(0)), em.var(F32, src_value(0))
        with em.loop(1, 32, name="minmax") as j:
            x = src_value(j)
            em.set(lo, b.select(b.fcmp_ordered("<", x, em.get(lo)), x, em.get(lo)))
            em.set(hi, b.select(b.fcmp_ordered(">", x, em.get(hi)), x, em.get(hi)))
        mn = em.get(lo)
        d = b.fdiv(b.fsub(em.get(hi), mn), em.f32(float(levels)))
        inv = _inverse(em, d)
        em.store(b.fptrunc(d, F16), dst, 0)
        em.store(b.fptrunc(mn, F16), dst, 2)
        qs = 4 if dtype == "q4_1" else 8

        def q_of(j):
            q = b.fptosi(b.fadd(b.fmul(b.fsub(src_value(j), mn), inv), em.f32(0.5)), I32)
            return em.min(b.sext(q, I64), levels) if dtype == "q4_1" else q

        _pack(em, dst, qs, q_of, high_bits=4 if dtype == "q5_1" else None)
        return
    raise ValueError(f"no reference quantizer for {dtype}")


def _fabs(em: Emitter, x):
    return em.intrinsic("llvm.fabs.f32", F32, [x])


def _inverse(em: Emitter, d):
    b = em.b
    return b.select(b.fcmp_ordered("!=", d, em.f32(0.0)), b.fdiv(em.f32(1.0), d), em.f32(0.0))


def _pack(em: Emitter, dst, qs: int, q_of, high_bits: int | None) -> None:
    """Low nibbles of q[j] and q[j+16] into byte j of the qs field; bit 4 of each q into qh."""
    b = em.b
    qh = em.var(I32, _i32(em, 0))
    with em.loop(0, 16, name="pack") as j:
        q0 = b.trunc(em.i64(q_of(j)), I32)
        q1 = b.trunc(em.i64(q_of(em.add(j, 16))), I32)
        byte = b.or_(b.and_(q0, _i32(em, 15)), b.shl(b.and_(q1, _i32(em, 15)), _i32(em, 4)))
        em.store(b.trunc(byte, I8), dst, em.add(qs, j))
        if high_bits is not None:
            j32 = b.trunc(j, I32)
            bit0 = b.shl(b.and_(b.lshr(q0, _i32(em, 4)), _i32(em, 1)), j32)
            bit1 = b.shl(b.and_(b.lshr(q1, _i32(em, 4)), _i32(em, 1)), b.add(j32, _i32(em, 16)))
            em.set(qh, b.or_(em.get(qh), b.or_(bit0, bit1)))
    if high_bits is not None:
        em.store(em.get(qh), dst, high_bits)


