"""The K-quant matmul modes of matmul_quant_k.py on 256-bit vectors (targets without AVX-512).

Each 16-row group of the packed weight (repack_k.py) is taken as two halves of 8 rows: a half's
4-value chunks, scales, mins and d are contiguous 32 (16) byte halves of the group's, so one ymm
holds 8 rows of a chunk and nothing is split across registers. Same modes, same float order, same
integers as the 512-bit code:

- full sums (tiled, gemv, gemm): tiles of 8 rows x RN8 tokens. Per sub-block and token the chunk
  products are summed in int16 by vpmaddubsw + vpaddw (never past 32767: at most 8 chunks of 4-bit
  values, 4 of 5-bit, 2 of 6-bit, against |q8| <= 127), then one vpmaddwd by the duplicated sub-block
  scales. With AVX-VNNI, one vpdpbusd chain per sub-block times the scale (vpmulld) instead. The
  stored offset of Q3_K/Q6_K comes off once per super-block (sc x bsum pairs, one vpmaddwd each);
  the gemm/gemv mins go to their own accumulator in a second loop (the two sums are independent).
- lanes (vec_dot): 8 int32 lane vectors per half and token, lane l summing its chunks c % 8 == l;
  every type but Q4_K runs lanes 0-3 and 4-7 in two passes, so that unpacking its bit planes fits 16 ymm.
"""

from __future__ import annotations

import llvmlite.ir as ir

from llamir.backends.llvm.emit import F16, F32, I8, I16, I32, Emitter, vec

