"""Float matmuls (f32, f16, bf16 weights or KV caches): y[.., n, m] = sum_k a[.., m, k] b[.., n, k].

Two summation orders, the two ggml uses, chosen as ggml chooses at run time, with the lane
widths of the numerics profile (em.numerics; ir/float_x86.py is the reference):
- tinyBLAS (llamafile sgemm; N >= 2, K % KN == 0, M % 4 == 0 and src1 offered): one fma
  accumulator of `lanes` per output over steps of KN = lanes, reduced as _mm512_reduce_add_ps or
  the 128-bit hsum (for bf16 with vdpbf16ps: KN = 32, pairs of products per lane, denormals
  flushed). Computed in register tiles sized for the target (4 x 6 with 32 registers, 4 x 3 with
  16) over n-blocks of b that stay in L2 while all of a thread's weight rows pass over them, and
  K chunks that stay in L1 (the accumulators wait in a per-thread scratch between chunks: each
  lane still adds its products in K order). f16/bf16 weight rows are widened once per n-block
  into the scratch, except for bf16 with vdpbf16ps on an AVX512_BF16 target, which reads them as
  they are. An accumulator wider than the target's vectors (the avx512 profile on an AVX2 CPU)
  is summed one register-wide part at a time, and the parts are joined before the reduction.
- ggml_vec_dot_f16/f32 otherwise: four accumulators over steps of 4 * lanes, GGML_F32_VEC_REDUCE,
  then the leftovers (into a double for f16; for f32 rounded products, then fmas for the last
  K % fused_tail); ggml_vec_dot_bf16: two vdpbf16ps accumulators over 64-wide steps, or four
  8-lane ones over 32, each reduced into the double, then the leftovers.

b arrives already rounded to a's type (see MatPrep; bf16 bits with vdpbf16ps) unless a is f32. Threads split the
(batch, 16-row block of M) units. `FloatTiles` chooses every size from the target and profile.
"""

from __future__ import annotations

from dataclasses import dataclass

import llvmlite.ir as ir

from llamir.backends.llvm import vmath
from llamir.backends.llvm.emit import F32, F64, I16, I32, Emitter, storage_type, vec
from llamir.backends.llvm.plan import Kernel, Ref

RM = 4                  # weight rows per register tile (tinyBLAS needs M % 4 == 0)
M_UNIT = 16
NB_MAX = 512            # b rows per n-block at most
ACC_BYTES = NB_MAX * RM * 16 * 4    # per-thread scratch for an n-block's accumulators
PREP_LANES = 16         # MatPrep's conversion width (element-wise: any width gives the same bits)


@dataclass(frozen=True)
class FloatTiles:
    """Sizes of the float matmul loops for one target and profile (they change speed, never bits).

    acc_lanes: lanes of one output's tinyBLAS accumulator (the profile's; 16 for vdpbf16ps);
    width: of those, the lanes one register holds; parts = acc_lanes // width;
    rn: b rows per register tile (RM weight rows); l2_budget: bytes of b rows per n-block;
    k_chunk: K values per pass over an n-block at most (RM weight rows and rn b rows of it stay
    in L1; K is cut in equal chunks);
    dot_rows: weight rows sharing each b load in the vec_dot order (f16 rows one at a time on AVX2)."""

    acc_lanes: int
    width: int
    rn: int
    l2_budget: int
    k_chunk: int
    dot_rows: int

    @property
    def parts(self) -> int:
        return self.acc_lanes // self.width


