"""K-quant matmuls (Q2_K..Q6_K weights packed by repack_k.py, Q8_K activation rows from
quant_act.QuantActK) in the float order of the ggml kernel that computes them (see
llamir/ir/quants_k_x86.py, the reference they match bit for bit):

- "lanes"  ggml_vec_dot_qN_K_q8_K (fewer than 8 rows, weights ggml does not repack): per
           super-block 8 int32 lanes per row, lane l summing sc*q*q8 over the 4-value chunks
           c with c % 8 == l; vpmaddubsw + vpmaddwd(sc) per chunk; then ggml's fmas and hsum.
- "tiled"  ggml-cpu's tiled matmul (8 rows or more): per super-block one integer sum and one min
           sum per row; res = fma(-dmin, s2, d*s1); y = fma(res, d_x, y).
- "gemv" / "gemm"   the CPU_REPACK kernels (Q4_K always, Q2_K in the avx512 profile, M % 8 == 0):
           acc = fma(isum, d_w*d_x, acc) per super-block (gemv: the N % 4 rows left over) or per
           64 / 128 values (gemm: rows in fours); y = acc - (the same for the mins).

The full sums use vpdpbusd chains per sub-block times the sub-block scale (vpmaddubsw + vpmaddwd
without VNNI). Each thread takes groups of 16 weight rows; tokens go in tiles of RN through L2-
sized blocks, as in matmul_quant.py.
"""

from __future__ import annotations

import llvmlite.ir as ir

from llamir.backends.llvm.emit import F32, I8, I16, I32, Emitter, vec
from llamir.backends.llvm.kernels.matmul_quant import dpbusd
from llamir.backends.llvm.kernels.quant_act import k_act_layout
from llamir.backends.llvm.kernels.repack_k import G, KFormat
from llamir.backends.llvm.plan import Kernel

L2_BUDGET = 1 << 20
RN = 4                                   # tokens per tile in the full-sum modes
TILED_MIN_ROWS = 8                       # ggml_tiled_min_batch
GEMM_SPAN_SUBS = {"q4_k": 2, "q2_k": 8}  # sub-blocks per fma in the repacked gemm: 64 / 128 values


def maddubs(em: Emitter, w, x):
    """vpmaddubsw: <64 x i8> unsigned w times signed x, adjacent products summed -> <32 x i16>
    (the K-quant ranges never saturate)."""
    t, b = em.target, em.b
    if t.avx512:
        return em.intrinsic("llvm.x86.avx512.pmaddubs.w.512", vec(I16, 32), [w, x])
    if t.has("avx2"):
        parts = [em.intrinsic("llvm.x86.avx2.pmadd.ub.sw", vec(I16, 16), [hw, hx])
                 for hw, hx in zip(em.halves(w), em.halves(x), strict=True)]
        return em.concat(*parts)
    p = b.mul(b.zext(w, vec(I16, 64)), b.sext(x, vec(I16, 64)))
    return b.add(em.shuffle(p, None, range(0, 64, 2)), em.shuffle(p, None, range(1, 64, 2)))


def maddwd(em: Emitter, a, s):
    """vpmaddwd: <32 x i16> times <32 x i16>, adjacent products summed -> <16 x i32>."""
    t, b = em.target, em.b
    if t.avx512:
        return em.intrinsic("llvm.x86.avx512.pmaddw.d.512", vec(I32, 16), [a, s])
    if t.has("avx2"):
        parts = [em.intrinsic("llvm.x86.avx2.pmadd.wd", vec(I32, 8), [ha, hs])
                 for ha, hs in zip(em.halves(a), em.halves(s), strict=True)]
        return em.concat(*parts)
    p = b.mul(b.sext(a, vec(I32, 32)), b.sext(s, vec(I32, 32)))
    return b.add(em.shuffle(p, None, range(0, 32, 2)), em.shuffle(p, None, range(1, 32, 2)))


class MatMulQK(Kernel):
    """y [P, N, M] f32 = Q8_K rows [P, N] x a K-quant weight [M, K] in ggml's order for it."""

    def __init__(self, fmt: KFormat, K: int, planes, rows, m_rows: int, repacked: bool):
        self.fmt = fmt
        self.K = K
        self.repacked = repacked          # the weight sits in ggml's CPU_REPACK (repack_x86)
        self.n_ptrs = 3
        super().__init__([planes, rows, m_rows])

    def config(self) -> tuple:
        return (self.fmt, self.K, self.repacked)

    def emit(self, em: Emitter, a) -> None:
        P, N, M = a.ints
        groups = em.cdiv(M, G)
        g0, g1 = em.split(groups, a.ith, a.nth)
        with em.loop(0, P, name="plane") as p:
            first = em.mul(p, N)
            run = _Pass(self, em, a.ptrs, M, g0, g1, first)
            if self.repacked:
                n_gemm = em.b.select(em.icmp(">", N, 3), em.i64(em.sub(N, em.rem(N, 4))), em.i64(0))
                run("gemm", 0, n_gemm)
                run("gemv", n_gemm, N)
            else:
                with em.if_else(em.icmp(">=", N, TILED_MIN_ROWS)) as (then, otherwise):
                    with then:
                        run("tiled", 0, N)
                    with otherwise:
                        run("lanes", 0, N)