H = 8                                     # rows per half group (one ymm of f32 / i32)
RN8 = 4                                   # tokens per tile in the full-sum modes
V8F, V8I, V16S, V32B = vec(F32, H), vec(I32, H), vec(I16, 2 * H), vec(I8, 4 * H)
# chunks whose vpmaddubsw results may be summed in int16: pairs |2 * q_max * 127| <= 32767 summed
_I16_RUN = {"q2_k": 4, "q3_k": 4, "q4_k": 8, "q5_k": 4, "q6_k": 2}
_DUP = [i // 2 for i in range(2 * H)]


def maddubs8(em: Emitter, w, x):
    """vpmaddubsw ymm: unsigned w bytes times signed x bytes, adjacent pairs summed (int16)."""
    return em.intrinsic("llvm.x86.avx2.pmadd.ub.sw", V16S, [w, x])


def madd8(em: Emitter, a, s):
    """vpmaddwd ymm: int16 pairs times int16 pairs, summed -> int32."""
    return em.intrinsic("llvm.x86.avx2.pmadd.wd", V8I, [a, s])


def madd_add8(em: Emitter, acc, a, s):
    """acc + vpmaddwd(a, s): one vpdpwssd with AVX-VNNI."""
    if em.target.vnni:
        return em.intrinsic("llvm.x86.avx512.vpdpwssd.256", V8I, [acc, a, s])
    return em.b.add(acc, madd8(em, a, s))


def load_d(em: Emitter, base, offset, n: int):
    """n fp16 super-block scales (d or dmin) as float32."""
    return em.b.fpext(em.load(vec(F16, n), base, offset), vec(F32, n))


def dpbusd8(em: Emitter, acc, w, x):
    """AVX-VNNI vpdpbusd ymm: acc + 4-value dots of unsigned w and signed x bytes."""
    return em.intrinsic("llvm.x86.avx512.vpdpbusd.256", V8I, [acc, w, x])


def load_chunks(em: Emitter, fmt, base, c0, count: int, vt: ir.VectorType, unpacked: bool = False) -> list:
    """Chunks c0 .. c0+count-1 of the packed super-block at `base` (16 rows in <64 x i8>, or a half's
    8 rows in <32 x i8> from base + 32h) as one byte per stored value, unpacked from fmt's bit planes
    (repack_k.py) by and/shift/or; c0 (run time) is a multiple of count: 8, or 4 with 16 sub-blocks.
    `unpacked`: base is a super-block of unpack_group's copy instead."""
    b = em.b
    if unpacked:
        return [em.load(vt, base, em.add(em.mul(c0, 64), 64 * i)) for i in range(count)]

    def ld(offset):
        return em.load(vt, base, offset)

    def splat(value: int):
        return ir.Constant(vt, [value] * vt.count)

    def field(v, at: int, width: int, to: int):
        """Bits at .. at+width-1 of each byte of v, moved to bit `to`."""
        if at == 0 and width == 8:
            return v
        v = b.and_(v, splat(((1 << width) - 1) << at))
        return v if at == to else b.shl(v, splat(to - at)) if to > at else b.lshr(v, splat(at - to))

    def shr16(v, n: int):
        """v >> n in 16-bit lanes (vpsrlw), for bytes whose low n bits the next byte need not fill."""
        wide = vec(I16, vt.count // 2)
        return b.bitcast(b.lshr(b.bitcast(v, wide), ir.Constant(wide, [n] * wide.count)), vt)

    if fmt.subs == 8:                   # Q4_K, Q5_K: one 32-value block of 4 nibble vectors (+ 1 bit)
        blk = em.mul(em.div(c0, 8), fmt.block32_bytes)
        nib = [ld(em.add(blk, 64 * i)) for i in range(4)]
        low = [field(v, 0, 4, 0) for v in nib] + [field(v, 4, 4, 0) for v in nib]
        if fmt.dtype == "q4_k":
            return low
        high = ld(em.add(blk, 256))
        return [b.or_(lo, field(high, i, 1, 4)) for i, lo in enumerate(low)]
    chunks = []
    for j in range(count // 4):         # 16-value sub-blocks s; with count 8, s % 2 == j
        s = em.add(em.div(c0, 4), j)
        if fmt.dtype == "q6_k":
            sub = em.mul(s, fmt.block32_bytes // 2)
            vs = [ld(em.add(sub, 64 * i)) for i in range(3)]
            last = None   # chunk 3 from the top crumbs of vs[2], vs[1], vs[0], masked before each shift
            for v in reversed(vs):
                top = b.and_(v, splat(0xC0))
                last = top if last is None else b.or_(shr16(last, 2), top)
            chunks += [field(v, 0, 6, 0) for v in vs] + [shr16(last, 2)]
        elif fmt.dtype == "q2_k":
            crumbs = ld(em.mul(s, 64))
            chunks += [field(crumbs, 2 * i, 2, 0) for i in range(4)]
        else:                           # q3_k: the block's bit vector holds both sub-blocks' third bits
            if count != 8:
                raise ValueError("Q3_K chunks are unpacked a 32-value block (8 chunks) at a time")
            blk = em.mul(em.div(s, 2), fmt.block32_bytes)
            crumbs, high = ld(em.add(em.mul(s, 64), em.mul(em.div(s, 2), 64))), ld(em.add(blk, 128))
            chunks += [b.or_(field(crumbs, 2 * i, 2, 0), field(high, 4 * j + i, 1, 2)) for i in range(4)]
    return chunks


def unpack_group(em: Emitter, fmt, wg, nb: int, out, vt: ir.VectorType) -> None:
    """A 16-row group's values (nb packed super-blocks at wg) one byte each into `out`: chunk c of
    super-block k at out + 4096k + 64c. The prompt modes read each chunk once per tile of tokens, so
    they unpack once per group (not for Q4_K, whose nibbles cost one instruction a chunk)."""
    halves = range(0, 64, vt.count)
    with em.loop(0, nb, name="unpack.sblk") as k:
        src, dst = em.gep(wg, em.mul(k, fmt.block_bytes)), em.gep(out, em.mul(k, 64 * 64))
        with em.loop(0, 8, name="unpack.blk") as jj:
            for h in halves:
                for i, chunk in enumerate(load_chunks(em, fmt, em.gep(src, h), em.mul(jj, 8), 8, vt)):
                    em.store(chunk, dst, em.add(em.mul(jj, 8 * 64), 64 * i + h))


def lane_fmas(em: Emitter, dtype: str, acc: list, accm: list, lanes: list, d, dmin, min_pairs) -> None:
    """One super-block of ggml_vec_dot_qN_K_q8_K's float accumulation: acc[l] = fma(d, lane_l, acc[l]),
    the mins where each type puts them; min_pairs(first, count) is their integer sum."""
    b, vf = em.b, d.type
    if dtype == "q2_k":        # the mins' 8 lanes go into acc first
        for lane in range(8):
            em.set(acc[lane], em.fma(dmin, b.sitofp(min_pairs(lane, 1), vf), em.get(acc[lane])))
    for lane in range(8):
        em.set(acc[lane], em.fma(d, b.sitofp(lanes[lane], vf), em.get(acc[lane])))
    if dtype == "q4_k":        # 4 lanes of their own
        for lane in range(4):
            em.set(accm[lane], em.fma(dmin, b.sitofp(min_pairs(lane, 1), vf), em.get(accm[lane])))
    elif dtype == "q5_k":      # summs += dmin * (one integer), fused by GCC
        em.set(accm[0], em.fma(dmin, b.sitofp(min_pairs(0, 4), vf), em.get(accm[0])))


def lane_total(em: Emitter, dtype: str, acc: list, accm: list):
    """vec_dot's result: hsum_float_8 of the lanes, plus Q4_K's / Q5_K's min accumulators."""
    b = em.b
    a_ = [em.get(x) for x in acc]
    r = [b.fadd(a_[i + 4], a_[i]) for i in range(4)]
    total = b.fadd(b.fadd(r[0], r[2]), b.fadd(r[1], r[3]))
    if dtype == "q4_k":
        m_ = [em.get(x) for x in accm]
        total = b.fadd(total, b.fadd(b.fadd(m_[0], m_[2]), b.fadd(m_[1], m_[3])))
    elif dtype == "q5_k":
        total = b.fadd(total, em.get(accm[0]))
    return total


class Pass8:
    """One mode over rows [n_start, n_end) of a plane, in 8-row halves (see the module)."""

    def __init__(self, p, l2_budget: int, gemm_span_subs: dict) -> None:   # p: matmul_quant_k._Pass
        self.p, self.em, self.fmt, self.lay = p, p.em, p.fmt, p.lay
        self.l2_budget, self.gemm_span_subs = l2_budget, gemm_span_subs

    def __call__(self, mode: str, n_start, n_end) -> None:
        """Prompts (tiled, gemm): each half in turn against tiles of RN8 tokens. One token at a time
        (lanes, gemv): both halves inside the super-block loop, so each weight line is read once."""
        p, em = self.p, self.em
        rn = RN8 if mode in ("gemm", "tiled") else 1
        n_block = max(rn, (self.l2_budget // p.row_bytes) // rn * rn)
        blocks = em.cdiv(em.sub(n_end, n_start), n_block)
        with p.claims.ranges(p.groups, 1, blocks, name=f"{mode}.chunk") as (nbi, g0, g1):
            n0 = em.add(n_start, em.mul(nbi, n_block))
            n1 = em.min(em.add(n0, n_block), n_end)
            with em.loop(g0, g1, name=f"{mode}.grp") as g:
                wg = em.gep(p.w_ptr, em.mul(g, p.nb * self.fmt.block_bytes))
                if mode in ("lanes", "gemv"):
                    halves = [_Half(self, wg, g, h) for h in range(2)]
                    with em.loop(n0, n1, name=f"{mode}.tok") as nt:
                        if mode == "lanes":
                            _Rows(self, halves).lanes(nt)
                        else:
                            _Rows(self, halves).full(mode, nt, 1)
                else:
                    self._tiles(mode, wg, g, n0, n1, rn)

    def _tiles(self, mode: str, wg, g, n0, n1, rn: int) -> None:
        em, p = self.em, self.p
        if p.scratch is not None:
            unpack_group(em, self.fmt, wg, p.nb, p.scratch, V32B)
        with em.loop(0, 2, name=f"{mode}.half") as h:
            half = _Half(self, wg, g, h, p.scratch)
            with em.if_(em.icmp(">", half.valid, 0)):
                em.tiles(n0, n1, rn, lambda nt, w: _Rows(self, [half]).full(mode, nt, w), name=f"{mode}.nt")


class _Half:
    """Half h (rows 8h .. 8h+7) of group g: where its parts of a super-block are."""

    def __init__(self, ps: Pass8, wg, g, h, unpacked=None) -> None:
        em = ps.em
        self.em, self.fmt, self.wg = em, ps.fmt, wg
        self.unpacked = unpacked          # the group's values from unpack_group, if unpacked
        self.row0 = em.add(em.mul(g, 16), em.mul(h, H))
        self.valid = em.min(em.sub(ps.p.M, self.row0), H)
        self.h32, self.h16, self.h8 = em.mul(h, 32), em.mul(h, 16), em.mul(h, 8)

    def blocks(self, k):
        """Super-block k's bases for this half: (chunks, scales, mins and d) (see repack_k)."""
        em = self.em
        wb = em.gep(self.wg, em.mul(k, self.fmt.block_bytes))
        qb = wb if self.unpacked is None else em.gep(self.unpacked, em.mul(k, 64 * 64))
        return em.gep(qb, self.h32), em.gep(wb, self.h8), em.gep(wb, self.h16)


class _Rows:
    """Some halves (8 weight rows each) against token rows; the pieces of each mode."""

    def __init__(self, ps: Pass8, halves: list) -> None:
        self.ps, self.em, self.fmt, self.lay, self.p = ps, ps.em, ps.fmt, ps.lay, ps.p
        self.halves = halves
        self.unpacked = halves[0].unpacked is not None

    # -- loads ---------------------------------------------------------------------------------------
    def _stream(self, k):
        """Super-block k of the packed weights these halves stream, or None when they read an
        unpacked copy (nothing to prefetch)."""
        half = self.halves[0]
        return None if half.unpacked is not None else self.em.gep(half.wg, self.em.mul(k, self.fmt.block_bytes))

    def _prefetch(self, stream) -> None:
        """The super-block after `stream`'s into L2, once per super-block, where a super-block is longer
        than the prefetch distance (see Emitter.prefetch_ahead). Into L1, each sub-block (or
        32-value block) prefetches its share of the lines as it goes: a whole super-block's lines
        at once (within AMD Zen's 4 KiB) stalled the stream on the line-fill buffers (Zen 2,
        big-q4_k, the repacked gemv: 6.2-6.7 -> 4.2-4.5 ms a token with the lines spread)."""
        if stream is not None and self.fmt.block_bytes > self.em.target.prefetch_distance:
            self.em.prefetch_ahead(stream, self.fmt.block_bytes)

    def _sc(self, sb, s):
        """Sub-block s's 8 scales (int8) as int16."""
        em = self.em
        return em.b.sext(em.load(vec(I8, H), sb, em.add(self.fmt.off_sc, em.mul(s, 16))), vec(I16, H))

    def _x(self, xq, c):
        em = self.em
        return em.b.bitcast(em.splat(em.load(I32, xq, em.mul(c, 4)), H, I32), V32B)

    def _pair(self, xr, field: str, k, index):
        """The activation's int16 pair `index` of super-block k, in every int32 lane."""
        return self.em.b.bitcast(self.em.splat(self.p._int(xr, field, k, index), H, I32), V16S)

    def _min_pairs(self, mb, xr, k, first, count: int):
        """sum over mins pairs first .. first+count-1 of m . (activation sum pairs), int32 per row."""
        em = self.em
        field = "pairs16" if self.fmt.subs == 16 else "pairs32"
        total = ir.Constant(V8I, [0] * H)
        for i in range(count):
            pair = em.add(first, i)
            mp = em.b.sext(em.load(vec(I8, 2 * H), mb, em.add(self.fmt.off_mn, em.mul(pair, 32))), V16S)
            total = madd_add8(em, total, mp, self._pair(xr, field, k, pair))
        return total

    def _offset_sums(self, sb, xr, k):
        """sum_s sc[s] * bsums[s] over the 16 sub-blocks (what Q3_K/Q6_K's offset adds), int32."""
        em = self.em
        interleave = [i // 2 + (i % 2) * H for i in range(2 * H)]
        total = ir.Constant(V8I, [0] * H)
        for pair in range(8):
            sc = em.shuffle(self._sc(sb, 2 * pair), self._sc(sb, 2 * pair + 1), interleave)
            total = madd_add8(em, total, sc, self._pair(xr, "pairs16", k, pair))
        return total

    def _store(self, half: _Half, n, total) -> None:
        """y[n, the half's rows]; masked for a partial (or empty: valid <= 0) half."""
        em, p = self.em, self.p
        off = em.add(em.mul(em.add(p.first, n), em.mul(p.M, 4)), em.mul(half.row0, 4))
        with em.if_else(em.icmp("==", half.valid, H)) as (then, otherwise):
            with then:
                em.store(total, p.y_ptr, off)
            with otherwise:
                em.masked_store(total, p.y_ptr, off, em.lane_mask(H, half.valid))

    # -- full sums -----------------------------------------------------------------------------------
    def full(self, mode: str, nt, rn: int) -> None:
        em, b, fmt, p = self.em, self.em.b, self.fmt, self.p
        fzero, izero = ir.Constant(V8F, [0.0] * H), ir.Constant(V8I, [0] * H)
        rows = [p._row(em.add(nt, j)) for j in range(rn)]
        acc = [[em.var(V8F, fzero) for _ in rows] for _ in self.halves]
        isum = [[em.var(V8I) for _ in rows] for _ in self.halves]
        span = self.ps.gemm_span_subs[fmt.dtype] if mode == "gemm" else fmt.subs
        share = fmt.block_bytes // fmt.subs     # one sub-block's part of the super-block's lines
        with em.loop(0, p.nb, name="sblk") as k:
            stream = self._stream(k)
            self._prefetch(stream)
            blocks = [half.blocks(k) for half in self.halves]
            with em.loop(0, fmt.subs // span, name="span") as sp:
                for slot in (x for per_half in isum for x in per_half):
                    em.set(slot, izero)
                with em.loop(em.mul(sp, span), em.mul(em.add(sp, 1), span), name="sub") as s:
                    if stream is not None:       # the sub-block's share of the lines, into L1
                        em.prefetch_ahead(stream, share, em.mul(s, share))
                    for (qb, sb, _), sums in zip(blocks, isum, strict=True):
                        self._sub_block(qb, sb, rows, k, s, sums)
                if mode != "tiled":          # acc = fma(isum, d_w * d_x, acc)
                    for (_, _, mb), sums, accs in zip(blocks, isum, acc, strict=True):
                        dw = load_d(em, mb, fmt.off_d, H)
                        for j, xr in enumerate(rows):
                            dwx = b.fmul(dw, em.splat(p._d(xr, k), H))
                            em.set(accs[j], em.fma(b.sitofp(em.get(sums[j]), V8F), dwx, em.get(accs[j])))
            if mode == "tiled":
                for (_, sb, mb), sums, accs in zip(blocks, isum, acc, strict=True):
                    self._tiled_flush(sb, mb, rows, k, sums, accs)
        for half, accs in zip(self.halves, acc, strict=True):
            totals = [em.get(a) for a in accs]
            if fmt.has_min and mode != "tiled":
                totals = [b.fsub(t, m) for t, m in zip(totals, self._repacked_mins(half, rows, span), strict=True)]
            for j, total in enumerate(totals):
                self._store(half, em.add(nt, j), total)

    def _sub_block(self, qb, sb, rows, k, s, isum) -> None:
        """isum[j] += sc * sum(q * q8) over sub-block s (stored values; offsets come off later)."""
        em, b, fmt = self.em, self.em.b, self.fmt
        per = fmt.chunks_per_sub
        chunks = load_chunks(em, fmt, qb, em.mul(s, per), per, V32B, self.unpacked)
        xqs = [em.gep(xr, em.mul(k, 256)) for xr in rows]
        c0 = em.mul(s, per)
        sc = self._sc(sb, s)
        if em.target.vnni:
            sc32 = b.sext(sc, V8I)
            for j, xq in enumerate(xqs):
                d = ir.Constant(V8I, [0] * H)
                for i, w in enumerate(chunks):
                    d = dpbusd8(em, d, w, self._x(xq, em.add(c0, i)))
                em.set(isum[j], b.add(em.get(isum[j]), b.mul(d, sc32)))
            return
        scd = em.shuffle(sc, None, _DUP)
        run = _I16_RUN[fmt.dtype]
        for j, xq in enumerate(xqs):
            total = em.get(isum[j])
            for r0 in range(0, per, run):
                part = None
                for i in range(r0, min(per, r0 + run)):
                    prod = maddubs8(em, chunks[i], self._x(xq, em.add(c0, i)))
                    part = prod if part is None else b.add(part, prod)
                total = madd_add8(em, total, part, scd)
            em.set(isum[j], total)

    def _tiled_flush(self, sb, mb, rows, k, isum, acc) -> None:
        """res = fma(-dmin, s2, d * s1); acc = fma(res, d_x, acc) (s1 with the offset taken off)."""
        em, b, fmt, p = self.em, self.em.b, self.fmt, self.p
        dw = load_d(em, mb, fmt.off_d, H)
        neg_dmin = b.fneg(load_d(em, mb, fmt.off_dmin, H)) if fmt.has_min else None
        for j, xr in enumerate(rows):
            s1 = em.get(isum[j])
            if fmt.offset:
                corr = self._offset_sums(sb, xr, k)
                s1 = b.sub(s1, b.mul(corr, ir.Constant(V8I, [fmt.offset] * H)))
            res = b.fmul(b.sitofp(s1, V8F), dw)
            if neg_dmin is not None:
                msum = self._min_pairs(mb, xr, k, 0, fmt.subs // 2)
                res = em.fma(neg_dmin, b.sitofp(msum, V8F), res)
            em.set(acc[j], em.fma(res, em.splat(p._d(xr, k), H), em.get(acc[j])))

    def _repacked_mins(self, half: _Half, rows, span: int) -> list:
        """The repacked kernels' min accumulators: fma(msum, dmin * d_x, accm) per span, in order."""
        em, b, fmt, p = self.em, self.em.b, self.fmt, self.p
        fzero = ir.Constant(V8F, [0.0] * H)
        accm = [em.var(V8F, fzero) for _ in rows]
        with em.loop(0, p.nb, name="msblk") as k:
            _, _, mb = half.blocks(k)
            dmin = load_d(em, mb, fmt.off_dmin, H)
            with em.loop(0, fmt.subs // span, name="mspan") as sp:
                for j, xr in enumerate(rows):
                    msum = self._min_pairs(mb, xr, k, em.mul(sp, span // 2), span // 2)
                    dmx = b.fmul(dmin, em.splat(p._d(xr, k), H))
                    em.set(accm[j], em.fma(b.sitofp(msum, V8F), dmx, em.get(accm[j])))
        return [em.get(a) for a in accm]

    # -- ggml_vec_dot_qN_K_q8_K ------------------------------------------------------------------------
    def lanes(self, nt) -> None:
        em, fmt, p = self.em, self.fmt, self.p
        fzero = ir.Constant(V8F, [0.0] * H)
        dtype = fmt.dtype
        acc = [[em.var(V8F, fzero) for _ in range(8)] for _ in self.halves]
        accm = [[em.var(V8F, fzero) for _ in range({"q4_k": 4, "q5_k": 1}.get(dtype, 0))] for _ in self.halves]
        lane_vars = [em.var(V8I) for _ in range(8)]
        xr = p._row(nt)
        with em.loop(0, p.nb, name="sblk") as k:
            stream = self._stream(k)
            self._prefetch(stream)
            dx = p._d(xr, k)
            for i, (half, accs, accms) in enumerate(zip(self.halves, acc, accm, strict=True)):
                self._lane_super_block(half.blocks(k), xr, k, dx, lane_vars, accs, accms, stream if i == 0 else None)
        for half, accs, accms in zip(self.halves, acc, accm, strict=True):
            self._store(half, nt, lane_total(em, dtype, accs, accms))

    def _lane_super_block(self, blocks, xr, k, dx, lane_vars, acc, accm, stream=None) -> None:
        """One super-block's lanes into vec_dot's float accumulators, mins as ggml orders them;
        `stream`: the super-block's bytes, to prefetch along (see _lane_sums)."""
        em, b, fmt = self.em, self.em.b, self.fmt
        qb, sb, mb = blocks
        lanes = self._lane_sums(qb, sb, xr, k, lane_vars, stream)
        d = b.fmul(em.splat(dx, H), load_d(em, mb, fmt.off_d, H))                # y.d * x.d
        dmin = b.fmul(em.splat(b.fneg(dx), H), load_d(em, mb, fmt.off_dmin, H)) if fmt.has_min else None
        lane_fmas(em, fmt.dtype, acc, accm, lanes, d, dmin,
                  lambda first, count: self._min_pairs(mb, xr, k, first, count))

    def _lane_sums(self, qb, sb, xr, k, lane_vars, stream=None) -> list:
        """vec_dot's 8 int32 lanes of one super-block (see matmul_quant_k._Pass._lane_sums); with
        `stream` (the super-block's bytes) each step prefetches its share of them."""
        em, b, fmt = self.em, self.em.b, self.fmt
        xq = em.gep(xr, em.mul(k, 256))
        for slot in lane_vars:
            em.set(slot, ir.Constant(V8I, [0] * H))
        subs_per_block = 8 // fmt.chunks_per_sub
        # bit planes need registers to unpack: lanes 0-3, then 4-7, so that 16 ymm hold a pass's lanes
        # (the integers are the same; the second pass reads the super-block from L1). The prefetches
        # are spread over every step of both passes: all in the first left the second computing with
        # nothing in flight (Zen 2, big-q6_k: 6.9 -> 5.3 ms a token)
        passes = ((0, 8),) if fmt.dtype == "q4_k" else ((0, 4), (4, 8))
        share = fmt.block_bytes // (8 * len(passes))
        for n_pass, (first, last) in enumerate(passes):
            with em.loop(0, 8, name="blk32") as jj:
                if stream is not None:
                    em.prefetch_ahead(stream, share, em.mul(em.add(jj, 8 * n_pass), share))
                chunks = load_chunks(em, fmt, qb, em.mul(jj, 8), 8, V32B)
                scd = [em.shuffle(self._sc(sb, em.add(em.mul(jj, subs_per_block), h)), None, _DUP)
                       for h in range(first // fmt.chunks_per_sub, (last - 1) // fmt.chunks_per_sub + 1)]
                for i in range(first, last):
                    c = em.add(em.mul(jj, 8), i)
                    prod = maddubs8(em, chunks[i], self._x(xq, c))
                    if fmt.dtype == "q3_k":
                        prod = b.sub(prod, self._pair(xr, "chunk4", k, c))
                    scale = scd[i // fmt.chunks_per_sub - first // fmt.chunks_per_sub]
                    em.set(lane_vars[i], madd_add8(em, em.get(lane_vars[i]), prod, scale))
        lanes = [em.get(slot) for slot in lane_vars]
        if fmt.dtype == "q6_k":
            interleave = [i // 2 + (i % 2) * H for i in range(2 * H)]
            five = ir.Constant(V8I, [5] * H)
            for lane in range(8):
                pair = em.shuffle(self._sc(sb, 2 * lane), self._sc(sb, 2 * lane + 1), interleave)
                corr = madd8(em, pair, self._pair(xr, "pairs16", k, lane))
                lanes[lane] = b.sub(lanes[lane], b.shl(corr, five))
        return lanes