def float_tiles(em: Emitter, a_dtype: str) -> FloatTiles:
    """Tiles for the emitter's target: RM x rn accumulators of `parts` registers plus the loads
    fit the register file (32 zmm/ymm with AVX-512, 16 ymm with AVX2)."""
    dp = a_dtype == "bf16" and em.numerics.bf16_dot
    acc = 16 if dp else em.numerics.lanes
    target_lanes = em.target.lanes
    regs = 32 if em.target.avx512 else 16
    width = min(acc, target_lanes)
    if regs == 32:
        rn = 6
    else:                       # 12 accumulators, 3 b registers, one a (ggml's 4 x 3 for AVX2)
        rn = 2 if dp else 3
    dot_lanes = 16 if dp else (8 if a_dtype == "bf16" else em.numerics.lanes)
    dot_parts = max(1, -(-dot_lanes // target_lanes))
    n_acc = 2 if dp else 4
    dot_rows = next(r for r in (4, 2, 1) if r == 1 or (r + 1) * n_acc * dot_parts + 1 <= regs)
    if a_dtype == "f16" and regs == 16:
        # an f16 gemv on AVX2 streams one weight row at a time: two rows sharing each b load read
        # slower (real Zen 2, big-f16 a token 11.7 -> 10.1 ms; f32 rows keep their pairs)
        dot_rows = 1
    l1_rows = RM + rn           # a chunk of RM weight rows and rn b rows in 24 KiB (32 with AVX-512)
    k_chunk = ((32 << 10) if regs == 32 else (24 << 10)) // (4 * l1_rows)
    return FloatTiles(acc, width, rn, (1 << 20) if em.target.avx512 else (1 << 18), k_chunk, dot_rows)


@dataclass(frozen=True)
class _Chunk:
    k0: ir.Value
    k1: ir.Value
    first: ir.Value     # k0 == 0: accumulators start at zero
    last: ir.Value      # k1 == K: reduce and store


def _v(em: Emitter, ptr, off, dtype: str, lanes: int):
    """`lanes` values of a float row at byte offset `off`, as f32."""
    ety = storage_type(dtype)
    return em.to_f32(em.load(vec(ety, lanes), ptr, off), dtype)


def _s(em: Emitter, ptr, off, dtype: str):
    return em.to_f32(em.load(storage_type(dtype), ptr, off), dtype)


def ftz(em: Emitter, x):
    """Denormals to signed zero (vdpbf16ps's DAZ on inputs and FTZ on results)."""
    n = x.type.count
    tiny = em.b.fcmp_ordered("<", em.intrinsic(f"llvm.fabs.v{n}f32", x.type, [x]), vmath.splat(em, 2.0 ** -126, n))
    zero = em.intrinsic(f"llvm.copysign.v{n}f32", x.type, [vmath.splat(em, 0.0, n), x])
    return em.b.select(tiny, zero, x)


def native_dpbf16(em: Emitter) -> bool:
    """vdpbf16ps itself (AVX512_BF16) rather than its emulation: same bits, one instruction."""
    return em.numerics.bf16_dot and em.target.avx512 and em.target.has("avx512bf16")


def dpbf16_raw(em: Emitter, acc, a16, b16):
    """vdpbf16ps on 32 bf16 bit patterns each (<32 x i16>) into 16 f32 lanes."""
    i32x16 = vec(I32, 16)
    return em.intrinsic("llvm.x86.avx512bf16.dpbf16ps.512", acc.type,
                        [acc, em.b.bitcast(a16, i32x16), em.b.bitcast(b16, i32x16)])


def dpbf16(em: Emitter, acc, a32, b32):
    """vdpbf16ps on 2n bf16 values held as f32 (n = acc's lanes): lane j += a[2j+1]*b[2j+1], then
    += a[2j]*b[2j]."""
    span = a32.type.count
    for lanes in (range(1, span, 2), range(0, span, 2)):
        x, y = em.shuffle(a32, None, lanes), em.shuffle(b32, None, lanes)
        acc = ftz(em, em.fma(ftz(em, x), ftz(em, y), acc))
    return acc


class MatMulFloat(Kernel):
    """y [B0, B1, N, M] f32 (contiguous) from a [A0, A1, M, K] and b [B0, B1, N, K] (rows of
    both contiguous along K; any row/batch strides)."""

    shares_work = True      # ggml_vec_dot's units of M_UNIT rows (Claims.ranges); tinyBLAS splits evenly

    def __init__(self, y: Ref, a: Ref, b: Ref, b_dtype: str, sgemm: bool, a_is_weight: bool = True):
        y, a, b = y.padded(), a.padded(), b.padded()
        self.a_dtype, self.b_dtype = a.dtype.name, b_dtype
        self.sgemm = sgemm
        if not a_is_weight:      # a KV cache's strides follow its size: every context size shares the code
            self.runtime_ints = (9, 10, 11)
        self.n_ptrs = 4        # y, a, b, per-thread scratch
        super().__init__(list(y.shape) + list(y.strides[:3]) + list(a.shape[:2]) + list(a.strides[:3])
                         + list(b.strides[:3]) + [b.shape[3]])

    def config(self) -> tuple:
        return (self.a_dtype, self.b_dtype, self.sgemm)

    @property
    def _dp(self) -> bool:
        return self.a_dtype == "bf16" and self.numerics.bf16_dot

    def emit(self, em: Emitter, a) -> None:
        yshape, ystr = a.ints[0:4], a.ints[4:7]
        ash, astr, bstr, K = a.ints[7:9], a.ints[9:12], a.ints[12:15], a.ints[15]
        N, M = yshape[2], yshape[3]
        m_units = em.cdiv(M, M_UNIT)
        batches = em.mul(yshape[0], yshape[1])
        u0, u1 = em.split(em.mul(batches, m_units), a.ith, a.nth)
        y_ptr, a_ptr, b_ptr, scratch = a.ptrs

        def unit(u):
            """(A, B, Y, m0, m1) of unit u: one batch's rows [m0, m1) of M."""
            bi = em.div(u, m_units)
            m0 = em.mul(em.rem(u, m_units), M_UNIT)
            i1, i0 = em.rem(bi, yshape[1]), em.div(bi, yshape[1])
            ai0 = em.div(i0, em.div(yshape[0], ash[0]))
            ai1 = em.div(i1, em.div(yshape[1], ash[1]))
            A = em.gep(a_ptr, em.add(em.mul(ai0, astr[0]), em.mul(ai1, astr[1])))
            B = em.gep(b_ptr, em.add(em.mul(i0, bstr[0]), em.mul(i1, bstr[1])))
            Y = em.gep(y_ptr, em.add(em.mul(i0, ystr[0]), em.mul(i1, ystr[1])))
            return A, B, Y, m0, em.min(em.add(m0, M_UNIT), M)

        with em.if_else(self._tinyblas_ok(em, N, M, K)) as (then, otherwise):
            with then:
                self._tiles(em, unit, u0, u1, scratch, N, K, astr[2], bstr[2], ystr[2])
            with otherwise, em.claims(a).ranges(em.mul(batches, m_units), 1) as (_, c0, c1), \
                    em.loop(c0, c1, name="unit") as u:
                A, B, Y, m0, m1 = unit(u)
                self._vec_dots(em, A, B, Y, m0, m1, N, K, astr[2], bstr[2], ystr[2])

    def _kn(self) -> int:
        return 32 if self._dp else self.numerics.lanes

    def _tinyblas_ok(self, em: Emitter, N, M, K) -> ir.Value:
        b = em.b
        if not self.sgemm:
            return ir.Constant(ir.IntType(1), 0)
        ok = em.icmp(">=", N, 2)
        ok = b.and_(ok, em.icmp("==", em.rem(K, self._kn()), 0))
        return b.and_(ok, em.icmp("==", em.rem(M, 4), 0))

    # -- tinyBLAS order ----------------------------------------------------------------------
    def _tiles(self, em: Emitter, unit, u0, u1, scratch, N, K, lda, ldb, ldy) -> None:
        """n-blocks of b rows (kept in L2 while every unit of this thread passes over them) x RM
        weight rows x K chunks (kept in L1) x tiles; the accumulators of an n-block wait in the
        scratch between K chunks (ggml's tinyBLAS also keeps a block of b hot across weight rows)."""
        native = self._dp and native_dpbf16(em)
        widen = self.a_dtype != "f32" and not native   # vdpbf16ps reads the bf16 rows as they are
        lanes = self.numerics.lanes
        tiles = float_tiles(em, self.a_dtype)
        rn = tiles.rn
        nb = em.max(rn * 4, em.min(NB_MAX, em.mul(em.div(em.div(tiles.l2_budget, em.mul(K, 4)), rn), rn)))
        accbuf = em.gep(scratch, em.mul(K, RM * 4))
        kn = self._kn()         # K in equal chunks of at most tiles.k_chunk, each a multiple of kn
        kc = em.mul(em.cdiv(em.cdiv(K, em.cdiv(K, tiles.k_chunk)), kn), kn)
        with em.loop(0, N, nb, name="nb") as n0, em.loop(u0, u1, name="unit") as u:
            A, B, Y, m0, m1 = unit(u)
            n1 = em.min(em.add(n0, nb), N)
            with em.loop(m0, m1, RM, name="mt") as mt:
                if widen:   # RM weight rows -> f32 scratch [RM][K]
                    with em.loop(0, K, lanes, name="wk") as k:
                        for i in range(RM):
                            row = em.mul(em.add(mt, i), lda)
                            v = _v(em, A, em.add(row, em.mul(k, self._asize())), self.a_dtype, lanes)
                            em.store(v, scratch, em.mul(em.add(em.mul(i, K), k), 4))
                    arow = [em.gep(scratch, em.mul(em.mul(i, K), 4)) for i in range(RM)]
                else:
                    arow = [em.gep(A, em.mul(em.add(mt, i), lda)) for i in range(RM)]
                def sweep(chunk: _Chunk, arow=arow, B=B, Y=Y, mt=mt) -> None:
                    def tile(nt, n):
                        acc = em.gep(accbuf, em.mul(em.sub(nt, n0), RM * tiles.acc_lanes * 4))
                        self._tile(em, tiles, arow, B, Y, acc, chunk, mt, nt, n, ldb, ldy, native)

                    em.tiles(n0, n1, rn, tile, name="nt")

                if isinstance(K, int) and K <= tiles.k_chunk:   # one chunk, known when compiling
                    true = ir.Constant(ir.IntType(1), 1)
                    sweep(_Chunk(em.i64(0), em.i64(K), true, true))
                else:
                    with em.loop(0, K, kc, name="kc") as k0:
                        k1 = em.min(em.add(k0, kc), K)
                        sweep(_Chunk(k0, k1, em.icmp("==", k0, 0), em.icmp("==", k1, K)))

    def _asize(self) -> int:
        return {"f32": 4, "f16": 2, "bf16": 2}[self.a_dtype]

    def _tile(self, em: Emitter, tiles: FloatTiles, arow, B, Y, acc_ptr, chunk: _Chunk, mt, nt, rn: int,
              ldb, ldy, native: bool) -> None:
        """RM x rn outputs over one K chunk, each accumulator one register-wide part at a time
        (lanes [p*width, (p+1)*width) see the same products in the same order as the whole vector
        would). Accumulators start at zero or from acc_ptr ([rn][RM][acc_lanes]), go back there,
        and after the last chunk are joined, reduced and stored. `native`: a and b rows are bf16
        bits for vdpbf16ps."""
        width, kn = tiles.width, self._kn()
        a_size, b_size = (2 if native else 4), _size(self.b_dtype)
        span = 2 * width if self._dp else width      # inputs per part and k step
        zero = ir.Constant(vec(F32, width), [0.0] * width)
        brow = [em.gep(B, em.mul(em.add(nt, j), ldb)) for j in range(rn)]

        def slot(j: int, i: int, p: int) -> int:
            return ((j * RM + i) * tiles.acc_lanes + p * width) * 4

        def reduce_store(j: int, i: int, whole) -> None:
            out = em.add(em.mul(em.add(nt, j), ldy), em.mul(em.add(mt, i), 4))
            em.store(em.reduce_add_tree(whole), Y, out)

        for p in range(tiles.parts):
            accs = [[em.var(vec(F32, width), zero) for i in range(RM)] for j in range(rn)]
            with em.if_(em.b.not_(chunk.first)):
                for j in range(rn):
                    for i in range(RM):
                        em.set(accs[j][i], em.load(vec(F32, width), acc_ptr, slot(j, i, p)))
            with em.loop(chunk.k0, chunk.k1, kn, name=f"k{p}") as k:
                col = em.add(k, p * span)
                self._k_step(em, accs, arow, brow, col, span, a_size, b_size, native)
            if tiles.parts == 1:    # the usual case: reduced from registers after the last chunk
                with em.if_else(chunk.last) as (then, otherwise):
                    with then:
                        for j in range(rn):
                            for i in range(RM):
                                reduce_store(j, i, em.get(accs[j][i]))
                    with otherwise:
                        for j in range(rn):
                            for i in range(RM):
                                em.store(em.get(accs[j][i]), acc_ptr, slot(j, i, p))
                return
            for j in range(rn):
                for i in range(RM):
                    em.store(em.get(accs[j][i]), acc_ptr, slot(j, i, p))
        with em.if_(chunk.last):
            for j in range(rn):
                for i in range(RM):
                    reduce_store(j, i, em.load(vec(F32, tiles.acc_lanes), acc_ptr, slot(j, i, 0)))

    def _k_step(self, em: Emitter, accs, arow, brow, col, span: int, a_size: int, b_size: int, native: bool) -> None:
        """One step of `span` inputs into every accumulator of the tile. The shorter side stays in
        registers, the other is loaded per use (ggml's gemm_bloc order)."""
        rn = len(brow)

        def load_a(i: int):
            return em.load(vec(I16 if native else F32, span), arow[i], em.mul(col, a_size))

        def load_b(j: int):
            if native:
                return em.load(vec(I16, span), brow[j], em.mul(col, 2))
            return _v(em, brow[j], em.mul(col, b_size), self.b_dtype, span)

        def fma(j: int, i: int, av, bv) -> None:
            acc = em.get(accs[j][i])
            if native:
                em.set(accs[j][i], dpbf16_raw(em, acc, av, bv))
            else:
                em.set(accs[j][i], dpbf16(em, acc, av, bv) if self._dp else em.fma(av, bv, acc))

        if RM <= rn:
            avs = [load_a(i) for i in range(RM)]
            for j in range(rn):
                bv = load_b(j)
                for i in range(RM):
                    fma(j, i, avs[i], bv)
        else:
            bvs = [load_b(j) for j in range(rn)]
            for i in range(RM):
                av = load_a(i)
                for j in range(rn):
                    fma(j, i, av, bvs[j])

    # -- ggml_vec_dot order --------------------------------------------------------------------
    def _vec_dots(self, em: Emitter, A, B, Y, m0, m1, N, K, lda, ldb, ldy) -> None:
        rows = float_tiles(em, self.a_dtype).dot_rows
        with em.loop(0, N, name="n") as n:
            brow = em.gep(B, em.mul(n, ldb))
            full = em.add(m0, em.mul(em.div(em.sub(m1, m0), rows), rows))
            with em.loop(m0, full, rows, name=f"m{rows}") as m:
                self._dots(em, A, brow, Y, n, m, rows, K, lda, ldy)
            if rows > 1:
                with em.loop(full, m1, name="m1") as m:
                    self._dots(em, A, brow, Y, n, m, 1, K, lda, ldy)

    def _dots(self, em: Emitter, A, brow, Y, n, m, rows: int, K, lda, ldy) -> None:
        arows = [em.gep(A, em.mul(em.add(m, r), lda)) for r in range(rows)]
        if self.a_dtype == "bf16":
            totals = vec_dot_bf16(em, arows, brow, K, self.b_dtype)
        else:
            totals = vec_dot_rows(em, arows, self.a_dtype, brow, "f32", K, self._asize(), 4, prefetch=True)
        for r in range(rows):
            em.store(totals[r], Y, em.add(em.mul(n, ldy), em.mul(em.add(m, r), 4)))


def vec_dot_rows(em: Emitter, arows, a_dtype: str, brow, b_dtype: str, K, a_step: int, b_step: int,
                 prefetch: bool = False) -> list:
    """ggml_vec_dot_f16/f32 of each a row with one b row (a's type decides the leftovers): four
    accumulators of the profile's lanes over steps of 4 * lanes, GGML_F32_VEC_REDUCE, leftovers.
    `prefetch`: the a rows are weights streamed once (em.prefetch_ahead along each)."""
    b = em.b
    lanes = vmath.lanes(em)
    step = 4 * lanes
    zero = ir.Constant(vec(F32, lanes), [0.0] * lanes)
    accs = [[em.var(vec(F32, lanes), zero) for _ in range(4)] for _ in arows]
    main = em.mul(em.div(K, step), step)
    with em.loop(0, main, step, name="kstep") as k:
        if prefetch:
            for arow in arows:
                em.prefetch_ahead(arow, step * a_step, em.mul(k, a_step))
        bv = [_v(em, brow, em.mul(em.add(k, lanes * q), b_step), b_dtype, lanes) for q in range(4)]
        for r, arow in enumerate(arows):
            for q in range(4):
                av = _v(em, arow, em.mul(em.add(k, lanes * q), a_step), a_dtype, lanes)
                em.set(accs[r][q], em.fma(av, bv[q], em.get(accs[r][q])))
    totals = []
    for r, arow in enumerate(arows):
        total = vmath.reduce_accumulators(em, [em.get(x) for x in accs[r]])
        totals.append(_leftovers(em, arow, a_dtype, brow, b_dtype, total, main, K, a_step, b_step))
    del b
    return totals


def _leftovers(em: Emitter, arow, a_dtype: str, brow, b_dtype: str, total, main, K, a_step: int, b_step: int):
    b = em.b
    if a_dtype == "f32":   # GCC's epilogue: rounded products of whole groups, then fmas
        acc = em.var(F32, total)
        fused_from = em.sub(K, em.rem(K, em.numerics.fused_tail))
        with em.loop(main, K, name="left") as i:
            av, bv = _s(em, arow, em.mul(i, a_step), a_dtype), _s(em, brow, em.mul(i, b_step), b_dtype)
            plain = b.fadd(em.get(acc), b.fmul(bv, av))
            fused = em.fma(bv, av, em.get(acc))
            em.set(acc, b.select(em.icmp("<", i, fused_from), plain, fused))
        return em.get(acc)
    acc = em.var(F64, b.fpext(total, F64))
    with em.loop(main, K, name="left") as i:
        p = b.fmul(_s(em, brow, em.mul(i, b_step), b_dtype), _s(em, arow, em.mul(i, a_step), a_dtype))
        em.set(acc, b.fadd(em.get(acc), b.fpext(p, F64)))
    return b.fptrunc(em.get(acc), F32)


def vec_dot_bf16(em: Emitter, arows, brow, K, b_dtype: str = "f32") -> list:
    """ggml_vec_dot_bf16 of each bf16 a row with b (bf16 values, as f32 or as bf16 bits):
    vdpbf16ps accumulators c1, c2 over 64-wide steps (AVX512_BF16), or c1..c4 of 8 lanes over 32
    (AVX2), each summed into a double, then the leftovers into it."""
    b = em.b
    dp = em.numerics.bf16_dot
    native = native_dpbf16(em) and b_dtype == "bf16"
    b_size = _size(b_dtype)
    width, step = (16, 64) if dp else (8, 32)
    zero = ir.Constant(vec(F32, width), [0.0] * width)
    accs = [[em.var(vec(F32, width), zero) for _ in range(2 if dp else 4)] for _ in arows]
    main = em.mul(em.div(K, step), step)
    with em.loop(0, main, step, name="kstep") as k:
        for r, arow in enumerate(arows):
            for q in range(len(accs[r])):
                span = 32 if dp else 8
                col = em.add(k, span * q)
                acc = em.get(accs[r][q])
                if native:
                    av = em.load(vec(I16, span), arow, em.mul(col, 2))
                    em.set(accs[r][q], dpbf16_raw(em, acc, av, em.load(vec(I16, span), brow, em.mul(col, 2))))
                    continue
                av = _v(em, arow, em.mul(col, 2), "bf16", span)
                bv = _v(em, brow, em.mul(col, b_size), b_dtype, span)
                em.set(accs[r][q], dpbf16(em, acc, av, bv) if dp else em.fma(av, bv, acc))
    totals = []
    for r, arow in enumerate(arows):
        c = [em.get(x) for x in accs[r]]
        if dp:
            total = b.fadd(b.fpext(em.reduce_add_tree(c[0]), F64), b.fpext(em.reduce_add_tree(c[1]), F64))
        else:
            total = b.fpext(em.reduce_add_tree(b.fadd(b.fadd(c[0], c[2]), b.fadd(c[1], c[3]))), F64)
        acc = em.var(F64, total)
        with em.loop(main, K, name="left") as i:
            p = b.fmul(_s(em, brow, em.mul(i, b_size), b_dtype), _s(em, arow, em.mul(i, 2), "bf16"))
            em.set(acc, b.fadd(em.get(acc), b.fpext(p, F64)))
        totals.append(b.fptrunc(em.get(acc), F32))
    return totals


class MatPrep(Kernel):
    """b rounded to the weight's type (f16 or bf16), written contiguous as f32 values, or as bf16
    bits when `out` is bf16 (for vdpbf16ps): ggml's src1 conversion to the vec_dot_type. Threads
    take rows."""

    def __init__(self, out: Ref, src: Ref, to: str):
        out, src = out.padded(), src.padded()
        self.to = to
        self.out_dtype = out.dtype.name
        self.src_dtype = src.dtype.name
        self.n_ptrs = 2
        super().__init__(list(src.shape) + list(src.strides) + list(out.strides))

    def config(self) -> tuple:
        return (self.to, self.src_dtype, self.out_dtype)

    def emit(self, em: Emitter, a) -> None:
        from llamir.backends.llvm.kernels.rows import row_pointer

        shape, sst, ost = a.ints[0:4], a.ints[4:8], a.ints[8:12]
        rows = em.n_rows(shape)
        r0, r1 = em.split(rows, a.ith, a.nth)
        with em.loop(r0, r1, name="row") as r:
            src = row_pointer(em, a.ptrs[1], r, shape[:3], sst[:3])
            dst = row_pointer(em, a.ptrs[0], r, shape[:3], ost[:3])
            chunks = em.mul(em.div(shape[3], PREP_LANES), PREP_LANES)

            out_size = _size(self.out_dtype)

            def conv(x):
                if self.to == "f32":
                    return x
                rounded = em.from_f32(x, self.to)
                return rounded if self.out_dtype != "f32" else em.to_f32(rounded, self.to)

            with em.loop(0, chunks, PREP_LANES, name="c") as c:
                x = _v(em, src, em.mul(c, sst[3]), self.src_dtype, PREP_LANES) if isinstance(sst[3], int) and \
                    sst[3] == _size(self.src_dtype) else None
                if x is None:
                    x = ir.Constant(vec(F32, PREP_LANES), None)
                    for j in range(PREP_LANES):
                        x = em.b.insert_element(x, _s(em, src, em.mul(em.add(c, j), sst[3]), self.src_dtype),
                                                ir.Constant(ir.IntType(32), j))
                em.store(conv(x), dst, em.mul(c, out_size))
            with em.loop(chunks, shape[3], name="t") as c:
                em.store(conv(_s(em, src, em.mul(c, sst[3]), self.src_dtype)), dst, em.mul(c, out_size))


def _size(dtype: str) -> int:
    return {"f32": 4, "f16": 2, "bf16": 2}[dtype]
