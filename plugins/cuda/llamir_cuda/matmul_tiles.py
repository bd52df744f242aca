"""The tiled kernel of mul_mat and mul_mat_id (kernels_matmul.py lowers to it), and the row loads
it shares with the matrix-vector kernel.

A block computes a tile of d: TileShape.bm rows of a by bn columns of b, bk of the inner axis at a
time, each stage loaded into shared memory with coalesced (vector, where the layout allows)
loads, out-of-range elements as zeros. Two bodies:

- MMA (f16 / bf16 weights): four warps, 2 x 2, each 32 x 32 of d as 2 x 4 m16n8k16 tensor-core
  products; a and b held as pairs of 16-bit values per word (b rounded to the weight's type as
  it is staged, as ggml's CPU rounds it), f32 accumulators.
- FMA (f32 weights): 16 x 16 threads, each 4 x 4 of d, strided by 16 so that neighbouring
  threads write neighbouring elements.

Columns of b and d are read through a table the block fills first (the byte offset of each of
its bn columns, -1 past the end): mul_mat's columns of one batch, or mul_mat_id's pairs that
chose the block's expert (kernels_matmul's mul_mat_id_pairs lists them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from llvmlite import ir

from llamir_cuda import kir
from llamir_cuda.kir import F32, I16, I32, I64, scalar, tensor

VECTOR_BYTES = 16  # the widest load a thread makes


@dataclass(frozen=True)
class TileShape:
    """A block's tile of d: bm rows of a by bn columns of b, bk deep per stage, `threads` threads
    (an "mma" tile is four warps, 2 x 2; an "fma" one FMA_REG x FMA_REG outputs per thread)."""

    kind: str  # "mma" or "fma"
    bm: int
    bn: int
    bk: int
    threads: int

    def unit(self, size: int) -> int:
        """The widest staging load, in elements of `size` bytes: 16 bytes, and every thread has
        at least one load of each operand per stage."""
        return min(VECTOR_BYTES // size, self.bm * self.bk // self.threads, self.bn * self.bk // self.threads)


MMA = TileShape("mma", bm=64, bn=64, bk=32, threads=128)
FMA = TileShape("fma", bm=64, bn=64, bk=16, threads=256)
MMA_WORDS = MMA.bk // 2 + 4  # words per staged row: the padding makes the fragment loads conflict-free
FMA_PAD = 2  # floats after each staged k: a warp's staging stores hit 32 banks
FMA_REG = 4  # outputs per thread along each axis


# -- row loads -------------------------------------------------------------------------------------
def load_raw(k: kir.KernelBuilder, ptr, off, nb0, dtype: str, n: int, vector: bool) -> list:
    """n consecutive elements of a row from byte `off`, as stored (f32 as f32, f16 and bf16 as
    their 16 bits): one aligned vector load when `vector`, else n loads nb0 bytes apart."""
    ty, size = (F32, 4) if dtype == "f32" else (I16, 2)
    if vector and n > 1:
        v = k.load(ptr, ir.VectorType(ty, n), off, align=n * size)
        return [k.b.extract_element(v, k.i32(i)) for i in range(n)]
    return [k.load(ptr, ty, k.b.add(off, k.b.mul(k.i64(i), nb0)) if i else off) for i in range(n)]


def widen(k: kir.KernelBuilder, raw, dtype: str):
    """A stored element (load_raw's) as f32."""
    if dtype == "f32":
        return raw
    return k.h2f(raw) if dtype == "f16" else k.bf2f(raw)


def to_vec_dot(k: kir.KernelBuilder, raw, tb: str, vdt: str):
    """An element of b (as stored, type tb) rounded to the weight's vec_dot_type `vdt`, as f32."""
    x = widen(k, raw, tb)
    if vdt in (tb, "f32"):
        return x
    return k.h2f(k.f2h(x)) if vdt == "f16" else k.bf2f(k.f2bf(x))


def _to_bits16(k: kir.KernelBuilder, raw, tb: str, vdt: str):
    """An element of b (as stored, type tb) as the 16 bits of its vec_dot_type (f16 or bf16)."""
    if tb == vdt:
        return raw
    x = widen(k, raw, tb)
    return k.f2h(x) if vdt == "f16" else k.f2bf(x)


# -- staging ---------------------------------------------------------------------------------------
RowSource = Callable[[ir.Value], tuple[ir.Value, ir.Value]]  # tile row -> (valid, byte offset of its row)


def _stage(k, tile: TileShape, rows: int, unit: int, vector: bool, k0, t: kir.Tensor, dtype: str,
           source: RowSource, put: Callable[[ir.Value, ir.Value, list], None]) -> None:
    """Load rows x bk elements of `t` from k0 on, `unit` consecutive ones per load (one vector when
    `vector`, which needs ne0 a multiple of unit), zeros outside; put(row, k in the tile, values)."""
    b = k.b
    per_row = tile.bk // unit
    if rows * per_row % tile.threads or per_row & (per_row - 1):
        raise ValueError(f"{tile}: {rows} x {per_row} loads of {unit} do not split over its threads")
    tid = k.tid(0)
    for s in range(rows * per_row // tile.threads):
        q = b.add(tid, k.i32(s * tile.threads))
        row, k_tile = b.lshr(q, k.i32(per_row.bit_length() - 1)), b.mul(b.and_(q, k.i32(per_row - 1)), k.i32(unit))
        valid, row_off = source(row)
        kk = b.add(k0, k_tile)
        if vector:
            inside = b.and_(valid, b.icmp_signed("<", kk, t.ne[0]))
            raw = load_raw(k, t.ptr, b.add(row_off, k.offset(t, k.select(inside, kk, k.i32(0)))), t.nb[0],
                           dtype, unit, True)
            values = [k.select(inside, v, ir.Constant(v.type, 0)) for v in raw]
        else:
            values = []
            for i in range(unit):
                ki = b.add(kk, k.i32(i))
                inside = b.and_(valid, b.icmp_signed("<", ki, t.ne[0]))
                v = load_raw(k, t.ptr, b.add(row_off, k.offset(t, k.select(inside, ki, k.i32(0)))), t.nb[0],
                             dtype, 1, False)[0]
                values.append(k.select(inside, v, ir.Constant(v.type, 0)))
        put(row, k_tile, values)


def _columns(k, tile: TileShape, by_id: bool):
    """(a's matrix as a byte offset, the column table of b, of d): shared i64 [bn] each, -1 past the
    last column. With `by_id` the block's expert is blockIdx.z and its columns are its pairs
    (table[2E + table[e] + j], j < table[E + e]); a block past them returns."""
    b, a, x, d = k.b, k.args["a"], k.args["b"], k.args["d"]
    tid = k.tid(0)
    col_b, col_d = k.shared(I64, tile.bn, "col_b"), k.shared(I64, tile.bn, "col_d")
    j = b.add(b.mul(k.ctaid(1), k.i32(tile.bn)), tid)
    if by_id:
        table, e = k.args["table"], k.ctaid(2)
        count = k.load(table, I32, b.mul(b.add(a.ne[2], e), k.i32(4)))
        with k.if_then(b.icmp_signed(">=", b.mul(k.ctaid(1), k.i32(tile.bn)), count)):
            b.ret_void()
        a_base = k.offset(a, None, None, e)
        valid = b.icmp_signed("<", j, count)
        entry = b.add(b.add(b.mul(a.ne[2], k.i32(2)), k.load(table, I32, b.mul(e, k.i32(4)))),
                      k.select(valid, j, k.i32(0)))
        pair = k.load(table, I32, b.mul(entry, k.i32(4)))
        slot, token = b.srem(pair, d.ne[1]), b.sdiv(pair, d.ne[1])
        off_b, off_d = k.offset(x, None, b.srem(slot, x.ne[1]), token), k.offset(d, None, slot, token)
    else:
        i12, i13 = b.srem(k.ctaid(2), d.ne[2]), b.sdiv(k.ctaid(2), d.ne[2])
        i02, i03 = b.sdiv(i12, b.sdiv(x.ne[2], a.ne[2])), b.sdiv(i13, b.sdiv(x.ne[3], a.ne[3]))
        a_base = k.offset(a, None, None, i02, i03)
        valid = b.icmp_signed("<", j, x.ne[1])
        off_b, off_d = k.offset(x, None, j, i12, i13), k.offset(d, None, j, i12, i13)
    with k.if_then(b.icmp_unsigned("<", tid, k.i32(tile.bn))):
        k.sstore(k.select(valid, off_b, k.i64(-1)), col_b, tid)
        k.sstore(k.select(valid, off_d, k.i64(-1)), col_d, tid)
    k.barrier()
    return a_base, col_b, col_d


def _sources(k, tile: TileShape, a_base, col_b) -> tuple[RowSource, RowSource]:
    """Where the tile's rows of a and columns of b start (a row past M reads row M - 1, a column
    past the last reads column 0; their values are masked)."""
    b, a = k.b, k.args["a"]
    m0 = b.mul(k.ctaid(0), k.i32(tile.bm))
    last = b.sub(a.ne[1], k.i32(1))

    def a_row(row):
        m = b.add(m0, row)
        valid = b.icmp_signed("<", m, a.ne[1])
        return valid, b.add(a_base, k.offset(a, None, k.select(valid, m, last)))

    def b_col(n):
        off = k.sload(col_b, n)
        valid = b.icmp_signed(">=", off, k.i64(0))
        return valid, k.select(valid, off, k.sload(col_b, k.i32(0)))

    return a_row, b_col


def _store(k, tile: TileShape, col_d, m_local, n_local, value) -> None:
    """d[column n_local of the table, row m0 + m_local] = value, inside d."""
    b, a, d = k.b, k.args["a"], k.args["d"]
    m = b.add(b.mul(k.ctaid(0), k.i32(tile.bm)), m_local)
    off = k.sload(col_d, n_local)
    with k.if_then(b.and_(b.icmp_signed("<", m, a.ne[1]), b.icmp_signed(">=", off, k.i64(0)))):
        k.store(value, d.ptr, b.add(off, k.offset(d, m)))


# -- the bodies ------------------------------------------------------------------------------------
def _pack(k, lo, hi):
    b = k.b
    return b.or_(b.zext(lo, I32), b.shl(b.zext(hi, I32), k.i32(16)))


def _mma_body(k, ta: str, tb: str, vdt: str, widths: tuple[int, int], by_id: bool) -> None:
    tile, b, a, x = MMA, k.b, k.args["a"], k.args["b"]
    a_base, col_b, col_d = _columns(k, tile, by_id)
    a_row, b_col = _sources(k, tile, a_base, col_b)
    sa, sb = k.shared(I32, tile.bm * MMA_WORDS, "a"), k.shared(I32, tile.bn * MMA_WORDS, "b")
    lane, warp = k.lane(), k.warp()
    group, tig = b.lshr(lane, k.i32(2)), b.and_(lane, k.i32(3))
    wm, wn = b.mul(b.and_(warp, k.i32(1)), k.i32(tile.bm // 2)), b.mul(b.lshr(warp, k.i32(1)), k.i32(tile.bn // 2))
    n_mt, n_nt = tile.bm // 2 // 16, tile.bn // 2 // 8
    acc = [[[k.var(F32, k.f32(0.0)) for _ in range(4)] for _ in range(n_nt)] for _ in range(n_mt)]

    def put(shared, convert):
        def store(row, k_tile, values):
            base = b.add(b.mul(row, k.i32(MMA_WORDS)), b.lshr(k_tile, k.i32(1)))
            halves = [convert(v) for v in values]
            for w in range(len(halves) // 2):
                k.sstore(_pack(k, halves[2 * w], halves[2 * w + 1]), shared, b.add(base, k.i32(w)))
        return store

    mma = k.mma_f16 if ta == "f16" else k.mma_bf16
    with k.loop(k.i32(0), a.ne[0], tile.bk) as k0:
        _stage(k, tile, tile.bm, max(widths[0], 2), widths[0] > 1, k0, a, ta, a_row, put(sa, lambda v: v))
        _stage(k, tile, tile.bn, max(widths[1], 2), widths[1] > 1, k0, x, tb, b_col,
               put(sb, lambda v: _to_bits16(k, v, tb, vdt)))
        k.barrier()
        for ks in range(tile.bk // 16):
            col = b.add(tig, k.i32(8 * ks))
            frag_a = [[k.sload(sa, b.add(b.mul(b.add(wm, k.i32(16 * mt + 8 * (r & 1))), k.i32(MMA_WORDS)),
                                         b.add(b.mul(group, k.i32(MMA_WORDS)), b.add(col, k.i32(4 * (r >> 1))))))
                       for r in range(4)] for mt in range(n_mt)]
            frag_b = [[k.sload(sb, b.add(b.mul(b.add(b.add(wn, k.i32(8 * nt)), group), k.i32(MMA_WORDS)),
                                         b.add(col, k.i32(4 * r))))
                       for r in range(2)] for nt in range(n_nt)]
            for mt in range(n_mt):
                for nt in range(n_nt):
                    out = mma(frag_a[mt], frag_b[nt], [k.get(v, F32) for v in acc[mt][nt]])
                    for v, o in zip(acc[mt][nt], out, strict=True):
                        k.set(v, o)
        k.barrier()
    for mt in range(n_mt):
        for nt in range(n_nt):
            for j in range(4):  # d_j of the fragment: row group + 8 (j >= 2), column 2 tig + (j & 1)
                m = b.add(wm, b.add(group, k.i32(16 * mt + 8 * (j >= 2))))
                n = b.add(wn, b.add(b.mul(tig, k.i32(2)), k.i32(8 * nt + (j & 1))))
                _store(k, tile, col_d, m, n, k.get(acc[mt][nt][j], F32))


def _fma_body(k, ta: str, tb: str, vdt: str, widths: tuple[int, int], by_id: bool) -> None:
    tile, b, a, x = FMA, k.b, k.args["a"], k.args["b"]
    a_base, col_b, col_d = _columns(k, tile, by_id)
    a_row, b_col = _sources(k, tile, a_base, col_b)
    stride_a, stride_b = tile.bm + FMA_PAD, tile.bn + FMA_PAD
    sa, sb = k.shared(F32, tile.bk * stride_a, "a"), k.shared(F32, tile.bk * stride_b, "b")
    across = tile.bm // FMA_REG  # threads along m
    tx, ty = b.and_(k.tid(0), k.i32(across - 1)), b.lshr(k.tid(0), k.i32(across.bit_length() - 1))
    acc = [[k.var(F32, k.f32(0.0)) for _ in range(FMA_REG)] for _ in range(FMA_REG)]

    def put(shared, stride, convert):
        def store(row, k_tile, values):
            for i, v in enumerate(values):
                k.sstore(convert(v), shared, b.add(b.mul(b.add(k_tile, k.i32(i)), k.i32(stride)), row))
        return store

    with k.loop(k.i32(0), a.ne[0], tile.bk) as k0:
        _stage(k, tile, tile.bm, widths[0], widths[0] > 1, k0, a, ta, a_row, put(sa, stride_a, lambda v: v))
        _stage(k, tile, tile.bn, widths[1], widths[1] > 1, k0, x, tb, b_col,
               put(sb, stride_b, lambda v: to_vec_dot(k, v, tb, vdt)))
        k.barrier()
        for kk in range(tile.bk):
            av = [k.sload(sa, b.add(tx, k.i32(kk * stride_a + across * i))) for i in range(FMA_REG)]
            bv = [k.sload(sb, b.add(ty, k.i32(kk * stride_b + across * j))) for j in range(FMA_REG)]
            for i in range(FMA_REG):
                for j in range(FMA_REG):
                    k.set(acc[i][j], k.fma(av[i], bv[j], k.get(acc[i][j], F32)))
        k.barrier()
    for i in range(FMA_REG):
        for j in range(FMA_REG):
            m, n = b.add(tx, k.i32(across * i)), b.add(ty, k.i32(across * j))
            _store(k, tile, col_d, m, n, k.get(acc[i][j], F32))


def mul_mm_kernel(tile: TileShape, ta: str, tb: str, vdt: str, widths: tuple[int, int], by_id: bool) -> kir.Kernel:
    """The tiled kernel for weights `ta`, b `tb` (rounded to `vdt`), staging loads of widths
    (elements of a, of b; 1: element by element). Grid: (tiles of rows, tiles of columns, batches
    of d), or with `by_id` (tiles of rows, tiles of pairs, experts) and the pairs table."""
    params = (tensor("a"), tensor("b"), tensor("d"), *((scalar("table", "p"),) if by_id else ()))
    body = _mma_body if tile.kind == "mma" else _fma_body
    key = (ta, tb, vdt, widths, by_id)
    return kir.define(f"mul_mm_{tile.kind}", key, params, tile.threads,
                      lambda k: body(k, ta, tb, vdt, widths, by_id))