class _Pass:
    """One mode over rows [n_start, n_end) of a plane: L2 blocks of tokens, groups, tiles."""

    def __init__(self, kernel: MatMulQK, em: Emitter, ptrs, M, g0, g1, first):
        self.k, self.em, self.M, self.g0, self.g1, self.first = kernel, em, M, g0, g1, first
        self.y_ptr, self.w_ptr, self.x_ptr = ptrs
        self.fmt = kernel.fmt
        self.nb, self.off_d, self.off_bs, self.off_pairs, self.row_bytes = k_act_layout(kernel.K)

    def __call__(self, mode: str, n_start, n_end) -> None:
        em = self.em
        rn = RN if mode in ("gemm", "tiled") else 1
        n_block = max(rn, (L2_BUDGET // self.row_bytes) // rn * rn)
        with em.loop(n_start, n_end, n_block, name=f"{mode}.nb") as n0:
            n1 = em.min(em.add(n0, n_block), n_end)
            with em.loop(self.g0, self.g1, name=f"{mode}.grp") as g:
                wg = em.gep(self.w_ptr, em.mul(g, self.nb * self.fmt.block_bytes))
                valid = em.min(em.sub(self.M, em.mul(g, G)), G)
                if mode == "lanes" or mode == "gemv":   # one row at a time (gemv: at most 3 of them)
                    with em.loop(n0, n1, name=f"{mode}.tok") as nt:
                        if mode == "lanes":
                            self._lanes(wg, g, nt, valid)
                        else:
                            self._full(mode, wg, g, nt, 1, valid)
                elif mode == "gemm":                    # its rows come in whole fours
                    with em.loop(n0, n1, RN, name="gemm.tile") as nt:
                        self._full(mode, wg, g, nt, RN, valid)
                else:
                    em.tiles(n0, n1, rn, lambda nt, w: self._full(mode, wg, g, nt, w, valid), name="tiled.nt")

    # -- shared pieces ---------------------------------------------------------------------------------
    def _row(self, n):
        return self.em.gep(self.x_ptr, self.em.mul(self.em.add(self.first, n), self.row_bytes))

    def _chunks(self, wb, s: int) -> list:
        """The <64 x i8> chunks of sub-block s (16 rows x 4 values each), element order."""
        em, b, fmt = self.em, self.em.b, self.fmt
        v8 = vec(I8, 64)
        per = fmt.chunks_per_sub
        if not fmt.nibbles:
            return [em.load(v8, wb, 64 * c) for c in range(s * per, (s + 1) * per)]
        raw = [em.load(v8, wb, 64 * (4 * s + i)) for i in range(4)]
        low, four = ir.Constant(v8, [0x0F] * 64), ir.Constant(v8, [4] * 64)
        return [b.and_(r, low) for r in raw] + [b.lshr(r, four) for r in raw]

    def _i16s(self, wb, off: int):
        return self.em.load(vec(I16, G), wb, off)

    def _x(self, xq, c: int):
        em = self.em
        return em.b.bitcast(em.splat(em.load(I32, xq, 4 * c), G, I32), vec(I8, 64))

    def _int(self, xr, off):
        return self.em.load(I32, xr, off)

    def _bsum(self, xr, k, s: int):
        """The activation sum over sub-block s of super-block k (int32)."""
        em = self.em
        base = em.add(self.off_bs, em.mul(k, 64))
        if self.fmt.subs == 16:
            return self._int(xr, em.add(base, 4 * s))
        return em.b.add(self._int(xr, em.add(base, 8 * s)), self._int(xr, em.add(base, 8 * s + 4)))

    def _store(self, g, n, total, valid) -> None:
        em = self.em
        off = em.add(em.mul(em.add(self.first, n), em.mul(self.M, 4)), em.mul(g, G * 4))
        with em.if_else(em.icmp("==", valid, G)) as (then, otherwise):
            with then:
                em.store(total, self.y_ptr, off)
            with otherwise:
                em.masked_store(total, self.y_ptr, off, em.lane_mask(G, valid))

    # -- full sums: tiled, gemv, gemm ----------------------------------------------------------------
    def _full(self, mode: str, wg, g, nt, rn: int, valid) -> None:
        em, b, fmt = self.em, self.em.b, self.fmt
        vf, vi = vec(F32, G), vec(I32, G)
        fzero, izero = ir.Constant(vf, [0.0] * G), ir.Constant(vi, [0] * G)
        acc = [em.var(vf, fzero) for _ in range(rn)]
        accm = [em.var(vf, fzero) for _ in range(rn)] if fmt.has_min and mode != "tiled" else []
        rows = [self._row(em.add(nt, j)) for j in range(rn)]
        span = GEMM_SPAN_SUBS[fmt.dtype] if mode == "gemm" else fmt.subs
        with em.loop(0, self.nb, name="sblk") as k:
            wb = em.gep(wg, em.mul(k, fmt.block_bytes))
            dw = em.load(vf, wb, fmt.off_d)
            dmin = em.load(vf, wb, fmt.off_dmin) if fmt.has_min else None
            dx = [em.splat(em.load(F32, r, em.add(self.off_d, em.mul(k, 4))), G) for r in rows]
            isum, msum = [izero] * rn, [izero] * rn
            for s in range(fmt.subs):
                chunks = self._chunks(wb, s)
                sc16 = self._i16s(wb, fmt.off_sc + 32 * s)
                sc32 = b.sext(sc16, vi)
                scd = None if em.target.vnni512 else em.shuffle(sc16, sc16, [i // 2 for i in range(2 * G)])
                mn32 = b.sext(self._i16s(wb, fmt.off_mn + 32 * s), vi) if fmt.has_min else None
                for j, xr in enumerate(rows):
                    xq = em.gep(xr, em.mul(k, 256))
                    xs = [self._x(xq, c) for c in range(s * fmt.chunks_per_sub, (s + 1) * fmt.chunks_per_sub)]
                    part = self._scaled_dot(chunks, xs, sc32, scd, xr, k, s)
                    isum[j] = b.add(isum[j], part)
                    if mn32 is not None:
                        msum[j] = b.add(msum[j], b.mul(mn32, em.splat(self._bsum(xr, k, s), G, I32)))
                if (s + 1) % span == 0:
                    for j in range(rn):
                        self._flush(mode, acc[j], accm[j] if accm else None, isum[j], msum[j], dw, dmin, dx[j])
                    isum, msum = [izero] * rn, [izero] * rn
        for j in range(rn):
            total = em.get(acc[j])
            if accm:
                total = b.fsub(total, em.get(accm[j]))
            self._store(g, em.add(nt, j), total, valid)

    def _scaled_dot(self, chunks, xs, sc32, scd, xr, k, s: int):
        """sc * sum(q * q8) over one sub-block, per row, exact int32 (offset undone)."""
        em, b, fmt = self.em, self.em.b, self.fmt
        vi = vec(I32, G)
        if em.target.vnni512:
            d = ir.Constant(vi, [0] * G)
            for w, x in zip(chunks, xs, strict=True):
                d = dpbusd(em, d, w, x)
            if fmt.offset:
                d = b.sub(d, em.splat(b.mul(self._bsum(xr, k, s), ir.Constant(I32, fmt.offset)), G, I32))
            return b.mul(d, sc32)
        part = None
        for w, x in zip(chunks, xs, strict=True):
            p = maddwd(em, maddubs(em, w, x), scd)
            part = p if part is None else b.add(part, p)
        if fmt.offset:
            corr = b.mul(self._bsum(xr, k, s), ir.Constant(I32, fmt.offset))
            part = b.sub(part, b.mul(sc32, em.splat(corr, G, I32)))
        return part

    def _flush(self, mode: str, acc, accm, isum, msum, dw, dmin, dx) -> None:
        em, b = self.em, self.em.b
        vf = vec(F32, G)
        s1 = b.sitofp(isum, vf)
        if mode == "tiled":   # res = d*s1 - dmin*s2 (fnmadd); y = fma(res, d_x, y)
            res = b.fmul(s1, dw)
            if dmin is not None:
                res = em.fma(b.fneg(dmin), b.sitofp(msum, vf), res)
            em.set(acc, em.fma(res, dx, em.get(acc)))
            return
        em.set(acc, em.fma(s1, b.fmul(dw, dx), em.get(acc)))
        if accm is not None:
            em.set(accm, em.fma(b.sitofp(msum, vf), b.fmul(dmin, dx), em.get(accm)))

    # -- ggml_vec_dot_qN_K_q8_K ---------------------------------------------------------------------
    def _lanes(self, wg, g, nt, valid) -> None:
        em, b, fmt = self.em, self.em.b, self.fmt
        vf, vi = vec(F32, G), vec(I32, G)
        fzero, izero = ir.Constant(vf, [0.0] * G), ir.Constant(vi, [0] * G)
        dtype = fmt.dtype
        acc = [em.var(vf, fzero) for _ in range(8)]
        accm = [em.var(vf, fzero) for _ in range({"q4_k": 4, "q5_k": 1}.get(dtype, 0))]
        xr = self._row(nt)
        with em.loop(0, self.nb, name="sblk") as k:
            wb = em.gep(wg, em.mul(k, fmt.block_bytes))
            xq = em.gep(xr, em.mul(k, 256))
            lanes = [izero] * 8
            sc32 = []
            for s in range(fmt.subs):
                sc16 = self._i16s(wb, fmt.off_sc + 32 * s)
                sc32.append(b.sext(sc16, vi))
                scd = em.shuffle(sc16, sc16, [i // 2 for i in range(2 * G)])
                for i, w in enumerate(self._chunks(wb, s)):
                    c = s * fmt.chunks_per_sub + i
                    p = maddubs(em, w, self._x(xq, c))
                    if dtype == "q3_k":   # stored q + 4: take 4 * (x pairs) off each product pair
                        pairs = self._int(xr, em.add(self.off_pairs, em.add(em.mul(k, 256), 4 * c)))
                        p = b.sub(p, b.bitcast(em.splat(pairs, G, I32), vec(I16, 2 * G)))
                    lanes[c % 8] = b.add(lanes[c % 8], maddwd(em, p, scd))
            bs = [self._int(xr, em.add(self.off_bs, em.add(em.mul(k, 64), 4 * t))) for t in range(16)]
            if dtype == "q6_k":   # sumi - 32 * (sc[2l]*bsums[2l] + sc[2l+1]*bsums[2l+1])
                for lane in range(8):
                    corr = b.add(b.mul(sc32[2 * lane], em.splat(bs[2 * lane], G, I32)),
                                 b.mul(sc32[2 * lane + 1], em.splat(bs[2 * lane + 1], G, I32)))
                    lanes[lane] = b.sub(lanes[lane], b.shl(corr, ir.Constant(vi, [5] * G)))
            dx = em.load(F32, xr, em.add(self.off_d, em.mul(k, 4)))
            d = b.fmul(em.splat(dx, G), em.load(vf, wb, fmt.off_d))
            dmin = b.fmul(em.splat(b.fneg(dx), G), em.load(vf, wb, fmt.off_dmin)) if fmt.has_min else None
            mins = self._lane_mins(wb, bs) if fmt.has_min else []
            if dtype == "q2_k":
                for lane in range(8):
                    em.set(acc[lane], em.fma(dmin, b.sitofp(mins[lane], vf), em.get(acc[lane])))
            for lane in range(8):
                em.set(acc[lane], em.fma(d, b.sitofp(lanes[lane], vf), em.get(acc[lane])))
            for slot, m in zip(accm, mins, strict=False):
                em.set(slot, em.fma(dmin, b.sitofp(m, vf), em.get(slot)))
        a_ = [em.get(x) for x in acc]
        r = [b.fadd(a_[i + 4], a_[i]) for i in range(4)]          # hsum_float_8
        total = b.fadd(b.fadd(r[0], r[2]), b.fadd(r[1], r[3]))
        if dtype == "q4_k":
            m_ = [em.get(x) for x in accm]
            total = b.fadd(total, b.fadd(b.fadd(m_[0], m_[2]), b.fadd(m_[1], m_[3])))
        elif dtype == "q5_k":
            total = b.fadd(total, em.get(accm[0]))
        self._store(g, nt, total, valid)

    def _lane_mins(self, wb, bs) -> list:
        """The integer min terms vec_dot forms: Q2_K 8 lanes of m*bsums pairs, Q4_K 4 lanes of
        m*(32-value sums) pairs, Q5_K their one total."""
        em, b, fmt = self.em, self.em.b, self.fmt
        vi = vec(I32, G)
        mn = [b.sext(self._i16s(wb, fmt.off_mn + 32 * s), vi) for s in range(fmt.subs)]
        sums = bs if fmt.subs == 16 else [b.add(bs[2 * j], bs[2 * j + 1]) for j in range(8)]
        prods = [b.mul(m, em.splat(x, G, I32)) for m, x in zip(mn, sums, strict=True)]
        pairs = [b.add(prods[2 * i], prods[2 * i + 1]) for i in range(len(prods) // 2)]
        if fmt.dtype == "q5_k":
            total = pairs[0]
            for p in pairs[1:]:
                total = b.add(total, p)
            return [total]
        return pairs
