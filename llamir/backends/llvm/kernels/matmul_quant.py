"""Quantized matmul over repacked weights (repack.py) and quantized activations (quant_act.py).

Each thread takes groups of 16 weight rows; for each group it runs over the tokens in tiles of
RN (all tokens stay in L2 in n-blocks), and for each block of K it unpacks the 16 rows' values
once, then for each token of the tile does C int8 dot products (vpdpbusd: unsigned weights x
signed activations, 4 values per lane, lanes = rows) and the float accumulation of the format's
order. Weights are read once per n-block; token generation is one streaming pass.
"""

from __future__ import annotations

import llvmlite.ir as ir

from llamir.backends.llvm.emit import F16, F32, I8, I32, Emitter, vec
from llamir.backends.llvm.kernels.quant_act import act_layout
from llamir.backends.llvm.kernels.repack import G, QFormat
from llamir.backends.llvm.plan import Kernel

L2_BUDGET = 1 << 20


def dpbusd(em: Emitter, acc, w_u8, x_s8):
    """acc[l] + sum_{t<4} w[4l+t] * x[4l+t] (unsigned w, signed x), 16 int32 lanes."""
    if em.target.vnni512:
        return em.intrinsic("llvm.x86.avx512.vpdpbusd.512", acc.type, [acc, w_u8, x_s8])
    b = em.b
    wide = vec(I32, 64)
    prod = b.mul(b.zext(w_u8, wide), b.sext(x_s8, wide))
    total = acc
    for t in range(4):
        total = b.add(total, em.shuffle(prod, None, range(t, 64, 4)))
    return total


