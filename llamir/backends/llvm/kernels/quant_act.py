"""Activation quantization for quantized matmuls: ggml's x86 from_float of the weight's
vec_dot_type (q8_0, q8_1: id = 127/amax, round half to even; q8_K: iscale = -127/max), written
in the layout the packed matmul reads. One row of K values becomes:

    qs    K int8                        (at 0)
    d     nb float32: the block scale the dot product uses (fp16-rounded for q8_0/q8_1)
    aux   nb float32: q8_1's fp16 s = d*sum(q); for q8_K, d * sum of the (sub-)block's q
    corr  nb*C int32: -offset * sum of each chunk (C = bs/4) or block (C = 1) of q, or nothing;
          for signed weights without VNNI ("abs"), K bytes |q| (vpmaddubsw's unsigned operand)
"""

from __future__ import annotations

from dataclasses import dataclass

import llvmlite.ir as ir

from llamir.backends.llvm.emit import F16, F32, I8, I32, Emitter, storage_type, vec
from llamir.backends.llvm.kernels.repack import QFormat
from llamir.backends.llvm.plan import Kernel, Ref


def act_layout(fmt: QFormat, K: int) -> tuple[int, int, int, int, int]:
    """(nb, off_d, off_aux, off_corr, row_bytes) of one quantized activation row."""
    nb = K // fmt.bs
    c = _n_corr(fmt)
    off_d = K
    off_aux = off_d + 4 * nb
    off_corr = off_aux + 4 * nb
    row = off_corr + (K if fmt.corr == "abs" else 4 * c * nb)
    return nb, off_d, off_aux, off_corr, -(-row // 64) * 64


def _n_corr(fmt: QFormat) -> int:
    return fmt.chunks if fmt.corr == "chunk" else (1 if fmt.corr == "block" else 0)


def _block_amax(em: Emitter, abs_at) -> ir.Value:
    """max |x| of a 32-value block as quantize_row_q8_0/1's AVX code folds it: four 8-lane vectors
    with maxps (a > b ? a : b, so a NaN survives only as the second operand), then the halves, the
    pairs and the last two; abs_at(i) gives |x[i]|."""
    b = em.b

    def maxps(x, y):
        return b.select(b.fcmp_ordered(">", x, y), x, y)

    lanes = [abs_at(i) for i in range(8)]
    for q in (1, 2, 3):
        lanes = [maxps(m, abs_at(8 * q + i)) for i, m in enumerate(lanes)]
    four = [maxps(lanes[4 + i], lanes[i]) for i in range(4)]
    return maxps(maxps(four[0], four[2]), maxps(four[1], four[3]))


class QuantAct(Kernel):
    """Quantize rows of b [.., N, K] (any float type, any row strides) for format `fmt`."""

    def __init__(self, out, src: Ref, fmt: QFormat, K: int):
        src = src.padded()
        self.fmt = fmt
        self.K = K
        self.src_dtype = src.dtype.name
        self.n_ptrs = 2
        super().__init__(list(src.shape[:3]) + list(src.strides))

    def config(self) -> tuple:
        return (self.fmt.vdt, self.fmt.bs, self.fmt.corr, self.fmt.offset, self.K, self.src_dtype)

    def emit(self, em: Emitter, a) -> None:
        from llamir.backends.llvm.kernels.rows import row_pointer

        shape, st = a.ints[0:3], a.ints[3:7]
        rows = em.n_rows(shape)
        r0, r1 = em.split(rows, a.ith, a.nth)
        nb, off_d, off_aux, off_corr, row_bytes = act_layout(self.fmt, self.K)
        ety = storage_type(self.src_dtype)
        with em.loop(r0, r1, name="row") as r:
            src = row_pointer(em, a.ptrs[1], r, shape, st[:3])
            dst = em.gep(a.ptrs[0], em.mul(r, row_bytes))

            def x_at(i):
                return em.to_f32(em.load(ety, src, em.mul(i, st[3])), self.src_dtype)

            if self.fmt.vdt == "q8_k":
                self._q8_k(em, x_at, dst, off_d, off_aux, off_corr)
            else:
                self._q8_01(em, x_at, dst, off_d, off_aux, off_corr)

    def _q8_01(self, em: Emitter, x_at, dst, off_d, off_aux, off_corr) -> None:
        b = em.b
        with em.loop(0, self.K // 32, name="blk") as k:
            base = em.mul(k, 32)
            am = _block_amax(em, lambda i: em.intrinsic("llvm.fabs.f32", F32, [x_at(em.add(base, i))]))
            d = b.fdiv(am, em.f32(127.0))
            # `max_scalar != 0.0f`: unordered-or-not-equal, so a NaN amax gives a NaN id
            inv = b.select(b.fcmp_unordered("!=", am, em.f32(0.0)), b.fdiv(em.f32(127.0), am), em.f32(0.0))
            total = em.var(I32, ir.Constant(I32, 0))
            with em.loop(0, 32, name="q") as j:
                v = em.intrinsic("llvm.roundeven.f32", F32, [b.fmul(x_at(em.add(base, j)), inv)])
                nan = b.fcmp_unordered("uno", v, v)          # cvtps2dq's integer indefinite
                q32 = b.select(nan, ir.Constant(I32, -(2**31)), b.fptosi(b.select(nan, em.f32(0.0), v), I32))
                q = b.fptosi(em.fmin(em.fmax(v, em.f32(-128.0)), em.f32(127.0)), I32)   # packs saturate
                em.store(b.trunc(q, I8), dst, em.add(base, j))
                em.set(total, b.add(em.get(total), q32))
            em.store(b.fpext(b.fptrunc(d, F16), F32), dst, em.add(off_d, em.mul(k, 4)))
            if self.fmt.vdt == "q8_1":
                s = b.fmul(b.sitofp(em.get(total), F32), d)
                em.store(b.fpext(b.fptrunc(s, F16), F32), dst, em.add(off_aux, em.mul(k, 4)))
            self._corrections(em, dst, k, base, off_corr)

    def _corrections(self, em: Emitter, dst, k, base, off_corr) -> None:
        b = em.b
        fmt = self.fmt
        neg = ir.Constant(I32, -fmt.offset)
        if fmt.corr == "abs":
            q = em.load(vec(I8, 32), dst, base)
            em.store(b.select(b.icmp_signed("<", q, ir.Constant(vec(I8, 32), [0] * 32)), b.neg(q), q),
                     dst, em.add(off_corr, base))
        elif fmt.corr == "block":    # from the stored bytes: a NaN's -128, not q8_1's integer indefinite
            stored = em.reduce_int_add(b.sext(em.load(vec(I8, fmt.bs), dst, base), vec(I32, fmt.bs)))
            em.store(b.mul(stored, neg), dst, em.add(off_corr, em.mul(k, 4)))
        elif fmt.corr == "chunk":
            with em.loop(0, fmt.chunks, name="chunk") as c:
                s = ir.Constant(I32, 0)
                for t in range(4):
                    s = b.add(s, b.sext(em.load(I8, dst, em.add(base, em.add(em.mul(c, 4), t))), I32))
                em.store(b.mul(s, neg), dst, em.add(off_corr, em.mul(em.add(em.mul(k, fmt.chunks), c), 4)))

    def _q8_k(self, em: Emitter, x_at, dst, off_d, off_aux, off_corr) -> None:
        b = em.b
        bs = self.fmt.bs
        per = 256 // bs
        with em.loop(0, self.K // 256, name="sblk") as s:
            base = em.mul(s, 256)
            amax, mx = em.var(F32, em.f32(0.0)), em.var(F32, em.f32(0.0))
            with em.loop(0, 256, name="max") as j:
                x = x_at(em.add(base, j))
                ax = em.intrinsic("llvm.fabs.f32", F32, [x])
                bigger = b.fcmp_ordered("<", em.get(amax), ax)
                em.set(amax, b.select(bigger, ax, em.get(amax)))
                em.set(mx, b.select(bigger, x, em.get(mx)))
            m = em.get(mx)
            zero = b.fcmp_ordered("==", m, em.f32(0.0))
            iscale = b.select(zero, em.f32(0.0), b.fdiv(em.f32(-127.0), m))
            d = b.select(zero, em.f32(0.0), b.fdiv(em.f32(1.0), iscale))
            with em.loop(0, per, name="sub") as t:
                k = em.add(em.mul(s, per), t)
                sub = em.add(base, em.mul(t, bs))
                total = em.var(I32, ir.Constant(I32, 0))
                with em.loop(0, bs, name="q") as j:
                    v = em.intrinsic("llvm.roundeven.f32", F32, [b.fmul(iscale, x_at(em.add(sub, j)))])
                    v = b.select(b.fcmp_unordered("uno", v, v), em.f32(0.0), v)   # nearest_int(NaN) is 0
                    v = em.fmin(em.fmax(v, em.f32(-128.0)), em.f32(127.0))
                    q = b.fptosi(v, I32)
                    em.store(b.trunc(q, I8), dst, em.add(sub, j))
                    em.set(total, b.add(em.get(total), q))
                em.store(d, dst, em.add(off_d, em.mul(k, 4)))
                em.store(b.fmul(d, b.sitofp(em.get(total), F32)), dst, em.add(off_aux, em.mul(k, 4)))
                self._corrections(em, dst, k, sub, off_corr)


# -- Q8_K rows for the K-quant kernels (matmul_quant_k.py) ----------------------------------------------
@dataclass(frozen=True)
class KActLayout:
    """Where the parts of one Q8_K activation row for MatMulQK are (byte offsets):

    qs       K int8 (quantize_row_q8_K_ref), at 0
    d        nb float32
    bsums    nb*16 int32: sums of 16 consecutive q
    pairs16  nb*8 int32: (bsums[2l], bsums[2l+1]) as two int16 (Q2_K's mins pairs, vpmaddwd)
    pairs32  nb*4 int32: (s[2l], s[2l+1]) of the 32-value sums s (Q4_K/Q5_K's mins pairs)
    chunk4   nb*64 int32: per 4-value chunk, 4*(q0+q1) in the low int16 and 4*(q2+q3) in the high
             one (what Q3_K's +4 adds to a vpmaddubsw of that chunk)"""

    K: int

    @property
    def nb(self) -> int:
        return self.K // 256

    @property
    def d(self) -> int:
        return self.K

    @property
    def bsums(self) -> int:
        return self.d + 4 * self.nb

    @property
    def pairs16(self) -> int:
        return self.bsums + 64 * self.nb

    @property
    def pairs32(self) -> int:
        return self.pairs16 + 32 * self.nb

    @property
    def chunk4(self) -> int:
        return self.pairs32 + 16 * self.nb

    @property
    def row_bytes(self) -> int:
        return -(-(self.chunk4 + 256 * self.nb) // 64) * 64


def _i16_pair(b, lo, hi):
    return b.or_(b.and_(lo, ir.Constant(I32, 0xFFFF)), b.shl(hi, ir.Constant(I32, 16)))


class QuantActK(Kernel):
    """Quantize rows of b [.., N, K] (any float type, any row strides) to KActLayout rows."""

    def __init__(self, out, src: Ref, K: int):
        src = src.padded()
        self.K = K
        self.src_dtype = src.dtype.name
        self.n_ptrs = 2
        super().__init__(list(src.shape[:3]) + list(src.strides))

    def config(self) -> tuple:
        return (self.K, self.src_dtype)

    def emit(self, em: Emitter, a) -> None:
        from llamir.backends.llvm.kernels.rows import row_pointer

        shape, st = a.ints[0:3], a.ints[3:7]
        r0, r1 = em.split(em.n_rows(shape), a.ith, a.nth)
        lay = KActLayout(self.K)
        ety = storage_type(self.src_dtype)
        with em.loop(r0, r1, name="row") as r:
            src = row_pointer(em, a.ptrs[1], r, shape, st[:3])
            dst = em.gep(a.ptrs[0], em.mul(r, lay.row_bytes))

            def x_at(i):
                return em.to_f32(em.load(ety, src, em.mul(i, st[3])), self.src_dtype)

            with em.loop(0, lay.nb, name="sblk") as s:
                self._super_block(em, x_at, dst, s, lay)

    def _super_block(self, em: Emitter, x_at, dst, s, lay: KActLayout) -> None:
        b = em.b
        base = em.mul(s, 256)
        m = self._signed_max(em, x_at, base)
        zero = b.fcmp_ordered("==", m, em.f32(0.0))
        iscale = b.select(zero, em.f32(0.0), b.fdiv(em.f32(-127.0), m))
        em.store(b.select(zero, em.f32(0.0), b.fdiv(em.f32(1.0), iscale)), dst, em.add(lay.d, em.mul(s, 4)))

        def at(field: str, index):                     # byte offset of int32 entry `index` of super-block s
            per = {"chunk4": 64, "pairs16": 8, "pairs32": 4}.get(field, 16)
            return em.add(getattr(lay, field), em.mul(em.add(em.mul(s, per), index), 4))

        with em.loop(0, 4, name="quad") as p:          # 64 values: two 32-sums of two 16-sums each
            sums32 = []
            for h32 in range(2):
                sums16 = []
                for h16 in range(2):
                    t = em.add(em.mul(p, 4), 2 * h32 + h16)
                    sums16.append(self._sixteen(em, x_at, dst, iscale, base, t, at, lay))
                em.store(_i16_pair(b, *sums16), dst, at("pairs16", em.add(em.mul(p, 2), h32)))
                sums32.append(b.add(*sums16))
            em.store(_i16_pair(b, *sums32), dst, at("pairs32", p))

    def _signed_max(self, em: Emitter, x_at, base):
        """The first value of largest magnitude among base .. base+255 (the reference's scan with
        `amax < fabsf(x)`): 16 lanes each keep their first maximum and its position, then the
        earliest position among the lanes holding the largest magnitude wins."""
        b = em.b
        v16f, v16i = vec(F32, 16), vec(I32, 16)
        amax, mx = em.var(v16f, ir.Constant(v16f, [0.0] * 16)), em.var(v16f, ir.Constant(v16f, [0.0] * 16))
        where = em.var(v16i, ir.Constant(v16i, list(range(16))))
        with em.loop(0, 16, name="max") as t:
            xv = ir.Constant(v16f, None)
            for u in range(16):
                xv = b.insert_element(xv, x_at(em.add(base, em.add(em.mul(t, 16), u))), ir.Constant(I32, u))
            ax = em.intrinsic("llvm.fabs.v16f32", v16f, [xv])
            bigger = b.fcmp_ordered("<", em.get(amax), ax)
            em.set(amax, b.select(bigger, ax, em.get(amax)))
            em.set(mx, b.select(bigger, xv, em.get(mx)))
            pos = b.add(em.splat(b.trunc(em.mul(t, 16), I32), 16, I32), ir.Constant(v16i, list(range(16))))
            em.set(where, b.select(bigger, pos, em.get(where)))
        top = em.reduce_fmax(em.get(amax))
        cand = b.fcmp_ordered("==", em.get(amax), em.splat(top, 16))
        pos = b.select(cand, em.get(where), ir.Constant(v16i, [1 << 30] * 16))
        first = em.intrinsic("llvm.vector.reduce.umin.v16i32", I32, [pos])
        return b.extract_element(em.get(mx), b.and_(first, ir.Constant(I32, 15)))

    def _sixteen(self, em: Emitter, x_at, dst, iscale, base, t, at, lay: KActLayout):
        """Quantize values 16t .. 16t+15 of the super-block (one 16-lane vector); store them, their
        chunk pairs and their sum, which is returned."""
        b = em.b
        v16f, v16i = vec(F32, 16), vec(I32, 16)
        start = em.add(base, em.mul(t, 16))
        xv = ir.Constant(v16f, None)
        for u in range(16):
            xv = b.insert_element(xv, x_at(em.add(start, u)), ir.Constant(I32, u))
        v = em.intrinsic("llvm.roundeven.v16f32", v16f, [b.fmul(em.splat(iscale, 16), xv)])
        v = b.select(b.fcmp_unordered("uno", v, v), ir.Constant(v16f, [0.0] * 16), v)   # nearest_int(NaN) is 0
        q = b.fptosi(em.fmin(em.fmax(v, ir.Constant(v16f, [-128.0] * 16)), ir.Constant(v16f, [127.0] * 16)), v16i)
        em.store(b.trunc(q, vec(I8, 16)), dst, start)
        pairs = b.add(em.shuffle(q, None, range(0, 16, 2)), em.shuffle(q, None, range(1, 16, 2)))   # [8]
        four = b.shl(pairs, ir.Constant(vec(I32, 8), [2] * 8))
        packed = b.or_(b.and_(em.shuffle(four, None, range(0, 8, 2)), ir.Constant(vec(I32, 4), [0xFFFF] * 4)),
                       b.shl(em.shuffle(four, None, range(1, 8, 2)), ir.Constant(vec(I32, 4), [16] * 4)))
        em.store(packed, dst, at("chunk4", em.mul(t, 4)))
        total = em.intrinsic("llvm.vector.reduce.add.v16i32", I32, [q])
        em.store(total, dst, at("bsums", t))
        return total
