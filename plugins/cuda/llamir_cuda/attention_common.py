"""What the attention kernels share (kernels_attention.py tells the design): the variant key, the
parameters, K/V element loads (floats and ggml's legacy quant blocks), and the kernels' view of a
launch: row geometry, ALiBi slopes, logits, the online softmax's rescale and the finish."""

from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from llamir_cuda import kir
from llamir_cuda.kir import F32, I8, I16, I32, scalar, tensor

FLOAT_KV = ("f32", "f16", "bf16")
QUANT_KV = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")  # ggml's legacy blocks of 32 along ne0
QK = 32
ELEMENT_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24, "q8_0": 34}
NEG_INF = float("-inf")


@dataclass(frozen=True)
class Variant:
    """What an attention kernel's body depends on besides its arguments."""

    k_type: str
    v_type: str
    mask_type: str | None
    sinks: bool
    softcap: bool
    alibi: bool
    v_trans: bool        # soft_max_attn: V stored [n, dv], y [dv, T, H, S]
    dense: bool          # q, k, v and the mask have the element (or block) as their ne0 stride
    dk: int
    dv: int


def attn_params(var: Variant, *extra: kir.Param) -> tuple[kir.Param, ...]:
    """q, k, v [, mask] [, sinks], y, then the scalars of _attention's launch (and `extra`)."""
    inputs = [tensor("q"), tensor("k"), tensor("v")]
    inputs += [tensor("mask")] if var.mask_type else []
    inputs += [tensor("sinks")] if var.sinks else []
    return (*inputs, tensor("y"), scalar("scale", "f"), scalar("softcap", "f"), scalar("m0_log2", "f"),
            scalar("m1_log2", "f"), scalar("n_head_log2", "i"), *extra)


@dataclass
class Row:
    """A query row of a block: whether it exists, its token, head and stream, its ALiBi slope and
    the byte offset of its mask row (its index is clamped, so every read stays in bounds)."""

    valid: ir.Value
    t: ir.Value
    h: ir.Value
    s: ir.Value
    slope: ir.Value | None = None
    mask_off: ir.Value | None = None


def load_kv(k: kir.KernelBuilder, t: kir.Tensor, dtype: str, i0, i1, i2, i3) -> ir.Value:
    """Element (i0, i1, i2, i3) of a K or V tensor as f32: a float, or a value of a legacy quant
    block (ggml's layouts: f16 d [, f16 m] [, u32 qh], then the quants)."""
    if dtype in FLOAT_KV:
        return k.load_f32(t.ptr, k.offset(t, i0, i1, i2, i3), dtype)
    b = k.b
    base = k.offset(t, b.lshr(i0, k.i32(5)), i1, i2, i3)
    j = b.and_(i0, k.i32(QK - 1))

    def at(byte: int, index=None):
        off = b.add(base, k.i64(byte))
        return off if index is None else b.add(off, b.zext(index, off.type))

    def half(byte: int):
        return k.h2f(k.load(t.ptr, I16, at(byte)))

    def nibble(qs: int):  # values 0..15 are the low nibbles of qs[0..15], 16..31 the high ones
        byte = b.zext(k.load(t.ptr, I8, at(qs, b.and_(j, k.i32(15)))), I32)
        return b.and_(b.lshr(byte, b.mul(b.lshr(j, k.i32(4)), k.i32(4))), k.i32(15))

    def fifth_bit(qh: int):  # bit j of the little-endian u32 qh
        byte = b.zext(k.load(t.ptr, I8, at(qh, b.lshr(j, k.i32(3)))), I32)
        return b.shl(b.and_(b.lshr(byte, b.and_(j, k.i32(7))), k.i32(1)), k.i32(4))

    d = half(0)
    if dtype == "q8_0":
        return b.fmul(d, b.sitofp(k.load(t.ptr, I8, at(2, j)), F32))
    if dtype == "q4_0":
        return b.fmul(d, b.sitofp(b.sub(nibble(2), k.i32(8)), F32))
    if dtype == "q4_1":
        return k.fma(d, b.uitofp(nibble(4), F32), half(2))
    if dtype == "q5_0":
        return b.fmul(d, b.sitofp(b.sub(b.or_(nibble(6), fifth_bit(2)), k.i32(16)), F32))
    if dtype == "q5_1":
        return k.fma(d, b.uitofp(b.or_(nibble(8), fifth_bit(4)), F32), half(2))
    raise ValueError(f"no K/V load of {dtype}")


def imin(k: kir.KernelBuilder, a: ir.Value, c: ir.Value) -> ir.Value:
    return k.select(k.b.icmp_signed("<", a, c), a, c)


def pack_h2(k: kir.KernelBuilder, lo: ir.Value, hi: ir.Value) -> ir.Value:
    """Two f32 as the f16 pair of a 32-bit register (lo in the low half, as mma reads it)."""
    b = k.b
    return b.or_(b.zext(k.f2h(lo), I32), b.shl(b.zext(k.f2h(hi), I32), k.i32(16)))