class MatMulQ(Kernel):
    """y [N, M] f32 = act [N, K] (quantized rows) x packed weight [M, K]."""

    def __init__(self, fmt: QFormat, K: int, n_rows, m_rows: int):
        self.fmt = fmt
        self.K = K
        self.rn = 2 if fmt.order == "lanes8" else 6
        self.n_ptrs = 3
        super().__init__([n_rows, m_rows])

    def config(self) -> tuple:
        return (self.fmt, self.K, self.rn)

    def emit(self, em: Emitter, a) -> None:
        N, M = a.ints
        y_ptr, w_ptr, x_ptr = a.ptrs
        nb, _, _, _, row_bytes = act_layout(self.fmt, self.K)
        groups = em.cdiv(M, G)
        g0, g1 = em.split(groups, a.ith, a.nth)
        n_block = max(self.rn, (L2_BUDGET // row_bytes) // self.rn * self.rn)
        with em.loop(0, N, n_block, name="nb") as n0, em.loop(g0, g1, name="grp") as g:
            n1 = em.min(em.add(n0, n_block), N)
            wg = em.gep(w_ptr, em.mul(g, nb * self.fmt.block_bytes))
            valid = em.min(em.sub(M, em.mul(g, G)), G)
            em.tiles(n0, n1, self.rn, lambda nt, rn: self._tile(em, wg, x_ptr, y_ptr, g, nt, rn, M, valid, nb,
                                                                 row_bytes), name="nt")

    # -- one tile: 16 rows x rn tokens -------------------------------------------------------------
    def _tile(self, em: Emitter, wg, x_ptr, y_ptr, g, nt, rn: int, M, valid, nb: int, row_bytes: int) -> None:
        b = em.b
        fmt = self.fmt
        _, off_d, off_aux, off_corr, _ = act_layout(fmt, self.K)
        vf = vec(F32, G)
        zero = ir.Constant(vf, [0.0] * G)
        lanes8 = fmt.order == "lanes8"
        accs = [[em.var(vf, zero) for _ in range(fmt.chunks if lanes8 else 1)] for _ in range(rn)]
        mins = [em.var(vf, zero) for _ in range(rn)] if fmt.min else []
        rows = [em.gep(x_ptr, em.mul(em.add(nt, j), row_bytes)) for j in range(rn)]
        izero = ir.Constant(vec(I32, G), [0] * G)
        with em.loop(0, nb, name="blk") as k:
            wb = em.gep(wg, em.mul(k, fmt.block_bytes))
            chunks = self._unpack(em, wb)
            ws = self._scales(em, wb, fmt.quant_bytes, fmt.scale)
            wm = self._scales(em, wb, fmt.quant_bytes + fmt.scale_bytes, fmt.min) if fmt.min else None
            for j in range(rn):
                xr = rows[j]
                dx = em.splat(em.load(F32, xr, em.add(off_d, em.mul(k, 4))), G)
                scale = b.fmul(dx, ws)
                xq = em.gep(xr, em.mul(k, fmt.bs))
                if lanes8:
                    for c in range(fmt.chunks):
                        init = self._corr(em, xr, off_corr, em.add(em.mul(k, fmt.chunks), c)) \
                            if fmt.corr == "chunk" else izero
                        p = dpbusd(em, init, chunks[c], self._xb(em, xq, 4 * c))
                        em.set(accs[j][c], em.fma(scale, b.sitofp(p, vf), em.get(accs[j][c])))
                else:
                    isum = self._corr(em, xr, off_corr, k) if fmt.corr == "block" else izero
                    for c in range(fmt.chunks):
                        isum = dpbusd(em, isum, chunks[c], self._xb(em, xq, 4 * c))
                    em.set(accs[j][0], em.fma(b.sitofp(isum, vf), scale, em.get(accs[j][0])))
                if wm is not None:
                    aux = em.splat(em.load(F32, xr, em.add(off_aux, em.mul(k, 4))), G)
                    em.set(mins[j], em.fma(wm, aux, em.get(mins[j])))
        full_group = em.icmp("==", valid, G)
        mask = em.lane_mask(G, valid)
        for j in range(rn):
            if lanes8:
                a_ = [em.get(x) for x in accs[j]]
                total = b.fadd(b.fadd(b.fadd(a_[0], a_[4]), b.fadd(a_[2], a_[6])),
                               b.fadd(b.fadd(a_[1], a_[5]), b.fadd(a_[3], a_[7])))
            else:
                total = em.get(accs[j][0])
            if mins:
                total = b.fadd(total, em.get(mins[j]))
            off = em.add(em.mul(em.add(nt, j), em.mul(M, 4)), em.mul(g, G * 4))
            with em.if_else(full_group) as (then, otherwise):
                with then:
                    em.store(total, y_ptr, off)
                with otherwise:
                    em.masked_store(total, y_ptr, off, mask)

    def _unpack(self, em: Emitter, wb) -> list:
        b = em.b
        v8 = vec(I8, 64)
        fmt = self.fmt
        if fmt.packing == "byte":
            return [em.load(v8, wb, 64 * c) for c in range(fmt.chunks)]
        half = fmt.chunks // 2
        low = ir.Constant(v8, [0x0F] * 64)
        four = ir.Constant(v8, [4] * 64)
        lo, hi = [], []
        for v in range(half):
            raw = em.load(v8, wb, 64 * v)
            lo.append(b.and_(raw, low))
            hi.append(b.lshr(raw, four))
        return lo + hi

    def _scales(self, em: Emitter, wb, off: int, kind: str):
        if kind == "f16":
            return em.b.fpext(em.load(vec(F16, G), wb, off), vec(F32, G))
        return em.load(vec(F32, G), wb, off)

    def _corr(self, em: Emitter, xr, off_corr: int, index):
        return em.splat(em.load(I32, xr, em.add(off_corr, em.mul(index, 4))), G)

    def _xb(self, em: Emitter, xq, off: int):
        return em.b.bitcast(em.splat(em.load(I32, xq, off), G), vec(I8, 64))


# -- quantized operands that are not packed weights (KV cache views, batched tensors) ------------------
_BLOCK = {"q8_0": (34, 2), "q4_0": (18, 2), "q4_1": (20, 4), "q5_0": (22, 6), "q5_1": (24, 8)}


def _block_values(em: Emitter, dtype: str, blk):
    """The 32 signed integer values of a raw ggml block as <32 x i32>, element order."""
    b = em.b
    v32 = vec(I32, 32)
    if dtype == "q8_0":
        return b.sext(em.load(vec(I8, 32), blk, 2), v32)
    size, qs = _BLOCK[dtype]
    raw = b.zext(em.load(vec(I8, 16), blk, qs), vec(I32, 16))
    lo = b.and_(raw, ir.Constant(vec(I32, 16), [15] * 16))
    hi = b.lshr(raw, ir.Constant(vec(I32, 16), [4] * 16))
    q = em.concat(lo, hi)
    if dtype in ("q5_0", "q5_1"):
        qh = em.load(I32, blk, 2 if dtype == "q5_0" else 4)
        bits = b.and_(b.lshr(em.splat(qh, 32, I32), ir.Constant(v32, list(range(32)))), ir.Constant(v32, [1] * 32))
        q = b.or_(q, b.shl(bits, ir.Constant(v32, [4] * 32)))
    offset = {"q4_0": 8, "q5_0": 16}.get(dtype, 0)
    if offset:
        q = b.sub(q, ir.Constant(v32, [offset] * 32))
    return q


class MatMulQDirect(Kernel):
    """y [B0, B1, N, M] f32 from a quantized a [A0, A1, M, K] in ggml's block layout (any row and
    batch strides) and b's quantized activations [B0, B1, N] rows: one dot product per output in
    vec_dot's lanes8 order (these operands, KV caches and batched tensors, are never repacked)."""

    def __init__(self, fmt: QFormat, K: int, y, a, n_rows_per_batch):
        y, a = y.padded(), a.padded()
        self.fmt = fmt
        self.K = K
        self.dtype = a.dtype.name
        self.n_ptrs = 3
        super().__init__(list(y.shape) + list(y.strides[:3]) + list(a.shape[:2]) + list(a.strides[:3]))

    def config(self) -> tuple:
        return (self.fmt, self.K, self.dtype)

    def emit(self, em: Emitter, a) -> None:
        yshape, ystr = a.ints[0:4], a.ints[4:7]
        ash, astr = a.ints[7:9], a.ints[9:12]
        N, M = yshape[2], yshape[3]
        y_ptr, w_ptr, x_ptr = a.ptrs
        nb, off_d, off_aux, _, row_bytes = act_layout(self.fmt, self.K)
        bsize = _BLOCK[self.dtype][0]
        batches = em.mul(yshape[0], yshape[1])
        units = em.mul(batches, N)
        u0, u1 = em.split(units, a.ith, a.nth)
        with em.loop(u0, u1, name="unit") as u:
            n = em.rem(u, N)
            bi = em.div(u, N)
            i1, i0 = em.rem(bi, yshape[1]), em.div(bi, yshape[1])
            ai0 = em.div(i0, em.div(yshape[0], ash[0]))
            ai1 = em.div(i1, em.div(yshape[1], ash[1]))
            A = em.gep(w_ptr, em.add(em.mul(ai0, astr[0]), em.mul(ai1, astr[1])))
            xrow = em.gep(x_ptr, em.mul(u, row_bytes))
            yrow = em.gep(y_ptr, em.offset((i0, i1, n), ystr[:3]))
            with em.loop(0, M, name="m") as m:
                arow = em.gep(A, em.mul(m, astr[2]))
                em.store(self._dot(em, arow, xrow, nb, bsize, off_d, off_aux, False), yrow, em.mul(m, 4))

    def _dot(self, em: Emitter, arow, xrow, nb: int, bsize: int, off_d: int, off_aux: int, block_order: bool):
        b = em.b
        v8f = vec(F32, 8)
        zero8 = ir.Constant(v8f, [0.0] * 8)
        acc = em.var(v8f, zero8)
        acc1 = em.var(F32, em.f32(0.0))
        summs = em.var(F32, em.f32(0.0))
        has_min = self.dtype in ("q4_1", "q5_1")
        with em.loop(0, nb, name="blk") as k:
            blk = em.gep(arow, em.mul(k, bsize))
            w = _block_values(em, self.dtype, blk)
            x = b.sext(em.load(vec(I8, 32), xrow, em.mul(k, 32)), vec(I32, 32))
            prod = b.mul(w, x)
            lanes = prod
            for t in range(4):
                part = em.shuffle(prod, None, range(t, 32, 4))
                lanes = part if t == 0 else b.add(lanes, part)
            d_w = b.fpext(em.load(F16, blk, 0), F32)
            d_x = em.load(F32, xrow, em.add(off_d, em.mul(k, 4)))
            scale = b.fmul(d_x, d_w)
            if block_order:
                isum = b.sitofp(em.reduce_int_add(lanes), F32)
                em.set(acc1, em.fma(isum, scale, em.get(acc1)))
            else:
                em.set(acc, em.fma(em.splat(scale, 8), b.sitofp(lanes, v8f), em.get(acc)))
            if has_min:
                m_w = b.fpext(em.load(F16, blk, 2), F32)
                s_x = em.load(F32, xrow, em.add(off_aux, em.mul(k, 4)))
                em.set(summs, em.fma(m_w, s_x, em.get(summs)))
        if block_order:
            return em.get(acc1)
        a8 = em.get(acc)
        e = [b.extract_element(a8, ir.Constant(I32, i)) for i in range(8)]
        total = b.fadd(b.fadd(b.fadd(e[0], e[4]), b.fadd(e[2], e[6])), b.fadd(b.fadd(e[1], e[5]), b.fadd(e[3], e[7])))
        return b.fadd(total, em.get(summs)) if has_min else total
