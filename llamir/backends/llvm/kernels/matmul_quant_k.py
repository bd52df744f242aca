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

The weight's values come as bit planes (repack_k.py), unpacked in registers to a byte each
(load_chunks); the prompt modes (tiled, gemm) unpack each 16-row group once into a per-thread
scratch and read that from every token tile (Q4_K's nibbles excepted). The full sums use vpdpbusd
chains per sub-block times the sub-block scale (vpmaddubsw + vpmaddwd without VNNI). Each thread
takes groups of 16 weight rows; tokens go in tiles of RN through L2-sized blocks, as in
matmul_quant.py. Targets without AVX-512 run the same modes on 8-row halves of each group in
256-bit registers (matmul_quant_k8.py).
"""

from __future__ import annotations

import llvmlite.ir as ir

from llamir.backends.llvm.emit import F32, I8, I16, I32, Claims, Emitter, vec
from llamir.backends.llvm.kernels.matmul_quant_k8 import Pass8, lane_fmas, lane_total, load_chunks, load_d, unpack_group
from llamir.backends.llvm.kernels.quant_act import KActLayout
from llamir.backends.llvm.kernels.repack_k import G, KFormat
from llamir.backends.llvm.plan import Kernel

L2_BUDGET = 1 << 20
RN = 6                                   # tokens per tile in the full-sum modes
TILED_MIN_ROWS = 8                       # ggml_tiled_min_batch
GEMM_SPAN_SUBS = {"q4_k": 2, "q2_k": 8}  # sub-blocks per fma in the repacked gemm: 64 / 128 values
# largest |sc * sum(q * q8)| of one sub-block: scale * value * 127 * values per sub-block
_MAX_SCALED_DOT = {"q4_k": 63 * 15 * 127 * 32, "q2_k": 15 * 3 * 127 * 16}


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

    runtime_ints = (2,)     # M is only a loop bound: weights of any height share one function
    shares_work = True      # the groups of each block of tokens, mode and plane (Claims.ranges)

    def __init__(self, fmt: KFormat, K: int, planes, rows, m_rows: int, repacked: bool):
        self.fmt = fmt
        self.K = K
        self.repacked = repacked          # the weight sits in ggml's CPU_REPACK (repack_x86)
        # per-thread bytes for a group's values unpacked once for the prompt modes (unpack_group)
        self.scratch_bytes = 0 if fmt.dtype == "q4_k" else G * K
        self.n_ptrs = 4 if self.scratch_bytes else 3
        super().__init__([planes, rows, m_rows])

    def config(self) -> tuple:
        return (self.fmt, self.K, self.repacked)

    def emit(self, em: Emitter, a) -> None:
        P, N, M = a.ints
        claims = em.claims(a)
        with em.loop(0, P, name="plane") as p:
            first = em.mul(p, N)
            run = _Pass(self, em, a.ptrs, M, claims, first)
            if not em.target.avx512:           # 256-bit vectors: 8-row halves (matmul_quant_k8.py)
                run = Pass8(run, L2_BUDGET, GEMM_SPAN_SUBS)
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
    """One mode over rows [n_start, n_end) of a plane: L2 blocks of tokens, groups, tiles. Inside a
    super-block the kernels loop over sub-blocks (or 32-value blocks) at run time, so a loop body
    holds one sub-block's chunks and stays in registers."""

    def __init__(self, kernel: MatMulQK, em: Emitter, ptrs, M, claims: Claims, first):
        self.k, self.em, self.M, self.claims, self.first = kernel, em, M, claims, first
        self.groups = em.cdiv(M, G)
        self.y_ptr, self.w_ptr, self.x_ptr = ptrs[:3]
        self.scratch = ptrs[3] if kernel.scratch_bytes else None     # unpack_group's copy
        self.fmt = kernel.fmt
        self.lay = KActLayout(kernel.K)
        self.nb, self.row_bytes = self.lay.nb, self.lay.row_bytes

    def __call__(self, mode: str, n_start, n_end) -> None:
        em = self.em
        rn = RN if mode in ("gemm", "tiled") else 1
        n_block = max(rn, (L2_BUDGET // self.row_bytes) // rn * rn)
        blocks = em.cdiv(em.sub(n_end, n_start), n_block)
        with self.claims.ranges(self.groups, 1, blocks, name=f"{mode}.chunk") as (nbi, g0, g1):
            n0 = em.add(n_start, em.mul(nbi, n_block))
            n1 = em.min(em.add(n0, n_block), n_end)
            with em.loop(g0, g1, name=f"{mode}.grp") as g:
                wg = em.gep(self.w_ptr, em.mul(g, self.nb * self.fmt.block_bytes))
                valid = em.min(em.sub(self.M, em.mul(g, G)), G)
                if mode == "lanes" or mode == "gemv":   # one row at a time (gemv: at most 3 of them)
                    with em.loop(n0, n1, name=f"{mode}.tok") as nt:
                        if mode == "lanes":
                            self._lanes(wg, g, nt, valid)
                        else:
                            self._full(mode, wg, g, nt, 1, valid)
                else:
                    if self.scratch is not None:
                        unpack_group(em, self.fmt, wg, self.nb, self.scratch, vec(I8, 64))
                    em.tiles(n0, n1, rn, lambda nt, w: self._full(mode, wg, g, nt, w, valid), name=f"{mode}.nt")

    # -- shared pieces ---------------------------------------------------------------------------------
    def _row(self, n):
        return self.em.gep(self.x_ptr, self.em.mul(self.em.add(self.first, n), self.row_bytes))

    def _scales(self, wb, s):
        """Sub-block s's scales as int16 [16]."""
        em = self.em
        return em.b.sext(em.load(vec(I8, G), wb, em.add(self.fmt.off_sc, em.mul(s, 16))), vec(I16, G))

    def _x(self, xq, c):
        em = self.em
        return em.b.bitcast(em.splat(em.load(I32, xq, em.mul(c, 4)), G, I32), vec(I8, 64))

    def _int(self, xr, field: str, k, index):
        """int32 entry `index` of super-block k in activation field `field` (KActLayout)."""
        em = self.em
        per = {"chunk4": 64, "pairs16": 8, "pairs32": 4}.get(field, 16)
        return em.load(I32, xr, em.add(getattr(self.lay, field), em.mul(em.add(em.mul(k, per), index), 4)))

    def _d(self, xr, k):
        return self.em.load(F32, xr, self.em.add(self.lay.d, self.em.mul(k, 4)))

    def _min_pairs(self, wb, xr, k, first, count: int) -> ir.Value:
        """sum over mins pairs l = first .. first+count-1 of m[2l]*x[2l] + m[2l+1]*x[2l+1] (vpmaddwd),
        int32 per row; x are the activation's 16-sums (Q2_K) or 32-sums (Q4_K, Q5_K)."""
        em, b = self.em, self.em.b
        field = "pairs16" if self.fmt.subs == 16 else "pairs32"
        total = None
        for i in range(count):
            pair = em.add(first, i)
            mp = b.sext(em.load(vec(I8, 2 * G), wb, em.add(self.fmt.off_mn, em.mul(pair, 32))), vec(I16, 2 * G))
            xp = b.bitcast(em.splat(self._int(xr, field, k, pair), G, I32), vec(I16, 2 * G))
            p = maddwd(em, mp, xp)
            total = p if total is None else b.add(total, p)
        return total

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
        # where every partial sum of sc * dot stays below 2^24 (the gemm's short spans), it is summed in
        # float32, exactly, with vcvtdq2ps + vfmadd (ports 0 and 5) instead of vpmulld (port 0 twice)
        in_float = em.target.vnni512 and mode == "gemm" and span * _MAX_SCALED_DOT[fmt.dtype] < 1 << 24
        isum = [em.var(vf if in_float else vi) for _ in range(rn)]
        per = fmt.chunks_per_sub
        with em.loop(0, self.nb, name="sblk") as k:
            wb = em.gep(wg, em.mul(k, fmt.block_bytes))
            unpacked = self.scratch is not None and mode != "gemv"     # unpack_group's copy of the values
            if not unpacked:
                em.prefetch_ahead(wb, fmt.block_bytes)
            qb = em.gep(self.scratch, em.mul(k, 64 * 64)) if unpacked else wb
            dw = load_d(em, wb, fmt.off_d, G)
            dmin = load_d(em, wb, fmt.off_dmin, G) if fmt.has_min else None
            dx = [em.splat(self._d(r, k), G) for r in rows]
            if mode == "tiled":
                scales = [(dw, None if dmin is None else b.fneg(dmin), x) for x in dx]
            else:            # d_w * d_x once per super-block: ggml's col_scale * row_scale
                scales = [(b.fmul(dw, x), None if dmin is None else b.fmul(dmin, x), None) for x in dx]
            with em.loop(0, fmt.subs // span, name="span") as sp:
                for slot in isum:
                    em.set(slot, fzero if in_float else izero)
                with em.loop(em.mul(sp, span), em.mul(em.add(sp, 1), span), name="sub") as s:
                    chunks = load_chunks(em, fmt, qb, em.mul(s, per), per, vec(I8, 64), unpacked)
                    sc16 = self._scales(wb, s)
                    sc32 = b.sext(sc16, vi)
                    scd = None if em.target.vnni512 else em.shuffle(sc16, None, [i // 2 for i in range(2 * G)])
                    scf = b.sitofp(sc32, vf) if in_float else None
                    for j, xr in enumerate(rows):
                        if in_float:
                            dot = b.sitofp(self._dot_chain(chunks, xr, k, s), vf)
                            em.set(isum[j], em.fma(dot, scf, em.get(isum[j])))
                        else:
                            em.set(isum[j], b.add(em.get(isum[j]), self._scaled_dot(chunks, sc32, scd, xr, k, s)))
                for j, xr in enumerate(rows):
                    msum = self._min_pairs(wb, xr, k, em.mul(sp, span // 2), span // 2) if fmt.has_min else None
                    total = em.get(isum[j])
                    self._flush(mode, acc[j], accm[j] if accm else None, total if in_float else b.sitofp(total, vf),
                                msum, scales[j])
        for j in range(rn):
            total = em.get(acc[j])
            if accm:
                total = b.fsub(total, em.get(accm[j]))
            self._store(g, em.add(nt, j), total, valid)

    def _scaled_dot(self, chunks, sc32, scd, xr, k, s):
        """sc * sum(q * q8) over sub-block s, per row, exact int32: a vpdpbusd chain times sc, or
        vpmaddubsw + vpmaddwd(sc) without VNNI, the stored offset undone through the bsums."""
        em, b, fmt = self.em, self.em.b, self.fmt
        if em.target.vnni512:
            return b.mul(self._dot_chain(chunks, xr, k, s), sc32)
        xq = em.gep(xr, em.mul(k, 256))
        c0 = em.mul(s, fmt.chunks_per_sub)
        part = None
        if fmt.offset:
            neg = b.mul(self._int(xr, "bsums", k, s), ir.Constant(I32, -fmt.offset))
            part = b.mul(sc32, em.splat(neg, G, I32))
        for i, w in enumerate(chunks):
            p = maddwd(em, maddubs(em, w, self._x(xq, em.add(c0, i))), scd)
            part = p if part is None else b.add(part, p)
        return part

    def _dot_chain(self, chunks, xr, k, s):
        """sum(q * q8) over sub-block s per row (one vpdpbusd chain), offset undone, exact int32."""
        em, b, fmt = self.em, self.em.b, self.fmt
        xq = em.gep(xr, em.mul(k, 256))
        c0 = em.mul(s, fmt.chunks_per_sub)
        d = ir.Constant(vec(I32, G), [0] * G)
        if fmt.offset:
            d = em.splat(b.mul(self._int(xr, "bsums", k, s), ir.Constant(I32, -fmt.offset)), G, I32)
        for i, w in enumerate(chunks):
            d = em.intrinsic("llvm.x86.avx512.vpdpbusd.512", d.type, [d, w, self._x(xq, em.add(c0, i))])
        return d

    def _flush(self, mode: str, acc, accm, s1, msum, scales) -> None:
        """One span's float update from its integer sum s1 (as float32) and min sum msum."""
        em, b = self.em, self.em.b
        vf = vec(F32, G)
        if mode == "tiled":   # res = d*s1 - dmin*s2 (fnmadd); y = fma(res, d_x, y)
            dw, neg_dmin, dx = scales
            res = b.fmul(s1, dw)
            if msum is not None:
                res = em.fma(neg_dmin, b.sitofp(msum, vf), res)
            em.set(acc, em.fma(res, dx, em.get(acc)))
            return
        dwx, dminx, _ = scales
        em.set(acc, em.fma(s1, dwx, em.get(acc)))
        if accm is not None:
            em.set(accm, em.fma(b.sitofp(msum, vf), dminx, em.get(accm)))

    # -- ggml_vec_dot_qN_K_q8_K ---------------------------------------------------------------------
    def _lanes(self, wg, g, nt, valid) -> None:
        em, b, fmt = self.em, self.em.b, self.fmt
        vf = vec(F32, G)
        fzero = ir.Constant(vf, [0.0] * G)
        dtype = fmt.dtype
        acc = [em.var(vf, fzero) for _ in range(8)]
        accm = [em.var(vf, fzero) for _ in range({"q4_k": 4, "q5_k": 1}.get(dtype, 0))]
        lane_vars = [em.var(vec(I32, G)) for _ in range(8)]
        xr = self._row(nt)
        with em.loop(0, self.nb, name="sblk") as k:
            wb = em.gep(wg, em.mul(k, fmt.block_bytes))
            em.prefetch_ahead(wb, fmt.block_bytes)
            lanes = self._lane_sums(wb, xr, k, lane_vars)
            dx = self._d(xr, k)
            d = b.fmul(em.splat(dx, G), load_d(em, wb, fmt.off_d, G))              # y.d * x.d
            dmin = b.fmul(em.splat(b.fneg(dx), G), load_d(em, wb, fmt.off_dmin, G)) if fmt.has_min else None
            lane_fmas(em, dtype, acc, accm, lanes, d, dmin,
                      lambda first, count, wb=wb, k=k: self._min_pairs(wb, xr, k, first, count))
        total = lane_total(em, dtype, acc, accm)
        self._store(g, nt, total, valid)

    def _lane_sums(self, wb, xr, k, lane_vars) -> list:
        """vec_dot's 8 int32 lanes of one super-block: lane l = sum of sc*q*q8 over the chunks c with
        c % 8 == l (Q3_K's offset taken off each product pair, Q6_K's 32*sc*bsums per lane), one
        32-value block (8 chunks, one per lane) per loop step."""
        em, b, fmt = self.em, self.em.b, self.fmt
        vi = vec(I32, G)
        xq = em.gep(xr, em.mul(k, 256))
        for slot in lane_vars:
            em.set(slot, ir.Constant(vi, [0] * G))
        subs_per_block = 8 // fmt.chunks_per_sub          # 1 (32-value sub-blocks) or 2
        with em.loop(0, 8, name="blk32") as jj:
            # besides the next super-block into L2 (_lanes): an eighth of the bytes a step into L1
            em.prefetch_ahead(wb, fmt.block_bytes // 8, em.mul(jj, fmt.block_bytes // 8))
            chunks = load_chunks(em, fmt, wb, em.mul(jj, 8), 8, vec(I8, 64))
            scd = []
            for h in range(subs_per_block):
                sc16 = self._scales(wb, em.add(em.mul(jj, subs_per_block), h))
                scd.append(em.shuffle(sc16, None, [i // 2 for i in range(2 * G)]))
            for i, w in enumerate(chunks):
                c = em.add(em.mul(jj, 8), i)
                p = maddubs(em, w, self._x(xq, c))
                if fmt.dtype == "q3_k":   # stored q + 4: take 4 * (the x pairs) off each product pair
                    four = b.bitcast(em.splat(self._int(xr, "chunk4", k, c), G, I32), vec(I16, 2 * G))
                    p = b.sub(p, four)
                em.set(lane_vars[i], b.add(em.get(lane_vars[i]), maddwd(em, p, scd[i // fmt.chunks_per_sub])))
        lanes = [em.get(slot) for slot in lane_vars]
        if fmt.dtype == "q6_k":   # sumi - 32 * (sc[2l]*bsums[2l] + sc[2l+1]*bsums[2l+1]), one vpmaddwd
            interleave = [i // 2 + (i % 2) * G for i in range(2 * G)]
            five = ir.Constant(vi, [5] * G)
            for lane in range(8):
                pair = em.shuffle(self._scales(wb, 2 * lane), self._scales(wb, 2 * lane + 1), interleave)
                bs = b.bitcast(em.splat(self._int(xr, "pairs16", k, lane), G, I32), vec(I16, 2 * G))
                lanes[lane] = b.sub(lanes[lane], b.shl(maddwd(em, pair, bs), five))
        return lanes
