"""Quantized matmul over repacked weights (repack.py) and quantized activations (quant_act.py).

Each thread takes groups of 16 weight rows; for each group it runs over the tokens in tiles of
RN (all tokens stay in L2 in n-blocks), and for each block of K it unpacks the 16 rows' values
once, then for each token of the tile does C int8 dot products (vpdpbusd: unsigned weights x
signed activations, 4 values per lane, lanes = rows) and the float accumulation of the format's
order. Weights are read once per n-block; token generation is one streaming pass.

Without AVX512-VNNI the same layout is read as two 8-row halves in 256-bit vectors (int_dot.py:
vpmaddubsw + vpmaddwd, or AVX-VNNI's vpdpbusd), with tiles sized for 16 ymm registers; Q8_0
without any VNNI (signed bytes on both sides) takes int16 products instead (emit_pairs).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import llvmlite.ir as ir

from llamir.backends.llvm.emit import F16, F32, I8, I16, I32, I64, PTR, Emitter, vec
from llamir.backends.llvm.kernels import int_dot
from llamir.backends.llvm.kernels.quant_act import act_layout
from llamir.backends.llvm.kernels.repack import G, QFormat
from llamir.backends.llvm.plan import Kernel

L2_BUDGET = 1 << 20
CHUNK_GROUPS = 1         # groups of 16 weight rows per claimed chunk of the tail


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


def lanes8_total(b: ir.IRBuilder, a: list):
    """The 8 chunk accumulators of vec_dot's lanes8 order summed as ggml's reduction does."""
    return b.fadd(b.fadd(b.fadd(a[0], a[4]), b.fadd(a[2], a[6])), b.fadd(b.fadd(a[1], a[5]), b.fadd(a[3], a[7])))


class MatMulQ(Kernel):
    """y [N, M] f32 = act [N, K] (quantized rows) x packed weight [M, K]."""

    runtime_ints = (1,)     # M is only a loop bound: weights of any height share one function
    shares_work = True      # a share of the groups each, then the rest by CHUNK_GROUPS (Claims.ranges)

    def __init__(self, fmt: QFormat, K: int, n_rows, m_rows: int):
        self.fmt = fmt
        self.K = K
        self.rn = 2 if fmt.order == "lanes8" else 6
        self.n_ptrs = 3
        super().__init__([n_rows, m_rows])

    def config(self) -> tuple:
        return (self.fmt, self.K, self.rn)

    def emit(self, em: Emitter, a) -> None:
        if em.target.vnni512:
            self._sweep(em, a, self.rn, self._tile)
            return
        if self.fmt.packing == "pairs":
            emit_pairs(self.fmt, self.K, em, a)
            return
        tile, rn = functools.partial(tile_256, self.fmt, self.K), tile_tokens_256(self.fmt)
        if self.fmt.order != "lanes8":
            self._sweep(em, a, rn, tile)
            return
        # one token (generation): both halves in one pass, the weights streamed once; prompts take
        # them in turn (see tile_256)
        with em.if_else(em.icmp("==", a.ints[0], 1)) as (then, otherwise):
            with then:
                self._sweep(em, a, rn, functools.partial(tile, one_pass=True))
            with otherwise:
                self._sweep(em, a, rn, tile)

    def _sweep(self, em: Emitter, a, rn: int, tile) -> None:
        """Each thread's groups (16 weight rows) against tiles of rn tokens, in L2-sized blocks."""
        N, M = a.ints
        y_ptr, w_ptr, x_ptr = a.ptrs
        nb, _, _, _, row_bytes = act_layout(self.fmt, self.K)
        groups = em.cdiv(M, G)
        n_block = max(rn, (L2_BUDGET // row_bytes) // rn * rn)
        with em.claims(a).ranges(groups, CHUNK_GROUPS, em.cdiv(N, n_block)) as (nbi, g0, g1), \
                em.loop(g0, g1, name="grp") as g:
            n0 = em.mul(nbi, n_block)
            n1 = em.min(em.add(n0, n_block), N)
            wg = em.gep(w_ptr, em.mul(g, nb * self.fmt.block_bytes))
            valid = em.min(em.sub(M, em.mul(g, G)), G)
            em.tiles(n0, n1, rn, lambda nt, r: tile(em, wg, x_ptr, y_ptr, g, nt, r, M, valid, nb, row_bytes),
                     name="nt")

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
            em.prefetch_ahead(wb, fmt.block_bytes)
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
                total = lanes8_total(b, [em.get(x) for x in accs[j]])
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


# -- the packed kernel on 256-bit vectors (AVX2, AVX-VNNI) ---------------------------------------------
H = 8    # rows per half-group: one 8-lane vector


def tile_tokens_256(fmt: QFormat) -> int:
    """Tokens per tile on 16 ymm registers: "block" keeps one accumulator per (half, token) and the
    half's 8 weight chunks; "lanes8" needs 8 accumulators per token, so one token at a time."""
    return 4 if fmt.order == "block" else 1


def tile_256(fmt: QFormat, K: int, em: Emitter, wg, x_ptr, y_ptr, g, nt, rn: int, M, valid, nb: int,
             row_bytes: int, one_pass: bool = False) -> None:
    """16 rows x rn tokens as two 8-row halves, one pass over K each (`one_pass`: both in one)."""
    rows = [em.gep(x_ptr, em.mul(em.add(nt, j), row_bytes)) for j in range(rn)]
    out = _Out256(em, y_ptr, g, nt, M, valid)
    if fmt.order == "block":
        for halves in ([(0, 1)] if rn <= 2 else [(0,), (1,)]):
            _block_order_256(fmt, K, em, wg, rows, out, nb, halves)
    else:
        # 8 accumulators a (half, token). Both halves in one pass spill 16 accumulators: with AVX-VNNI
        # q8_0 pp128 3-25% slower; the one token of generation reads its weights in one pass instead
        # (Zen 5, emulated Zen 3: smollm2-q4_1 ~5%, q8_0 with AVX-VNNI ~7% faster a token)
        for halves in [(0, 1)] if one_pass else [(0,), (1,)]:
            _lanes8_256(fmt, K, em, wg, rows, out, nb, halves)


class _Out256:
    """Stores one half's 8 outputs of token j, masked where the group runs past M."""

    def __init__(self, em: Emitter, y_ptr, g, nt, M, valid):
        self.em, self.y_ptr, self.g, self.nt, self.M, self.valid = em, y_ptr, g, nt, M, valid

    def store(self, h: int, j: int, total) -> None:
        em = self.em
        off = em.add(em.mul(em.add(self.nt, j), em.mul(self.M, 4)), em.add(em.mul(self.g, G * 4), 4 * H * h))
        left = em.sub(self.valid, H * h)
        with em.if_else(em.icmp(">=", left, H)) as (then, otherwise):
            with then:
                em.store(total, self.y_ptr, off)
            with otherwise:
                em.masked_store(total, self.y_ptr, off, em.lane_mask(H, left))


def _half_chunks(em: Emitter, fmt: QFormat, wb, h: int) -> list:
    """The C chunks (32 bytes: 8 rows x 4 values) of half h of one (group, block)."""
    v8 = int_dot.V32I8
    if fmt.packing == "byte":
        return [em.load(v8, wb, 64 * c + 32 * h) for c in range(fmt.chunks)]
    b = em.b
    lo, hi = [], []
    for v in range(fmt.chunks // 2):
        raw = em.load(v8, wb, 64 * v + 32 * h)
        lo.append(b.and_(raw, ir.Constant(v8, [0x0F] * 32)))
        hi.append(b.lshr(raw, ir.Constant(v8, [4] * 32)))
    return lo + hi


def _half_f16(em: Emitter, wb, off: int, h: int):
    return em.b.fpext(em.load(vec(F16, H), wb, off + 2 * H * h), vec(F32, H))


def _block_order_256(fmt: QFormat, K: int, em: Emitter, wg, rows: list, out: _Out256, nb: int,
                     halves: tuple[int, ...]) -> None:
    """`halves` over K: per block, chunk by chunk (few weight registers), each token's vpmaddubsw
    into its int16 sum (or a vpdpbusd chain from the block's correction), then one float update a
    token. A wide tile takes the halves in separate passes: in one loop LLVM shares their
    activation loads and spills them; a narrow one (token generation) reads its weights once."""
    b = em.b
    _, off_d, _, off_corr, _ = act_layout(fmt, K)
    vf = vec(F32, H)
    accs = {(h, j): em.var(vf, ir.Constant(vf, [0.0] * H)) for h in halves for j in range(len(rows))}
    with em.loop(0, nb, name="blk") as k:
        wb = em.gep(wg, em.mul(k, fmt.block_bytes))
        em.prefetch_ahead(wb, fmt.block_bytes)
        xq = [em.gep(xr, em.mul(k, fmt.bs)) for xr in rows]
        for h in halves:
            corr = [em.splat(em.load(I32, xr, em.add(off_corr, em.mul(k, 4))), H, I32) for xr in rows]
            chunks = _half_chunks(em, fmt, wb, h)
            half = len(chunks) // 2          # chunk v and v + C/2 come from one load of nibbles
            order = [(c, chunks[c]) for v in range(half) for c in (v, v + half)]
            sums = int_dot.dot4_chunks(em, corr, order, lambda j, c: int_dot.bcast4(em, xq[j], 4 * c))
            ws = _half_f16(em, wb, fmt.quant_bytes, h)
            for j, xr in enumerate(rows):
                dx = em.splat(em.load(F32, xr, em.add(off_d, em.mul(k, 4))), H)
                em.set(accs[h, j], em.fma(b.sitofp(sums[j], vf), b.fmul(dx, ws), em.get(accs[h, j])))
    for (h, j), acc in accs.items():
        out.store(h, j, em.get(acc))


def _lanes8_256(fmt: QFormat, K: int, em: Emitter, wg, rows: list, out: _Out256, nb: int,
                halves: tuple[int, ...]) -> None:
    """`halves` over K in vec_dot's lanes8 order: 8 accumulators per (half, token), one per chunk."""
    b = em.b
    _, off_d, off_aux, off_corr, _ = act_layout(fmt, K)
    vf, vi = vec(F32, H), vec(I32, H)
    zero = ir.Constant(vf, [0.0] * H)
    keys = [(h, j) for h in halves for j in range(len(rows))]
    accs = {key: [em.var(vf, zero) for _ in range(fmt.chunks)] for key in keys}
    mins = {key: em.var(vf, zero) for key in keys} if fmt.min else {}
    izero = ir.Constant(vi, [0] * H)
    with em.loop(0, nb, name="blk") as k:
        wb = em.gep(wg, em.mul(k, fmt.block_bytes))
        if 0 in halves:
            em.prefetch_ahead(wb, fmt.block_bytes)
        for h in halves:
            ws = _half_f16(em, wb, fmt.quant_bytes, h)

            def lanes(j: int, xr, chunk_dot, h=h, ws=ws):
                dx = em.splat(em.load(F32, xr, em.add(off_d, em.mul(k, 4))), H)
                scale = b.fmul(dx, ws)
                for c in range(fmt.chunks):
                    acc = accs[h, j][c]
                    em.set(acc, em.fma(scale, b.sitofp(chunk_dot(j, xr, c), vf), em.get(acc)))

            chunks = _half_chunks(em, fmt, wb, h)
            for j, xr in enumerate(rows):
                def dot(j, xr, c, chunks=chunks):
                    init = em.splat(em.load(I32, xr, em.add(off_corr, em.mul(em.add(em.mul(k, fmt.chunks), c), 4))),
                                    H, I32) if fmt.corr == "chunk" else izero
                    x = int_dot.bcast4(em, em.gep(xr, em.mul(k, fmt.bs)), 4 * c)
                    return int_dot.dot4(em, init, chunks[c], x)
                lanes(j, xr, dot)
            if fmt.min:
                wm = _half_f16(em, wb, fmt.quant_bytes + fmt.scale_bytes, h)
                for j, xr in enumerate(rows):
                    aux = em.splat(em.load(F32, xr, em.add(off_aux, em.mul(k, 4))), H)
                    em.set(mins[h, j], em.fma(wm, aux, em.get(mins[h, j])))
    for (h, j), lane_accs in accs.items():
        total = lanes8_total(b, [em.get(x) for x in lane_accs])
        if mins:
            total = b.fadd(total, em.get(mins[h, j]))
        out.store(h, j, total)


# -- signed Q8_0 without VNNI: vpmaddwd on int16 pairs ------------------------------------------------
PAIRS_TOKENS = 4                 # tokens per tile
PAIRS_K_BLOCKS = 32              # blocks of K per pass: a pass's weights, activations and scales stay in L1
PAIRS_GROUP_BYTES = 1 << 18      # weights of the groups that share one widening of a tile's activations


def pairs_passes(r: int, chunks: int = 8) -> tuple:
    """Chunks per pass over K for a tile of r tokens: at most 8 accumulators in registers (the
    chunks' accumulators are independent, so the passes' order leaves every float sum as it is)."""
    per = max(1, 8 // r)
    return tuple(tuple(range(i, min(i + per, chunks))) for i in range(0, chunks, per))


def emit_pairs(fmt: QFormat, K: int, em: Emitter, a) -> None:
    """Q8_0 x Q8_0 in vec_dot's lanes8 order through int16 products, exact for every byte: a chunk
    lane is vpmaddwd(w[0:2], x[0:2]) + vpmaddwd(w[2:4], x[2:4]). vpmaddubsw's sign trick costs a
    vpsignb per (chunk, token) on the ports that also run the products, conversions and fmas; here
    each chunk's weights are widened once for a tile of tokens (vpmovsxbw, another port) and the
    tile's activations once for a block of groups (int16 rows on the stack). One token takes both
    halves of a group in one pass, so its weights stream from memory without a pause: a pass per
    half left the second one computing from L1 while nothing was fetched (emulated Zen 3, big-q8_0:
    3.24-4.59 -> 2.91-3.19 ms a token, alternating runs)."""
    N, M = a.ints
    y_ptr, w_ptr, x_ptr = a.ptrs
    nb, _, _, _, row_bytes = act_layout(fmt, K)
    T = PAIRS_TOKENS
    scratch = _PairsScratch(x16=_stack_array(em, ir.ArrayType(I16, T * K), "x16"),
                            scales=_stack_array(em, ir.ArrayType(F32, T * PAIRS_K_BLOCKS * H), "scales"),
                            accs=_stack_array(em, ir.ArrayType(F32, 2 * T * fmt.chunks * H), "accs"))
    n_block = max(T, (L2_BUDGET // row_bytes) // T * T)
    per_block = max(1, PAIRS_GROUP_BYTES // (nb * fmt.block_bytes))
    with em.claims(a).ranges(em.cdiv(M, G), CHUNK_GROUPS, em.cdiv(N, n_block)) as (nbi, g0, g1), \
            em.loop(g0, g1, per_block, name="gblk") as gb:
        n0 = em.mul(nbi, n_block)
        n1 = em.min(em.add(n0, n_block), N)
        gb1 = em.min(em.add(gb, per_block), g1)

        def tile(nt, r: int) -> None:
            rows = [em.gep(x_ptr, em.mul(em.add(nt, j), row_bytes)) for j in range(r)]
            for j, xr in enumerate(rows):
                with em.loop(0, K, 16, name="widen") as i:
                    em.store(em.b.sext(em.load(vec(I8, 16), xr, i), vec(I16, 16)), scratch.x16,
                             em.add(2 * K * j, em.mul(i, 2)))
            with em.loop(gb, gb1, name="grp") as g:
                wg = em.gep(w_ptr, em.mul(g, nb * fmt.block_bytes))
                out = _Out256(em, y_ptr, g, nt, M, em.min(em.sub(M, em.mul(g, G)), G))
                if r == 1:   # one token: both halves in one pass, the group's weights streamed once
                    with em.if_else(em.icmp("==", N, 1)) as (then, otherwise):
                        with then:
                            _PairsHalves(fmt, K, em, rows, scratch, wg, (0, 1)).run(out)
                        with otherwise:
                            for h in (0, 1):
                                _PairsHalves(fmt, K, em, rows, scratch, wg, (h,)).run(out)
                    return
                for h in (0, 1):
                    _PairsHalves(fmt, K, em, rows, scratch, wg, (h,)).run(out)

        em.tiles(n0, n1, T, tile, name="nt")


@dataclass(frozen=True)
class _PairsScratch:
    x16: ir.Value        # [T, K] int16: the tile's activations
    scales: ir.Value     # [T, PAIRS_K_BLOCKS] x 8 f32: d_x * d_w of the half's rows, per block
    accs: ir.Value       # [2, T, C] x 8 f32: the chunk accumulators between blocks of K


def _stack_array(em: Emitter, ty: ir.ArrayType, name: str):
    """An entry-block array seen as an untyped pointer, for em.load/em.store of any element type."""
    slot = em.var(ty, name=name)
    slot.type = PTR          # llvmlite's typed alloca would refuse vector stores through a byte gep
    slot.align = 32
    return slot


class _PairsHalves:
    """Halves (8 rows each) of one group against the tile's tokens: over blocks of K, the chunk
    accumulators of each (half, token) in passes of a few chunks, the block scales d_x * d_w
    stored once for all passes of a block of K. One half at a time keeps a pass's accumulators in
    registers; both halves (one token) read the group's weights in one pass and spill some."""

    def __init__(self, fmt: QFormat, K: int, em: Emitter, rows: list, scratch: _PairsScratch, wg,
                 halves: tuple[int, ...]):
        self.fmt, self.K, self.em, self.rows, self.s, self.wg = fmt, K, em, rows, scratch, wg
        self.halves = halves
        self.nb, self.off_d = K // fmt.bs, act_layout(fmt, K)[1]
        self.vf = vec(F32, H)
        self.passes = pairs_passes(len(rows))
        assert len(halves) == 1 or len(self.passes) == 1, "the scales scratch holds one half's"

    def run(self, out: _Out256) -> None:
        em, b, fmt = self.em, self.em.b, self.fmt
        if self.nb <= PAIRS_K_BLOCKS:
            self._k_block(0, self.nb, resume=False)
        else:
            zero = ir.Constant(self.vf, [0.0] * H)
            for h in self.halves:
                for j in range(len(self.rows)):
                    for c in range(fmt.chunks):
                        em.store(zero, self.s.accs, self._acc_at(h, j, c))
            with em.loop(0, self.nb, PAIRS_K_BLOCKS, name="kblk") as k0:
                self._k_block(k0, em.min(em.add(k0, PAIRS_K_BLOCKS), self.nb), resume=True)
        for h in self.halves:
            for j in range(len(self.rows)):
                out.store(h, j, lanes8_total(b, [em.load(self.vf, self.s.accs, self._acc_at(h, j, c))
                                                 for c in range(fmt.chunks)]))

    def _acc_at(self, h: int, j: int, c: int) -> int:
        return ((h * PAIRS_TOKENS + j) * self.fmt.chunks + c) * 4 * H

    def _scale(self, j: int, k, ws):
        em = self.em
        return em.b.fmul(em.splat(em.load(F32, self.rows[j], em.add(self.off_d, em.mul(k, 4))), H), ws)

    def _k_block(self, k0, k1, resume: bool) -> None:
        """Blocks [k0, k1) of K; `resume`: the accumulators start from those of the last blocks."""
        for i, chunks in enumerate(self.passes):
            self._pass(k0, k1, chunks, first=i == 0, resume=resume)

    def _scale_at(self, j: int, dk):
        return self.em.mul(self.em.add(j * PAIRS_K_BLOCKS, dk), 4 * H)

    def _pass(self, k0, k1, chunks: tuple, first: bool, resume: bool) -> None:
        """The first pass computes the scales (and stores them for the others)."""
        em, b, fmt = self.em, self.em.b, self.fmt
        n = len(self.rows)
        zero = ir.Constant(self.vf, [0.0] * H)
        accs = {(h, j, c): em.var(self.vf, em.load(self.vf, self.s.accs, self._acc_at(h, j, c)) if resume else zero)
                for h in self.halves for j in range(n) for c in chunks}
        w_at = em.var(I64, em.i64(em.mul(k0, fmt.block_bytes)))   # a pointer step, not k * 544 (an imul on port 1)
        with em.loop(k0, k1, name="blk") as k:
            wb = em.gep(self.wg, em.get(w_at))
            em.set(w_at, em.b.add(em.get(w_at), em.i64(fmt.block_bytes)))
            if first and self.halves[0] == 0:
                em.prefetch_ahead(wb, fmt.block_bytes)
            for h in self.halves:
                if first:
                    ws = _half_f16(em, wb, fmt.quant_bytes, h)
                    scale = [self._scale(j, k, ws) for j in range(n)]
                    if len(self.passes) > 1:
                        for j in range(n):
                            em.store(scale[j], self.s.scales, self._scale_at(j, em.sub(k, k0)))
                else:
                    scale = [em.load(self.vf, self.s.scales, self._scale_at(j, em.sub(k, k0))) for j in range(n)]
                for c in chunks:
                    w01, w23 = (b.sext(em.load(vec(I8, 16), wb, 64 * c + 32 * h + 16 * p), vec(I16, 16))
                                for p in (0, 1))
                    for j in range(n):
                        at = em.add(2 * self.K * j, em.mul(k, 2 * fmt.bs))
                        p = b.add(int_dot.madd16(em, w01, int_dot.bcast_pair(em, self.s.x16, em.add(at, 8 * c))),
                                  int_dot.madd16(em, w23, int_dot.bcast_pair(em, self.s.x16, em.add(at, 8 * c + 4))))
                        em.set(accs[h, j, c], em.fma(scale[j], b.sitofp(p, self.vf), em.get(accs[h, j, c])))
        for (h, j, c), acc in accs.items():
            em.store(em.get(acc), self.s.accs, self._acc_at(h, j, c))


# -- quantized operands that are not packed weights (KV cache views, batched tensors) ------------------
_BLOCK = {"q8_0": (34, 2), "q4_0": (18, 2), "q4_1": (20, 4), "q5_0": (22, 6), "q5_1": (24, 8)}


def _block_lanes(em: Emitter, dtype: str, blk, x):
    """vec_dot's 8 int32 lanes (sum of 4 consecutive products) of a raw ggml block against the 32
    activation bytes x, exact for every byte: unsigned 4/5-bit values with their offset undone on
    x's side, Q8_0 through int16 products without VNNI (a -128 defeats the sign trick)."""
    b = em.b
    if dtype == "q8_0":
        w = em.load(int_dot.V32I8, blk, 2)
        if em.target.vnni:
            unsigned = b.xor(w, ir.Constant(int_dot.V32I8, [0x80] * 32))
            return b.sub(int_dot.dot4(em, ir.Constant(int_dot.V8I32, [0] * 8), unsigned, x), _offset_lanes(em, 128, x))
        return _wide_lanes(em, w, x)
    _, qs = _BLOCK[dtype]
    raw = em.load(vec(I8, 16), blk, qs)
    q = b.and_(em.concat(raw, b.lshr(raw, ir.Constant(vec(I8, 16), [4] * 16))), ir.Constant(int_dot.V32I8, [15] * 32))
    if dtype in ("q5_0", "q5_1"):
        qh = b.bitcast(em.load(I32, blk, 2 if dtype == "q5_0" else 4), vec(I8, 4))
        spread = em.shuffle(qh, None, [i // 8 for i in range(32)])
        bit = ir.Constant(int_dot.V32I8, [1 << (i % 8) for i in range(32)])
        high = b.select(b.icmp_unsigned("!=", b.and_(spread, bit), ir.Constant(int_dot.V32I8, [0] * 32)),
                        ir.Constant(int_dot.V32I8, [16] * 32), ir.Constant(int_dot.V32I8, [0] * 32))
        q = b.or_(q, high)
    lanes = int_dot.dot4(em, ir.Constant(int_dot.V8I32, [0] * 8), q, x)
    offset = {"q4_0": 8, "q5_0": 16}.get(dtype, 0)
    return b.sub(lanes, _offset_lanes(em, offset, x)) if offset else lanes


def _offset_lanes(em: Emitter, offset: int, x):
    """offset * (sum of each 4 consecutive x), as int32 lanes."""
    return int_dot.dot4(em, ir.Constant(int_dot.V8I32, [0] * 8), ir.Constant(int_dot.V32I8, [offset] * 32), x)


def _wide_lanes(em: Emitter, w, x):
    """4-value lanes of signed w . signed x through vpmaddwd on int16 values."""
    b = em.b
    w16, x16 = b.sext(w, vec(I16, 32)), b.sext(x, vec(I16, 32))
    pairs = [em.intrinsic("llvm.x86.avx2.pmadd.wd", int_dot.V8I32, [em.shuffle(w16, None, range(16 * h, 16 * h + 16)),
                                                                     em.shuffle(x16, None, range(16 * h, 16 * h + 16))])
             for h in range(2)]
    both = em.concat(*pairs)
    return b.add(em.shuffle(both, None, range(0, 16, 2)), em.shuffle(both, None, range(1, 16, 2)))


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
            lanes = _block_lanes(em, self.dtype, blk, em.load(int_dot.V32I8, xrow, em.mul(k, 32)))
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
