"""flash_attn_ext as ggml's CPU backend computes it, in its three forms (ir/interp_attention.py
is the reference, in the same numerics profile).

- Fewer than 64 query rows, or quantized / mixed K and V: online softmax cell by cell
  (ggml_compute_forward_flash_attn_ext_f16_one_chunk). q is rounded to K's type for the scores
  (ggml_vec_dot_f16/f32 in the profile's lanes; a quantized K's scores come precomputed by the
  quantized matmul, which quantizes q and dots as ggml's kq_vec_dot does); the score is
  fma(dot, scale, slope*mask); cells whose mask is -inf are skipped; M and S are updated with
  glibc's expf; V accumulates in f16 when V is f16 (vec_scale_f16 / vec_mad_f16). Each
  (token, head) row takes its live cells in blocks, each in three passes (scores, then the softmax
  steps in order, then the accumulator): the same operations in the same order per row.
- 64 rows or more of f16/f32 K = V: ggml's tiled kernel (ggml_compute_forward_flash_attn_ext_tiled):
  64-query x 64-cell tiles, q in f32, scores and V products as sequential fma chains (simd_gemm),
  each tile's softmax with ggml_vec_soft_max_f32 (the profile's vectors), all in f32.
- One query row of f16/f32 K = V over 512+ cells: the cells are cut into one chunk per thread,
  each thread's partial (M, S, VKQ) written to a shared buffer, and FlashAttnReduce combines them
  in chunk order (ggml_flash_attn_ext_reduce_partials) after the barrier.

y[s, t, h, :] = VKQ / S (ggml's permuted output); sinks join at the end (chunk 0's partial).
"""

from __future__ import annotations

from dataclasses import dataclass

import llvmlite.ir as ir

from llamir.backends.llvm import vmath
from llamir.backends.llvm.emit import F32, F64, I1, Emitter, storage_type, vec
from llamir.backends.llvm.kernels.matmul_float import vec_dot_rows
from llamir.backends.llvm.kernels.rows import _const_table
from llamir.backends.llvm.plan import Kernel, Ref

LANES = 16         # width of element-wise row updates (any width gives the same bits)
TILE = 64          # GGML_FA_TILE_Q and GGML_FA_TILE_KV
SPLIT_KV_MIN = 512 # cells from which a one-row decode splits them over the threads
BLOCK = 256        # cells per block of the row path's passes
SCORE_GROUP = 4    # K rows per vec_dot pass of the row path
SCORE_AHEAD = 16   # live cells the row path's score pass prefetches K ahead


@dataclass(frozen=True)
class _RowBuffers:
    """A thread's scratch on the row path: the row's q (K's vec_dot type) and accumulator, a
    quantized V row as f32, and per block the live cells with their scores and (vs, ms)."""

    q: ir.Value
    acc: ir.Value
    vq: ir.Value
    scores: ir.Value
    cells: ir.Value
    vs: ir.Value
    ms: ir.Value


def chunked(em: Emitter, n, body) -> None:
    """body(i, 16) for whole 16-lane chunks of range(n), then body(i, 0) for the tail."""
    chunks = em.mul(em.div(n, LANES), LANES)
    with em.loop(0, chunks, LANES, name="v16") as i:
        body(i, LANES)
    with em.loop(chunks, n, name="v1") as i:
        body(i, 0)


def _size(dt: str) -> int:
    return {"f32": 4, "f16": 2, "bf16": 2}[dt]


def _quantized(dt: str) -> bool:
    return dt not in ("f32", "f16", "bf16")


def _dequant_row(em: Emitter, dtype: str, src, dst, n) -> None:
    """dst[0:n] = the f32 values of a quantized row (ggml's dequantize_row_*)."""
    from llamir.backends.llvm.kernels.quant import dequant_value
    from llamir.ir import dtype_named

    dt = dtype_named(dtype)
    with em.loop(0, em.div(n, dt.block_size), name="dq") as k:
        blk = em.gep(src, em.mul(k, dt.type_size))
        with em.loop(0, dt.block_size, name="dqj") as j:
            em.store(dequant_value(em, dtype, blk, j), dst, em.mul(em.add(em.mul(k, dt.block_size), j), 4))


def _vload(em: Emitter, ptr, i, dt: str, lanes: int):
    ty = storage_type(dt) if not lanes else vec(storage_type(dt), lanes)
    return em.to_f32(em.load(ty, ptr, em.mul(i, _size(dt))), dt)


def _vstore(em: Emitter, value, ptr, i, dt: str) -> None:
    em.store(em.from_f32(value, dt), ptr, em.mul(i, _size(dt)))


def scratch_bytes(H, DK, DV) -> tuple:
    """Per-thread scratch: (row path bytes, tiled path bytes) as expressions of the head sizes."""
    from llamir.backends.llvm import expr as E

    rows = E.add(E.mul(4, E.add(DK, E.mul(DV, 2))), 16 * BLOCK)
    tiled = E.mul(4, E.add(E.mul(TILE, E.add(E.mul(DK, 2), E.mul(DV, 3))), TILE * TILE * 2 + 2 * TILE))
    return rows, tiled