class AttnView:
    """An attention kernel's view of its launch: tensors, row geometry, and the steps of the
    softmax that both kernels take the same way."""

    def __init__(self, k: kir.KernelBuilder, var: Variant):
        self.k, self.var, b = k, var, k.b
        args = k.args
        self.q, self.kt, self.vt, self.y = args["q"], args["k"], args["v"], args["y"]
        self.mask, self.sinks = args.get("mask"), args.get("sinks")
        if var.dense:  # constant ne0 strides: the dims' offsets fold into the loads' immediates
            types = ((self.q, "f32"), (self.kt, var.k_type), (self.vt, var.v_type), (self.mask, var.mask_type))
            for t, dtype in types:
                if t is not None:
                    t.nb[0] = k.i64(ELEMENT_BYTES[dtype])
        self.group = b.sdiv(self.q.ne[2], self.kt.ne[2])
        self.n_rows = b.mul(self.q.ne[1], self.group)
        self.n_kv = self.kt.ne[1]

    def kv_stream(self, s: ir.Value) -> ir.Value:
        b = self.k.b
        return b.sdiv(s, b.sdiv(self.q.ne[3], self.kt.ne[3]))

    def k_at(self, d, cell, kvh, kvs) -> ir.Value:
        return load_kv(self.k, self.kt, self.var.k_type, d, cell, kvh, kvs)

    def v_at(self, d, cell, kvh, kvs) -> ir.Value:
        if self.var.v_trans:
            return load_kv(self.k, self.vt, self.var.v_type, cell, d, kvh, kvs)
        return load_kv(self.k, self.vt, self.var.v_type, d, cell, kvh, kvs)

    def row(self, j: ir.Value, kvh: ir.Value, s: ir.Value, scores: bool = True) -> Row:
        """Row j of KV head kvh and stream s (with its slope and mask row when `scores`)."""
        k, b = self.k, self.k.b
        valid = b.icmp_signed("<", j, self.n_rows)
        j = k.select(valid, j, b.sub(self.n_rows, k.i32(1)))
        t = b.sdiv(j, self.group)
        h = b.add(b.mul(kvh, self.group), b.srem(j, self.group))
        row = Row(valid, t, h, s)
        if scores:
            row.slope = self._slope(h)
            if self.mask is not None:
                m = self.mask
                row.mask_off = k.offset(m, None, b.srem(t, m.ne[1]), b.srem(h, m.ne[2]), b.srem(s, m.ne[3]))
        return row

    def _slope(self, h: ir.Value) -> ir.Value:
        """ALiBi's m0^(h+1) for the first n_head_log2 heads, m1^(2(h - n_head_log2) + 1) after."""
        k, b = self.k, self.k.b
        if not self.var.alibi:
            return k.f32(1.0)
        n_log2 = k.args["n_head_log2"]
        first = b.icmp_signed("<", h, n_log2)
        power = k.select(first, b.add(h, k.i32(1)), b.add(b.mul(b.sub(h, n_log2), k.i32(2)), k.i32(1)))
        base_log2 = k.select(first, k.args["m0_log2"], k.args["m1_log2"])
        return k.exp2(b.fmul(b.sitofp(power, F32), base_log2))

    def logit(self, x: ir.Value, row: Row, cell: ir.Value) -> ir.Value:
        """softcap(x) + slope * mask[cell] for x = q.k * scale (scale already over softcap)."""
        k, b = self.k, self.k.b
        if self.var.softcap:
            x = b.fmul(k.args["softcap"], k.tanh(x))
        if self.mask is not None:
            off = b.add(row.mask_off, b.mul(b.sext(cell, self.mask.nb[0].type), self.mask.nb[0]))
            mv = k.load_f32(self.mask.ptr, off, self.var.mask_type)
            x = k.fma(row.slope, mv, x) if self.var.alibi else b.fadd(x, mv)
        return x

    def finish(self, row: Row, m: ir.Value, s: ir.Value, acc: ir.Value) -> ir.Value:
        """acc / S once the row's sink logit has joined the softmax; 0 for a row without a live cell."""
        k, b = self.k, self.k.b
        if self.sinks is not None:
            sink = k.load_f32(self.sinks.ptr, k.offset(self.sinks, row.h), "f32")
            big = b.fcmp_ordered(">", sink, m)
            ms = k.select(big, k.exp(b.fsub(m, sink)), k.f32(1.0))
            acc = b.fmul(acc, ms)
            s = k.select(big, k.fma(s, ms, k.f32(1.0)), b.fadd(s, k.exp(b.fsub(sink, m))))
        return k.select(b.fcmp_ordered("==", s, k.f32(0.0)), k.f32(0.0), b.fdiv(acc, s))

    def store_y(self, row: Row, d: ir.Value, value: ir.Value) -> None:
        k, y = self.k, self.y
        index = (d, row.t, row.h, row.s) if self.var.v_trans else (d, row.h, row.t, row.s)
        k.store(value, y.ptr, k.offset(y, *index))

    def rescale(self, m_old: ir.Value, tile_max: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value]:
        """(M', live, ms): the new running max, whether any cell so far is live, and the factor
        that rescales the old sum and accumulator (exp(M - M'), 1 while nothing is live)."""
        k, b = self.k, self.k.b
        m_new = k.fmax(m_old, tile_max)
        live = b.fcmp_ordered("!=", m_new, k.f32(NEG_INF))
        return m_new, live, k.select(live, k.exp(b.fsub(m_old, m_new)), k.f32(1.0))

    def prob(self, live: ir.Value, score: ir.Value, m_new: ir.Value) -> ir.Value:
        k = self.k
        return k.select(live, k.exp(k.b.fsub(score, m_new)), k.f32(0.0))