class FlashAttn(Kernel):
    """y [S, T, H, dv] from q [S, H, T, dk], k [S, Hkv, n, dk], v [S, Hkv, n, dv], mask, sinks;
    `scores` [S, H, T, n] f32 (the raw dots of a quantized K), `partials` (the split-KV buffer)."""

    # K's and V's strides (a cache's: they follow its size) only offset rows: every context size
    # shares one function
    runtime_ints = (9, 10, 11, 13, 14, 15)

    def __init__(self, y: Ref, q: Ref, k: Ref, v: Ref, mask: Ref | None, sinks: Ref | None, scores: Ref | None,
                 split: bool, scale: float, softcap: float, alibi: tuple[float, ...] | None):
        self.dtypes = (q.dtype.name, k.dtype.name, v.dtype.name, mask.dtype.name if mask is not None else "")
        self.scale = float(scale / softcap) if softcap else float(scale)
        self.softcap = float(softcap)
        self.alibi = alibi
        self.has_mask, self.has_sinks, self.has_scores, self.split = mask is not None, sinks is not None, \
            scores is not None, split
        ints = list(q.shape) + list(q.strides[:3]) + list(k.shape[1:3]) + list(k.strides[:3]) \
            + [v.shape[3]] + list(v.strides[:3]) + list(y.strides[:3])
        if mask is not None:
            m = mask.padded()
            ints += list(m.shape[:2]) + list(m.strides)
        if scores is not None:
            ints += list(scores.strides[:3])
        self.n_ptrs = 5 + int(self.has_mask) + int(self.has_sinks) + int(self.has_scores) + int(split)
        super().__init__(ints)

    def config(self) -> tuple:
        return (self.dtypes, self.scale, self.softcap, self.alibi, self.has_mask, self.has_sinks, self.has_scores,
                self.split)

    def emit(self, em: Emitter, a) -> None:
        ints = a.ints
        d = {"S": ints[0], "H": ints[1], "T": ints[2], "DK": ints[3], "qs": ints[4:7], "hkv": ints[7],
             "n_kv": ints[8], "ks": ints[9:12], "DV": ints[12], "vs": ints[13:16], "ys": ints[16:19]}
        at = 19
        if self.has_mask:
            d["msh"], d["mst"] = ints[at:at + 2], ints[at + 2:at + 6]
            at += 6
        if self.has_scores:
            d["ss"] = ints[at:at + 3]
        ptrs = iter(a.ptrs)
        self.p = {name: next(ptrs) for name in ("y", "q", "k", "v", "scratch")}
        for name, present in (("mask", self.has_mask), ("sinks", self.has_sinks), ("scores", self.has_scores),
                              ("partials", self.split)):
            self.p[name] = next(ptrs) if present else None
        self.d = d
        _, k_dt, v_dt, _ = self.dtypes
        if not (k_dt == v_dt and k_dt in ("f16", "f32")):
            self._rows(em, a)
            return
        with em.if_else(split_kv(em, d)) as (split, other):
            with split:
                self._split_partials(em, a)
            with other:
                with em.if_else(em.icmp(">=", d["T"], TILE)) as (then, otherwise):
                    with then:
                        self._tiled(em, a)
                    with otherwise:
                        self._rows(em, a)

    # -- helpers --------------------------------------------------------------------------------
    def _slope(self, em: Emitter, h):
        if self.alibi is None:
            return em.f32(1.0)
        return em.load(F32, _const_table(em, "alibi", self.alibi), em.mul(h, 4))

    def _mask_row(self, em: Emitter, s, h, t):
        d = self.d
        msh, mst = d["msh"], d["mst"]
        off = em.offset((em.rem(s, msh[0]), em.rem(h, msh[1]), t), mst[:3])
        return em.gep(self.p["mask"], off)

    def _mask_value(self, em: Emitter, mrow, c, slope):
        m_dt = self.dtypes[3]
        x = em.to_f32(em.load(storage_type(m_dt), mrow, em.mul(c, self.d["mst"][3])), m_dt)
        return em.b.fmul(slope, x)

    def _kv_row(self, em: Emitter, which: str, s, h, c):
        d = self.d
        st = d["ks"] if which == "k" else d["vs"]
        kh = em.div(h, em.div(d["H"], d["hkv"]))
        return em.gep(self.p[which], em.offset((s, kh, c), st[:3]))

    def _sinks(self, em: Emitter, M, S, h, fused: bool):
        """The sink logit joins after the cells: (M, S, the factor for the accumulator or None).
        S*ms + vs is one fma in the tiled kernel, two roundings in one_chunk (as GCC compiled them)."""
        b = em.b
        if self.p["sinks"] is None:
            return M, S, None
        sk = em.load(F32, self.p["sinks"], em.mul(h, 4))
        big = b.fcmp_ordered(">", sk, M)
        ms = b.select(big, vmath.expf(em, b.fsub(M, sk)), em.f32(1.0))
        vsk = b.select(big, em.f32(1.0), vmath.expf(em, b.fsub(sk, M)))
        S = em.fma(S, ms, vsk) if fused else b.fadd(b.fmul(S, ms), vsk)
        return b.select(big, sk, M), S, ms

    def _finish_row(self, em: Emitter, acc_ptr, acc_dt: str, M, S, s, t, h, fused_sinks: bool) -> None:
        """Sinks, 1/S, store y[s, t, h, :] (f32)."""
        b, d = em.b, self.d
        _, total, ms = self._sinks(em, M, S, h, fused_sinks)
        inv = b.select(b.fcmp_ordered("==", total, em.f32(0.0)), em.f32(0.0), b.fdiv(em.f32(1.0), total))
        ys = d["ys"]
        yrow = em.gep(self.p["y"], em.offset((s, t, h), ys[:3]))

        def body(i, lanes):
            x = _vload(em, acc_ptr, i, acc_dt, lanes)
            if ms is not None:
                x = b.fmul(x, em.splat(ms, lanes) if lanes else ms)
            _vstore(em, b.fmul(x, em.splat(inv, lanes) if lanes else inv), yrow, i, "f32")

        chunked(em, d["DV"], body)

    # -- fewer than 64 rows: one head's row at a time, a block of cells in passes -----------------
    # ggml's one_chunk walks the cells of one (token, head) row in order: score, then M, S and the
    # accumulator. The same per-cell operations run here in the same order per row, split by kind
    # over a block of cells so that no pass waits on another's latency: the block's live cells
    # (mask not -inf) into a list, their scores (four K rows per vec_dot pass), M, S and each live
    # cell's (vs, ms) in order (the expf calls, while V and the next head's K are prefetched), then
    # the accumulator over them, held in registers (no calls in that loop). A thread first
    # prefetches the K and V rows of all its heads' live cells at once: the cache of a decode
    # comes from memory (the weights streamed since evict it), and per head its rows are strided.
    def _buffers(self, em: Emitter) -> _RowBuffers:
        d = self.d
        DK, DV = d["DK"], d["DV"]
        sc = self.p["scratch"]
        q = sc                                              # [DK] as qv_dt
        acc = em.gep(q, em.mul(DK, 4))                      # [DV] as acc_dt
        vq = em.gep(acc, em.mul(DV, 4))                     # [DV] f32
        scores = em.gep(vq, em.mul(DV, 4))                  # [BLOCK] f32
        cells = em.gep(scores, BLOCK * 4)                   # [BLOCK] i32
        vs = em.gep(cells, BLOCK * 4)                       # [BLOCK] f32
        ms = em.gep(vs, BLOCK * 4)                          # [BLOCK] f32
        return _RowBuffers(q, acc, vq, scores, cells, vs, ms)

    def _acc_dt(self) -> str:
        return "f16" if self.dtypes[2] == "f16" else "f32"

    def _qv_dt(self) -> str:
        return "f16" if self.dtypes[1] == "f16" else "f32"

    def _live(self, em: Emitter, s, t, h, c):
        """(the cell's mask term slope*mask, whether it is live: not -inf)."""
        if self.p["mask"] is None:
            return em.f32(0.0), ir.Constant(I1, 1)
        mv = self._mask_value(em, self._mask_row(em, s, h, t), c, self._slope(em, h))
        return mv, em.b.fcmp_ordered("!=", mv, em.f32(float("-inf")))

    def _prefetch_row(self, em: Emitter, which: str, s, h, c, into_l1: bool) -> None:
        """Prefetch the lines of the K or V row of head h at cell c (past the cache: no fault)."""
        dt = self.dtypes[1 if which == "k" else 2]
        n = self.d["DK" if which == "k" else "DV"]
        if not isinstance(n, int) or _quantized(dt):
            return
        row = self._kv_row(em, which, s, h, c)
        for line in range(0, n * _size(dt), 64):
            em.prefetch(row, line, into_l1=into_l1)

    def _prefetch_cells(self, em: Emitter, s, t, h0, h1, c0, c1) -> None:
        """Before the rows of heads [h0, h1) of token (s, t): prefetch the K and V rows of their
        KV heads at the live cells of [c0, c1) (head h0's mask) into L2, all at once, so that the
        cache, read per head at a stride, streams at the memory's rate instead of its latency."""
        d = self.d
        group = em.div(d["H"], d["hkv"])
        kv0, kv1 = em.div(h0, group), em.cdiv(h1, group)
        with em.loop(c0, c1, name="pfcell") as c:
            _, live = self._live(em, s, t, h0, c)
            with em.if_(live):
                with em.loop(kv0, kv1, name="pfhead") as kh:
                    for which in ("k", "v"):
                        self._prefetch_row(em, which, s, em.mul(kh, group), c, into_l1=False)

    def _head(self, em: Emitter, s, t, h, c0, c1, bufs):
        """The (s, t, h) row over cells [c0, c1): returns (M, S); its accumulator is in bufs.acc."""
        d = self.d
        DK, DV = d["DK"], d["DV"]
        qv_dt, acc_dt = self._qv_dt(), self._acc_dt()
        if not self.has_scores:
            qrow = em.gep(self.p["q"], em.offset((s, h, t), d["qs"][:3]))
            chunked(em, DK, lambda i, lanes: _vstore(em, _vload(em, qrow, i, "f32", lanes), bufs.q, i, qv_dt))
        zero = ir.Constant(vec(F32, LANES), [0.0] * LANES)
        chunked(em, DV, lambda i, lanes: _vstore(em, zero if lanes else em.f32(0.0), bufs.acc, i, acc_dt))
        M = em.var(F32, em.f32(float("-inf")))
        S = em.var(F32, em.f32(0.0))
        with em.loop(c0, c1, BLOCK, name="block") as cb:
            n_live = self._block_live(em, s, t, h, cb, em.min(em.add(cb, BLOCK), c1), bufs)
            self._block_scores(em, s, t, h, n_live, bufs)
            self._block_weights(em, s, h, n_live, M, S, bufs)
            self._block_values(em, s, h, n_live, bufs)
        return em.get(M), em.get(S)

    def _block_live(self, em: Emitter, s, t, h, cb, ce, bufs) -> ir.Value:
        """cells[0:n] = the block's live cells in order (mask term not -inf); returns n."""
        n = em.var(ir.IntType(64), em.i64(0))
        with em.loop(cb, ce, name="live") as c:    # branch-free: every cell written, the live ones kept
            _, live = self._live(em, s, t, h, c)
            at = em.get(n)
            em.store(em.b.trunc(c, ir.IntType(32)), bufs.cells, em.mul(at, 4))
            em.set(n, em.add(at, em.b.zext(live, ir.IntType(64))))
        return em.get(n)

    @staticmethod
    def _cell(em: Emitter, bufs: _RowBuffers, j):
        """The j-th live cell of the block."""
        return em.b.zext(em.load(ir.IntType(32), bufs.cells, em.mul(j, 4)), ir.IntType(64))

    def _block_scores(self, em: Emitter, s, t, h, n_live, bufs) -> None:
        """scores[j] = fma(dot, scale, mv) (or the softcap's) of the j-th live cell, four cells a
        vec_dot pass (past the last one it stands in), K rows prefetched a few cells on."""
        b, d = em.b, self.d
        k_dt, qv_dt = self.dtypes[1], self._qv_dt()
        last = em.sub(n_live, 1)
        with em.loop(0, n_live, SCORE_GROUP, name="sgroup") as j0:
            group = [self._cell(em, bufs, em.min(em.add(j0, j), last)) for j in range(SCORE_GROUP)]
            if not self.has_scores:
                for j in range(SCORE_GROUP):
                    ahead = self._cell(em, bufs, em.min(em.add(j0, SCORE_AHEAD + j), last))
                    self._prefetch_row(em, "k", s, h, ahead, into_l1=True)
                rows = [self._kv_row(em, "k", s, h, cell) for cell in group]
                dots = vec_dot_rows(em, rows, k_dt, bufs.q, qv_dt, d["DK"], _size(k_dt), _size(qv_dt))
            else:
                dots = [em.load(F32, self.p["scores"], em.add(em.offset((s, h, t), d["ss"]), em.mul(cell, 4)))
                        for cell in group]
            for j, (dot, cell) in enumerate(zip(dots, group)):
                mv, _ = self._live(em, s, t, h, cell)
                if self.softcap:
                    x = b.fmul(em.f32(self.softcap), vmath.libm(em, "tanhf", b.fmul(dot, em.f32(self.scale))))
                    score = b.fadd(x, mv)
                else:   # s = s*scale; s += mv: one fma, as GCC compiled it
                    score = em.fma(dot, em.f32(self.scale), mv)
                em.store(score, bufs.scores, em.mul(em.add(j0, j), 4))

    def _block_weights(self, em: Emitter, s, h, n_live, M, S, bufs) -> None:
        """one_chunk's softmax steps over the live cells in order: a new maximum gives
        ms = expf(Mold - M) (vs = 1), any other score vs = expf(s - M); S = S*ms + vs. Writes
        each live cell's (vs, ms)."""
        b = em.b
        with em.loop(0, n_live, name="cell") as j:
            # while expf works: the V row of the next pass and the next head's K, into L2
            cell = self._cell(em, bufs, j)
            self._prefetch_row(em, "v", s, h, cell, into_l1=False)
            if not self.has_scores:
                self._prefetch_row(em, "k", s, em.add(h, 1), cell, into_l1=False)
            score = em.load(F32, bufs.scores, em.mul(j, 4))
            m_old = em.get(M)
            ms = em.var(F32, em.f32(1.0))
            vs = em.var(F32, em.f32(1.0))
            with em.if_else(b.fcmp_ordered(">", score, m_old)) as (then, otherwise):
                with then:
                    em.set(M, score)
                    em.set(ms, vmath.expf(em, b.fsub(m_old, score)))
                with otherwise:
                    em.set(vs, vmath.expf(em, b.fsub(score, m_old)))
            em.set(S, em.fma(em.get(S), em.get(ms), em.get(vs)))
            em.store(em.get(vs), bufs.vs, em.mul(j, 4))
            em.store(em.get(ms), bufs.ms, em.mul(j, 4))

    def _block_values(self, em: Emitter, s, h, n_live, bufs) -> None:
        """acc = acc*ms on a new maximum (vec_scale), then acc = acc + v*vs (vec_mad), cell by
        live cell, each rounded to the accumulator's type. A static head size keeps the
        accumulator in registers, as many 16-lane vectors per pass over the cells as they hold."""
        b, d = em.b, self.d
        DV = d["DV"]
        acc_dt, v_dt = self._acc_dt(), self.dtypes[2]

        def cell_of(j):
            return self._cell(em, bufs, j), em.load(F32, bufs.vs, em.mul(j, 4)), em.load(F32, bufs.ms, em.mul(j, 4))

        def rounded(x):
            return em.to_f32(em.from_f32(x, acc_dt), acc_dt) if acc_dt != "f32" else x

        def rescale(acc, ms, lanes: int):
            return rounded(b.fmul(acc, em.splat(ms, lanes) if lanes else ms))

        def mad(acc, v, vs, lanes: int):
            return rounded(em.fma(v, em.splat(vs, lanes) if lanes else vs, acc))

        if _quantized(v_dt) or not isinstance(DV, int):
            # the accumulator stays in memory; a quantized V row is dequantized once per cell
            with em.loop(0, n_live, name="vcell") as j:
                c, vs, ms = cell_of(j)
                vrow, vdt = self._kv_row(em, "v", s, h, c), v_dt
                if _quantized(v_dt):
                    _dequant_row(em, v_dt, vrow, bufs.vq, DV)
                    vrow, vdt = bufs.vq, "f32"
                new_max = b.fcmp_unordered("!=", ms, em.f32(1.0))

                def body(i, lanes, vrow=vrow, vdt=vdt, vs=vs, ms=ms, new_max=new_max):
                    acc = _vload(em, bufs.acc, i, acc_dt, lanes)
                    acc = b.select(new_max, rescale(acc, ms, lanes), acc)
                    _vstore(em, mad(acc, _vload(em, vrow, i, vdt, lanes), vs, lanes), bufs.acc, i, acc_dt)

                chunked(em, DV, body)
            return
        # (offset, lanes) pieces of the row: 16-lane vectors, then the rest as one vector
        pieces = [(i, LANES) for i in range(0, DV - DV % LANES, LANES)] + ([(DV - DV % LANES, DV % LANES)]
                                                                          if DV % LANES else [])
        per_pass = 8 if em.target.avx512 else 4
        for p0 in range(0, len(pieces), per_pass):
            group = pieces[p0:p0 + per_pass]
            accs = [em.var(vec(F32, lanes), _vload(em, bufs.acc, i, acc_dt, lanes)) for i, lanes in group]
            with em.loop(0, n_live, name="vcell") as j:
                c, vs, ms = cell_of(j)
                vrow = self._kv_row(em, "v", s, h, c)
                with em.if_(b.fcmp_unordered("!=", ms, em.f32(1.0))):    # a new maximum (ms = 1 leaves acc)
                    for acc, (_, lanes) in zip(accs, group):
                        em.set(acc, rescale(em.get(acc), ms, lanes))
                for acc, (i, lanes) in zip(accs, group):
                    em.set(acc, mad(em.get(acc), _vload(em, vrow, i, v_dt, lanes), vs, lanes))
            for acc, (i, _) in zip(accs, group):
                _vstore(em, em.get(acc), bufs.acc, i, acc_dt)

    def _rows(self, em: Emitter, a) -> None:
        b, d = em.b, self.d
        S_, H, T = d["S"], d["H"], d["T"]
        acc_dt = self._acc_dt()
        # rows ordered (s, t, h): a thread's range is whole or partial head groups of tokens
        r0, r1 = em.split(em.mul(em.mul(S_, T), H), a.ith, a.nth)
        bufs = self._buffers(em)
        with em.loop(r0, r1, name="row") as r:
            h = em.rem(r, H)
            t = em.rem(em.div(r, H), T)
            s = em.div(em.div(r, H), T)
            # the cells of the thread's first token, for its heads here and, where the range goes on
            # into the next token, the heads before (later tokens find the same rows cached)
            first = b.or_(em.icmp("==", r, r0), b.and_(em.icmp("==", h, 0), em.icmp("<", r, em.add(r0, H))))
            with em.if_(first):
                self._prefetch_cells(em, s, t, h, em.min(H, em.add(h, em.sub(r1, r))), 0, d["n_kv"])
            M, S = self._head(em, s, t, h, 0, d["n_kv"], bufs)
            self._finish_row(em, bufs.acc, acc_dt, M, S, s, t, h, fused_sinks=False)

    def _split_partials(self, em: Emitter, a) -> None:
        """This thread's chunk of the cells for every head of the one query row: (M, S, VKQ as f32)
        into partials[ith][h], sinks in chunk 0 (ggml's one_chunk with partials)."""
        b, d = em.b, self.d
        H, DV = d["H"], d["DV"]
        acc_dt = self._acc_dt()
        chunk = em.cdiv(d["n_kv"], a.nth)
        c0 = em.mul(a.ith, chunk)
        c1 = em.min(em.add(c0, chunk), d["n_kv"])
        bufs = self._buffers(em)
        zero = em.i64(0)
        self._prefetch_cells(em, zero, zero, zero, H, c0, c1)
        with em.loop(0, H, name="part") as h:
            M, S = self._head(em, zero, zero, h, c0, c1, bufs)
            ms = None
            if self.p["sinks"] is not None:
                first = em.icmp("==", a.ith, 0)
                M2, S2, ms2 = self._sinks(em, M, S, h, fused=False)
                M, S, ms = b.select(first, M2, M), b.select(first, S2, S), b.select(first, ms2, em.f32(1.0))
            part = em.gep(self.p["partials"], em.mul(em.add(em.mul(a.ith, H), h), em.mul(em.add(DV, 2), 4)))
            em.store(M, part, 0)
            em.store(S, part, 4)

            def body(i, lanes, part=part, ms=ms):
                x = _vload(em, bufs.acc, i, acc_dt, lanes)
                if ms is not None:
                    x = b.fmul(x, em.splat(ms, lanes) if lanes else ms)
                _vstore(em, x, em.gep(part, 8), i, "f32")

            chunked(em, DV, body)

    # -- 64 rows or more: ggml's tiles ------------------------------------------------------------------------
    def _tiled(self, em: Emitter, a) -> None:
        d = self.d
        S_, H, T, DK, DV = d["S"], d["H"], d["T"], d["DK"], d["DV"]
        kv_dt = self.dtypes[1]
        q_tiles = em.cdiv(T, TILE)
        u0, u1 = em.split(em.mul(em.mul(S_, H), q_tiles), a.ith, a.nth)
        sc = self.p["scratch"]
        Q = sc                                                     # [TILE][DK]
        Kt = em.gep(Q, em.mul(TILE * 4, DK))                       # [DK][TILE] (transposed)
        KQ = em.gep(Kt, em.mul(TILE * 4, DK))                      # [TILE][TILE]
        MK = em.gep(KQ, TILE * TILE * 4)                           # mask [TILE][TILE]
        V32 = em.gep(MK, TILE * TILE * 4)                          # [TILE][DV]
        VKQ = em.gep(V32, em.mul(TILE * 4, DV))                    # [TILE][DV]
        Mb = em.gep(VKQ, em.mul(TILE * 4, DV))                     # M[TILE]
        Sb = em.gep(Mb, TILE * 4)                                  # S[TILE]
        with em.loop(u0, u1, name="unit") as u:
            qt = em.rem(u, q_tiles)
            h = em.rem(em.div(u, q_tiles), H)
            s = em.div(em.div(u, q_tiles), H)
            t0 = em.mul(qt, TILE)
            rows = em.min(TILE, em.sub(T, t0))
            slope = self._slope(em, h)
            with em.loop(0, rows, name="qload") as i:
                qrow = em.gep(self.p["q"], em.offset((s, h, em.add(t0, i)), d["qs"][:3]))
                dst = em.gep(Q, em.mul(em.mul(i, DK), 4))
                chunked(em, DK, lambda j, lanes, qrow=qrow, dst=dst: _vstore(
                    em, _vload(em, qrow, j, "f32", lanes), dst, j, "f32"))
                vrow = em.gep(VKQ, em.mul(em.mul(i, DV), 4))
                zero = ir.Constant(vec(F32, LANES), [0.0] * LANES)
                chunked(em, DV, lambda j, lanes, vrow=vrow: _vstore(em, zero if lanes else em.f32(0.0), vrow, j, "f32"))
                em.store(em.f32(float("-inf")), Mb, em.mul(i, 4))
                em.store(em.f32(0.0), Sb, em.mul(i, 4))
            with em.loop(0, d["n_kv"], TILE, name="kvt") as c0:
                kvt = em.min(TILE, em.sub(d["n_kv"], c0))
                live = self._tile_mask(em, MK, s, h, t0, rows, c0, kvt, slope)
                with em.if_(live):
                    self._tile(em, s, h, c0, kvt, rows, Q, Kt, KQ, MK, V32, VKQ, Mb, Sb, kv_dt)
            with em.loop(0, rows, name="out") as i:
                self._finish_row(em, em.gep(VKQ, em.mul(em.mul(i, DV), 4)), "f32", em.load(F32, Mb, em.mul(i, 4)),
                                 em.load(F32, Sb, em.mul(i, 4)), s, em.add(t0, i), h, fused_sinks=True)

    def _tile_mask(self, em: Emitter, MK, s, h, t0, rows, c0, kvt, slope) -> ir.Value:
        """mask32 = slope*mask for the tile (-inf past the last cell); whether any is live."""
        b = em.b
        if self.p["mask"] is None:
            return ir.Constant(I1, 1)
        live = em.var(I1, ir.Constant(I1, 0))
        ninf = em.f32(float("-inf"))
        m_dt = self.dtypes[3]
        vt = vec(F32, LANES)
        for_vec = isinstance(self.d["mst"][3], int) and self.d["mst"][3] == _size(m_dt)
        with em.loop(0, rows, name="mrow") as i:
            mrow = em.gep(self._mask_row(em, s, h, em.add(t0, i)), em.mul(c0, self.d["mst"][3]))
            for r in range(TILE // LANES):
                cols = ir.Constant(vec(ir.IntType(32), LANES), list(range(r * LANES, (r + 1) * LANES)))
                inside = b.icmp_signed("<", cols, em.splat(b.trunc(em.i64(kvt), ir.IntType(32)), LANES))
                if for_vec:
                    raw = em.masked_load(vec(storage_type(m_dt), LANES), mrow, r * LANES * _size(m_dt), inside)
                    value = b.fmul(em.to_f32(raw, m_dt), em.splat(slope, LANES))
                else:
                    value = ir.Constant(vt, None)
                    for j in range(LANES):
                        col = em.min(r * LANES + j, em.sub(kvt, 1))
                        x = self._mask_value(em, mrow, col, slope)
                        value = b.insert_element(value, x, ir.Constant(ir.IntType(32), j))
                value = b.select(inside, value, em.splat(ninf, LANES))
                em.store(value, MK, em.mul(em.add(em.mul(i, TILE), r * LANES), 4))
                any_live = b.fcmp_ordered("!=", value, em.splat(ninf, LANES))
                bits = b.bitcast(any_live, ir.IntType(LANES))
                em.set(live, b.or_(em.get(live), b.icmp_unsigned("!=", bits, ir.Constant(ir.IntType(LANES), 0))))
        return em.get(live)

    def _tile(self, em: Emitter, s, h, c0, kvt, rows, Q, Kt, KQ, MK, V32, VKQ, Mb, Sb, kv_dt: str) -> None:
        b, d = em.b, self.d
        DK, DV = d["DK"], d["DV"]
        vt = vec(F32, LANES)
        zero = ir.Constant(vt, [0.0] * LANES)
        ninf = em.f32(float("-inf"))
        # K tile, transposed to [DK][TILE] f32 (cells past kvt keep stale values; their scores are -inf)
        with em.loop(0, kvt, name="kt") as j:
            krow = self._kv_row(em, "k", s, h, em.add(c0, j))
            with em.loop(0, DK, name="kd") as k:
                em.store(_vload(em, krow, k, kv_dt, 0), Kt, em.mul(em.add(em.mul(k, TILE), j), 4))
        # KQ[i][:] = sum_k Q[i][k] * Kt[k][:]  (simd_gemm: one fma chain per score, k in order),
        # a block of query rows x score vectors at a time, as many as the registers hold, so each
        # Kt vector is loaded once per block of rows
        nvec = TILE // LANES
        kq_group, kq_cols = register_block(em, nvec)

        def kq_rows(i0, n_rows: int) -> None:
            for r0 in range(0, nvec, kq_cols):
                kq_block(i0, n_rows, range(r0, r0 + kq_cols))

        def kq_block(i0, n_rows: int, block: range) -> None:
            accs = [{r: em.var(vt, zero) for r in block} for _ in range(n_rows)]
            with em.loop(0, DK, name="k") as k:
                kv = {r: em.load(vt, Kt, em.mul(em.add(em.mul(k, TILE), r * LANES), 4)) for r in block}
                for ii in range(n_rows):
                    qv = em.splat(em.load(F32, Q, em.mul(em.add(em.mul(em.add(i0, ii), DK), k), 4)), LANES)
                    for r in block:
                        em.set(accs[ii][r], em.fma(kv[r], qv, em.get(accs[ii][r])))
            for ii in range(n_rows):
                for r in block:
                    x = b.fmul(em.get(accs[ii][r]), vmath.splat(em, self.scale, LANES))
                    if self.softcap:
                        x = b.fmul(vmath.libm(em, "tanhf", x), vmath.splat(em, self.softcap, LANES))
                    off = em.mul(em.add(em.mul(em.add(i0, ii), TILE), r * LANES), 4)
                    cols = ir.Constant(vec(ir.IntType(32), LANES), list(range(r * LANES, (r + 1) * LANES)))
                    past = b.icmp_signed(">=", cols, em.splat(b.trunc(em.i64(kvt), ir.IntType(32)), LANES))
                    x = b.select(past, em.splat(ninf, LANES), x)
                    if self.p["mask"] is not None:
                        x = b.fadd(x, em.load(vt, MK, off))
                    em.store(x, KQ, off)

        full = em.mul(em.div(rows, kq_group), kq_group)
        with em.loop(0, full, kq_group, name="qig") as i:
            kq_rows(i, kq_group)
        with em.loop(full, rows, name="qi1") as i:
            kq_rows(i, 1)
        # per row: tile max, rescale, exps in place, sum (ggml_vec_soft_max_f32)
        skip = em.var(ir.IntType(64), em.i64(0))   # bit i: row i has no live cell in this tile
        with em.loop(0, rows, name="sm") as i:
            row = em.gep(KQ, em.mul(em.mul(i, TILE), 4))
            vm = em.load(vt, row, 0)
            for r in range(1, TILE // LANES):
                x = em.load(vt, row, r * LANES * 4)
                vm = b.select(b.fcmp_ordered(">", x, vm), x, vm)
            tile_max = em.reduce_fmax(vm)
            dead = b.fcmp_ordered("==", tile_max, ninf)
            with em.if_else(dead) as (then, otherwise):
                with then:
                    em.set(skip, b.or_(em.get(skip), b.shl(em.i64(1), i)))
                with otherwise:
                    m_old = em.load(F32, Mb, em.mul(i, 4))
                    m_new = b.select(b.fcmp_ordered(">", tile_max, m_old), tile_max, m_old)
                    with em.if_(b.fcmp_ordered(">", m_new, m_old)):
                        ms = vmath.expf(em, b.fsub(m_old, m_new))
                        vrow = em.gep(VKQ, em.mul(em.mul(i, DV), 4))
                        chunked(em, DV, lambda j, lanes, vrow=vrow, ms=ms: _vstore(em, b.fmul(
                            _vload(em, vrow, j, "f32", lanes), em.splat(ms, lanes) if lanes else ms), vrow, j, "f32"))
                        em.store(b.fmul(em.load(F32, Sb, em.mul(i, 4)), ms), Sb, em.mul(i, 4))
                    em.store(m_new, Mb, em.mul(i, 4))
                    total = em.var(F64, ir.Constant(F64, 0.0))
                    lanes = vmath.lanes(em)          # ggml_vec_soft_max_f32's vectors
                    mvec = em.splat(m_new, lanes)
                    for r in range(TILE // lanes):
                        e = vmath.v_expf(em, b.fsub(em.load(vec(F32, lanes), row, r * lanes * 4), mvec))
                        em.store(e, row, r * lanes * 4)
                        em.set(total, b.fadd(em.get(total), b.fpext(em.reduce_add_tree(e), F64)))
                    old = b.fpext(em.load(F32, Sb, em.mul(i, 4)), F64)
                    em.store(b.fptrunc(b.fadd(old, em.get(total)), F32), Sb, em.mul(i, 4))
        # V tile as f32, then VKQ[i][:] += sum_j KQ[i][j] * V32[j][:] (j in order, fma)
        with em.loop(0, kvt, name="vt") as j:
            vrow = self._kv_row(em, "v", s, h, em.add(c0, j))
            dst = em.gep(V32, em.mul(em.mul(j, DV), 4))
            chunked(em, DV, lambda k, lanes, vrow=vrow, dst=dst: _vstore(
                em, _vload(em, vrow, k, kv_dt, lanes), dst, k, "f32"))
        # VKQ[i][:] += sum_j KQ[i][j] * V32[j][:] (dead rows keep VKQ); with a static DV a block of
        # rows x output vectors stays in registers, so each V vector is loaded once per row group
        static = isinstance(DV, int) and DV % LANES == 0 and DV // LANES <= 8
        nv = DV // LANES if static else 0
        group, pv_cols = register_block(em, nv) if static else (4, 0)

        def pv_rows(i0, n_rows: int) -> None:
            masks = [b.icmp_unsigned("==", b.and_(b.lshr(em.get(skip), em.add(i0, ii)), em.i64(1)), em.i64(0))
                     for ii in range(n_rows)]
            outs = [em.gep(VKQ, em.mul(em.mul(em.add(i0, ii), DV), 4)) for ii in range(n_rows)]
            prows = [em.gep(KQ, em.mul(em.mul(em.add(i0, ii), TILE), 4)) for ii in range(n_rows)]
            if static:
                for c0 in range(0, nv, pv_cols):
                    cols = range(c0, c0 + pv_cols)
                    accs = [{c: em.var(vt, em.load(vt, outs[ii], c * LANES * 4)) for c in cols} for ii in range(n_rows)]
                    with em.loop(0, kvt, name="vj") as j:
                        vrow = em.gep(V32, em.mul(em.mul(j, DV), 4))
                        vs = {c: em.load(vt, vrow, c * LANES * 4) for c in cols}
                        for ii in range(n_rows):
                            p = em.splat(em.load(F32, prows[ii], em.mul(j, 4)), LANES)
                            for c in cols:
                                em.set(accs[ii][c], em.fma(vs[c], p, em.get(accs[ii][c])))
                    for ii in range(n_rows):
                        with em.if_(masks[ii]):
                            for c in cols:
                                em.store(em.get(accs[ii][c]), outs[ii], c * LANES * 4)
                return

            def body(k, lanes):
                ty = vt if lanes else F32
                accs = [em.var(ty, _vload(em, outs[ii], k, "f32", lanes)) for ii in range(n_rows)]
                with em.loop(0, kvt, name="vj") as j:
                    v = _vload(em, em.gep(V32, em.mul(em.mul(j, DV), 4)), k, "f32", lanes)
                    for ii in range(n_rows):
                        p = em.load(F32, prows[ii], em.mul(j, 4))
                        em.set(accs[ii], em.fma(v, em.splat(p, lanes) if lanes else p, em.get(accs[ii])))
                for ii in range(n_rows):
                    with em.if_(masks[ii]):
                        _vstore(em, em.get(accs[ii]), outs[ii], k, "f32")

            chunked(em, DV, body)

        full = em.mul(em.div(rows, group), group)
        with em.loop(0, full, group, name="vig") as i:
            pv_rows(i, group)
        with em.loop(full, rows, name="vi1") as i:
            pv_rows(i, 1)


def register_block(em: Emitter, n_vecs: int) -> tuple[int, int]:
    """(rows, vectors) of a block of 16-lane accumulators for the target's register file: up to
    four rows x the most of the n_vecs vectors (a divisor) such that the accumulators, a row of
    loaded vectors and a broadcast leave four registers spare (32 zmm with AVX-512; 16 ymm
    without, where each 16-lane vector takes two)."""
    regs = 32 if em.target.avx512 else 16
    cost = max(1, LANES // em.target.lanes)
    for cols in sorted((c for c in range(1, n_vecs + 1) if n_vecs % c == 0), reverse=True):
        for rows in (4, 2):
            if (rows * cols + cols) * cost + 1 <= regs - 4:
                return rows, cols
    return 1, 1


def split_kv(em: Emitter, d: dict) -> ir.Value:
    """Whether ggml splits the cells over the threads: one query row, one stream, 512+ cells."""
    b = em.b
    one = b.and_(em.icmp("==", d["T"], 1), em.icmp("==", d["S"], 1))
    return b.and_(one, em.icmp(">=", d["n_kv"], SPLIT_KV_MIN))


class FlashAttnReduce(Kernel):
    """After a split-KV FlashAttn: each thread combines the partials of some heads in chunk order
    (ggml_flash_attn_ext_reduce_partials) into y [1, 1, H, dv]; nothing when there was no split."""

    def __init__(self, y: Ref, q: Ref, k: Ref):
        self.n_ptrs = 2     # y, partials
        super().__init__([q.shape[0], q.shape[1], q.shape[2], k.shape[2], y.shape[3]] + list(y.strides[:3]))

    def emit(self, em: Emitter, a) -> None:
        b = em.b
        S_, H, T, n_kv, DV = a.ints[:5]
        ys = a.ints[5:8]
        y_ptr, partials = a.ptrs
        d = {"S": S_, "T": T, "n_kv": n_kv}
        chunk = em.cdiv(n_kv, a.nth)
        with em.if_(split_kv(em, d)):
            with em.loop(a.ith, H, a.nth, name="head") as h:
                yrow = em.gep(y_ptr, em.offset((0, 0, h), ys))
                zero = ir.Constant(vec(F32, LANES), [0.0] * LANES)
                chunked(em, DV, lambda i, lanes: _vstore(em, zero if lanes else em.f32(0.0), yrow, i, "f32"))
                M = em.var(F32, em.f32(float("-inf")))
                S = em.var(F32, em.f32(0.0))
                with em.loop(0, a.nth, name="chunk") as c:
                    part = em.gep(partials, em.mul(em.add(em.mul(c, H), h), em.mul(em.add(DV, 2), 4)))
                    m_c, s_c = em.load(F32, part, 0), em.load(F32, part, 4)
                    used = b.and_(em.icmp("<", em.mul(c, chunk), n_kv), b.fcmp_ordered("!=", s_c, em.f32(0.0)))
                    with em.if_(used):
                        m_new = em.intrinsic("llvm.maxnum.f32", F32, [em.get(M), m_c])
                        old = vmath.expf(em, b.fsub(em.get(M), m_new))
                        new = vmath.expf(em, b.fsub(m_c, m_new))

                        def body(i, lanes, part=part, old=old, new=new):
                            acc = _vload(em, yrow, i, "f32", lanes)
                            pv = _vload(em, em.gep(part, 8), i, "f32", lanes)
                            o, n = (em.splat(old, lanes), em.splat(new, lanes)) if lanes else (old, new)
                            _vstore(em, em.fma(acc, o, b.fmul(pv, n)), yrow, i, "f32")

                        chunked(em, DV, body)
                        em.set(S, em.fma(em.get(S), old, b.fmul(s_c, new)))
                        em.set(M, m_new)
                total = em.get(S)
                with em.if_(b.fcmp_ordered("!=", total, em.f32(0.0))):
                    inv = b.fdiv(em.f32(1.0), total)
                    chunked(em, DV, lambda i, lanes: _vstore(em, b.fmul(
                        _vload(em, yrow, i, "f32", lanes), em.splat(inv, lanes) if lanes else inv), yrow, i, "f32"))
