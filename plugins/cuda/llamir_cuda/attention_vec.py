"""The vec attention kernel (decode: a few query rows per KV head; ggml-cuda's fattn-vec).

A block of 4 warps takes up to 8 rows of one KV head; each warp walks its own chunks of 32 cells.
L lanes compute a cell's dot products (Q in registers, K read from global memory along its rows),
a chunk's softmax is one warp reduction, and every lane accumulates 32-strided output columns
(each probability broadcast by a shuffle from the lane that computed it). The warps' states
merge in shared memory. When the grid would leave the GPU idle the cells are also split over
blocks (flash-decoding), and a second kernel merges the blocks' partial states.
"""

from __future__ import annotations

import math

from llvmlite import ir

from llamir_cuda import kir
from llamir_cuda.attention_common import NEG_INF, QUANT_KV, AttnView, Row, Variant, attn_params, imin
from llamir_cuda.kir import F32, WARP, scalar
from llamir_cuda.lowering import ceil_div

VEC_WARPS = 4
VEC_MAX_ROWS = 8
VEC_Q_REGS = 64          # Q values a lane holds: rows x ceil(dk / L)
VEC_ACC_REGS = 32        # accumulators a lane holds: rows x ceil(dv / 32)
SPLIT_MIN_CELLS = VEC_WARPS * WARP
TARGET_BLOCKS = 264      # blocks that fill a GPU (2 per SM of an H100/H200)
COMBINE_BLOCK = 128
VEC_EXTRA = (scalar("part", "p"), scalar("n_split", "i"), scalar("split_cells", "i"))


def vec_max_rows(dv: int) -> int:
    """The most rows a block takes (its lanes hold rows x ceil(dv / 32) accumulators)."""
    return max(1, min(VEC_MAX_ROWS, VEC_ACC_REGS // ceil_div(dv, WARP)))


def vec_shape(var: Variant, n_rows: int) -> tuple[int, int]:
    """(rows per block, lanes per cell): the most rows the registers take, with the fewest lanes
    per cell (fewer shuffles per dot product). A quantized V read across its blocks (soft_max_attn)
    addresses a block per value, which takes half the Q registers."""
    rows = max(1, min(vec_max_rows(var.dv), n_rows))
    q_regs = VEC_Q_REGS // 2 if var.v_trans and var.v_type in QUANT_KV else VEC_Q_REGS
    while True:
        for lanes in (8, 16, 32):
            if rows * ceil_div(var.dk, lanes) <= q_regs:
                return rows, lanes
        rows -= 1


def splits(n_kv: int, blocks: int) -> tuple[int, int]:
    """(n_split, cells per split) for a vec launch of `blocks` blocks: enough splits to fill the
    GPU, each at least a chunk per warp, cut at multiples of 32 cells."""
    n = max(1, min(ceil_div(TARGET_BLOCKS, blocks), ceil_div(n_kv, SPLIT_MIN_CELLS)))
    cells = max(WARP, ceil_div(ceil_div(n_kv, n), WARP) * WARP)
    return max(1, ceil_div(n_kv, cells)), cells


def vec_kernel(var: Variant, n_rows: int, lanes: int) -> kir.Kernel:
    """n_rows rows of a KV head per block, `lanes` lanes per cell; grid (row blocks, Hkv, S x n_split)."""

    def body(k: kir.KernelBuilder) -> None:
        k.min_blocks_per_sm = 1  # Q and the accumulators take most registers
        a, b = AttnView(k, var), k.b
        kvh, z = k.ctaid(1), k.ctaid(2)
        n_split, split_cells = k.args["n_split"], k.args["split_cells"]
        s, split = b.sdiv(z, n_split), b.srem(z, n_split)
        kvs = a.kv_stream(s)
        lo = b.mul(split, split_cells)
        hi = imin(k, b.add(lo, split_cells), a.n_kv)
        row0 = b.mul(k.ctaid(0), k.i32(n_rows))
        rows = [a.row(b.add(row0, k.i32(r)), kvh, s) for r in range(n_rows)]
        st = _VecState(k, var, n_rows, lanes)
        st.load_q(a, rows)
        first = b.add(lo, b.mul(k.warp(), k.i32(WARP)))
        with k.loop(first, hi, VEC_WARPS * WARP) as start:
            st.chunk(a, rows, start, hi, kvh, kvs)
        st.merge(a, row0, kvh, s, split)

    name = "soft_max_attn_vec" if var.v_trans else "flash_attn_vec"
    return kir.define(name, (var, n_rows, lanes), attn_params(var, *VEC_EXTRA), VEC_WARPS * WARP, body)


class _VecState:
    """A vec lane's registers: Q values of its rows (dims sub + L*i), and per row the running max
    (warp-uniform), its share of the sum and the accumulators of dims lane + 32*i."""

    def __init__(self, k: kir.KernelBuilder, var: Variant, n_rows: int, lanes: int):
        self.k, self.var, self.n_rows, self.lanes = k, var, n_rows, lanes
        self.cells_per_step = WARP // lanes
        self.lane = k.lane()
        self.sub = k.b.and_(self.lane, k.i32(lanes - 1))
        self.grp = k.b.lshr(self.lane, k.i32(int(math.log2(lanes))))
        self.n_acc = ceil_div(var.dv, WARP)
        self.m = [k.var(F32, k.f32(NEG_INF)) for _ in range(n_rows)]
        self.sum = [k.var(F32, k.f32(0.0)) for _ in range(n_rows)]
        self.acc = [[k.var(F32, k.f32(0.0)) for _ in range(self.n_acc)] for _ in range(n_rows)]
        self.qv: list[list[ir.Value]] = []

    def _dim(self, first: ir.Value, i: int, stride: int, size: int) -> ir.Value:
        """Dim first + stride*i, clamped to the head (the lanes past it compute unused values)."""
        d = self.k.b.add(first, self.k.i32(stride * i))
        return d if stride * (i + 1) <= size else imin(self.k, d, self.k.i32(size - 1))

    def load_q(self, a: AttnView, rows: list[Row]) -> None:
        """q as K's vec_dot_type keeps it (f16, bf16; f32 otherwise); dims past dk give 0."""
        k, b, dk = self.k, self.k.b, self.var.dk
        for row in rows:
            values = []
            for i in range(ceil_div(dk, self.lanes)):
                d = b.add(self.sub, k.i32(self.lanes * i))
                x = k.load_f32(a.q.ptr, k.offset(a.q, imin(k, d, k.i32(dk - 1)), row.t, row.h, row.s), "f32")
                if self.var.k_type == "f16":
                    x = k.h2f(k.f2h(x))
                elif self.var.k_type == "bf16":
                    x = k.bf2f(k.f2bf(x))
                values.append(k.select(b.icmp_signed("<", d, k.i32(dk)), x, k.f32(0.0)))
            self.qv.append(values)

    def chunk(self, a: AttnView, rows: list[Row], start: ir.Value, hi: ir.Value, kvh, kvs) -> None:
        """Cells start .. start+31 (below hi): scores, the softmax update, then P V."""
        k, b = self.k, self.k.b
        n_cells = imin(k, k.i32(WARP), b.sub(hi, start))
        last = b.sub(hi, k.i32(1))
        dots = self._dots(a, start, n_cells, last, kvh, kvs)
        own = b.add(start, b.add(b.mul(self.sub, k.i32(self.cells_per_step)), self.grp))
        own_live = b.icmp_signed("<", own, hi)
        own = imin(k, own, last)
        probs = []
        for r, row in enumerate(rows):
            score = k.select(own_live, a.logit(b.fmul(dots[r], k.args["scale"]), row, own), k.f32(NEG_INF))
            m_new, live, ms = a.rescale(k.get(self.m[r], F32), k.warp_max(score))
            p = a.prob(live, score, m_new)
            k.set(self.sum[r], k.fma(k.get(self.sum[r], F32), ms, p))
            k.set(self.m[r], m_new)
            for slot in self.acc[r]:
                k.set(slot, b.fmul(k.get(slot, F32), ms))
            probs.append(p)
        self._pv(a, probs, start, n_cells, kvh, kvs)

    def _dots(self, a: AttnView, start, n_cells, last, kvh, kvs) -> list[ir.Value]:
        """q.k of every row with the chunk's cells: at step i, the lanes of group g take cell
        start + i*(32/L) + g; lane sub == i keeps it, so lane l ends with cell (l % L)*(32/L) + l/L."""
        k, b = self.k, self.k.b
        kept = [k.var(F32, k.f32(0.0)) for _ in range(self.n_rows)]
        steps = b.lshr(b.add(n_cells, k.i32(self.cells_per_step - 1)), k.i32(int(math.log2(self.cells_per_step))))
        with k.loop(k.i32(0), steps) as i:
            cell = imin(k, b.add(start, b.add(b.mul(i, k.i32(self.cells_per_step)), self.grp)), last)
            keys = [a.k_at(self._dim(self.sub, n, self.lanes, self.var.dk), cell, kvh, kvs)
                    for n in range(len(self.qv[0]))]
            mine = b.icmp_signed("==", self.sub, i)
            for r in range(self.n_rows):
                part = k.f32(0.0)
                for qx, kx in zip(self.qv[r], keys, strict=True):
                    part = k.fma(qx, kx, part)
                dot = k.warp_sum(part, self.lanes)
                k.set(kept[r], k.select(mine, dot, k.get(kept[r], F32)))
        return [k.get(slot, F32) for slot in kept]

    def _pv(self, a: AttnView, probs: list[ir.Value], start, n_cells, kvh, kvs) -> None:
        """acc += p * v for the chunk's cells in order, each p broadcast from the lane that owns it."""
        k, b = self.k, self.k.b
        with k.loop(k.i32(0), n_cells) as i:
            owner = b.or_(b.shl(b.and_(i, k.i32(self.cells_per_step - 1)), k.i32(int(math.log2(self.lanes)))),
                          b.lshr(i, k.i32(int(math.log2(self.cells_per_step)))))
            cell = b.add(start, i)
            values = [a.v_at(self._dim(self.lane, n, WARP, self.var.dv), cell, kvh, kvs) for n in range(self.n_acc)]
            for r in range(self.n_rows):
                p = k.shfl_idx(probs[r], owner)
                for slot, v in zip(self.acc[r], values, strict=True):
                    k.set(slot, k.fma(p, v, k.get(slot, F32)))

    def merge(self, a: AttnView, row0, kvh, s, split) -> None:
        """The warps' states through shared memory; each thread then finishes outputs (or, with
        the cells split over blocks, writes the block's partial state for combine_kernel)."""
        k, b, dv, n_rows = self.k, self.k.b, self.var.dv, self.n_rows
        m_sh, s_sh = k.shared(F32, VEC_WARPS * n_rows, "m"), k.shared(F32, VEC_WARPS * n_rows, "s")
        acc_sh = k.shared(F32, VEC_WARPS * n_rows * dv, "acc")
        slot0 = b.mul(k.warp(), k.i32(n_rows))
        for r in range(n_rows):
            total = k.warp_sum(k.get(self.sum[r], F32))
            slot = b.add(slot0, k.i32(r))
            with k.if_then(b.icmp_unsigned("==", self.lane, k.i32(0))):
                k.sstore(k.get(self.m[r], F32), m_sh, slot)
                k.sstore(total, s_sh, slot)
            for n, acc in enumerate(self.acc[r]):
                d = b.add(self.lane, k.i32(WARP * n))
                with k.if_then(b.icmp_signed("<", d, k.i32(dv))):
                    k.sstore(k.get(acc, F32), acc_sh, b.add(b.mul(slot, k.i32(dv)), d))
        k.barrier()
        tid, n_threads = k.tid(0), VEC_WARPS * WARP
        for n in range(ceil_div(n_rows * dv, n_threads)):
            index = b.add(tid, k.i32(n * n_threads))
            with k.if_then(b.icmp_signed("<", index, k.i32(n_rows * dv))):
                r, d = b.udiv(index, k.i32(dv)), b.urem(index, k.i32(dv))
                m, total, acc = self._merge_one(r, d, m_sh, s_sh, acc_sh)
                j = b.add(row0, r)
                row = a.row(j, kvh, s, scores=False)
                with k.if_then(row.valid):
                    with k.if_else(b.icmp_signed("==", k.args["n_split"], k.i32(1))) as (whole, partial):
                        with whole:
                            a.store_y(row, d, a.finish(row, m, total, acc))
                        with partial:
                            _store_partial(a, (j, kvh, s, split), d, m, total, acc)

    def _merge_one(self, r, d, m_sh, s_sh, acc_sh) -> tuple[ir.Value, ir.Value, ir.Value]:
        """(M, S, acc) of row r, dim d over the warps: each rescaled by exp(M_w - M)."""
        k, b, n_rows, dv = self.k, self.k.b, self.n_rows, self.var.dv
        slots = [b.add(r, k.i32(w * n_rows)) for w in range(VEC_WARPS)]
        maxes = [k.sload(m_sh, slot) for slot in slots]
        m = maxes[0]
        for mw in maxes[1:]:
            m = k.fmax(m, mw)
        total, acc = k.f32(0.0), k.f32(0.0)
        for slot, mw in zip(slots, maxes, strict=True):
            f = k.select(b.fcmp_ordered("==", mw, k.f32(NEG_INF)), k.f32(0.0), k.exp(b.fsub(mw, m)))
            total = k.fma(f, k.sload(s_sh, slot), total)
            acc = k.fma(f, k.sload(acc_sh, b.add(b.mul(slot, k.i32(dv)), d)), acc)
        return m, total, acc


def _partial_slots(a: AttnView, j, kvh, s, split) -> tuple[ir.Value, ir.Value]:
    """The i64 float indices of a row's partial (M, S) pair and its accumulators, in the scratch
    laid out as (M, S)[n_split][S*Hkv*n_rows], then acc[n_split][S*Hkv*n_rows][dv]."""
    k, b = a.k, a.k.b
    i64 = kir.I64

    def wide(v):
        return b.sext(v, i64)

    n_ids = b.mul(wide(b.mul(a.q.ne[3], a.kt.ne[2])), wide(a.n_rows))
    row_id = b.add(b.mul(b.add(b.mul(wide(s), wide(a.kt.ne[2])), wide(kvh)), wide(a.n_rows)), wide(j))
    slot = b.add(b.mul(wide(split), n_ids), row_id)
    acc_base = b.mul(b.mul(wide(k.args["n_split"]), n_ids), k.i64(2))
    return b.mul(slot, k.i64(2)), b.add(acc_base, b.mul(slot, k.i64(a.var.dv)))


def _store_partial(a: AttnView, where, d, m, total, acc) -> None:
    k, b = a.k, a.k.b
    pair, accs = _partial_slots(a, *where)
    part = k.args["part"]
    k.store(acc, part, b.mul(b.add(accs, b.sext(d, kir.I64)), k.i64(4)))
    with k.if_then(b.icmp_signed("==", d, k.i32(0))):
        k.store(m, part, b.mul(pair, k.i64(4)))
        k.store(total, part, b.mul(b.add(pair, k.i64(1)), k.i64(4)))


def combine_kernel(var: Variant) -> kir.Kernel:
    """The split cells' partial states of each row merged (flash-decoding's second step): one
    thread per output value."""

    def body(k: kir.KernelBuilder) -> None:
        k.min_blocks_per_sm = 1  # else ptxas holds it to 32 registers, and spills
        a, b, dv = AttnView(k, var), k.b, var.dv
        n_ids = b.mul(b.mul(a.q.ne[3], a.kt.ne[2]), a.n_rows)
        i = k.global_id()
        with k.if_then(b.icmp_signed("<", i, b.mul(n_ids, k.i32(dv)))):
            d, row_id = b.urem(i, k.i32(dv)), b.udiv(i, k.i32(dv))
            j, rest = b.urem(row_id, a.n_rows), b.udiv(row_id, a.n_rows)
            kvh, s = b.urem(rest, a.kt.ne[2]), b.udiv(rest, a.kt.ne[2])
            part = k.args["part"]

            def read(index):
                return k.load(part, F32, b.mul(index, k.i64(4)))

            m = k.var(F32, k.f32(NEG_INF))
            with k.loop(k.i32(0), k.args["n_split"]) as split:
                pair, _ = _partial_slots(a, j, kvh, s, split)
                k.set(m, k.fmax(k.get(m, F32), read(pair)))
            m = k.get(m, F32)
            total, acc = k.var(F32, k.f32(0.0)), k.var(F32, k.f32(0.0))
            with k.loop(k.i32(0), k.args["n_split"]) as split:
                pair, accs = _partial_slots(a, j, kvh, s, split)
                mp = read(pair)
                f = k.select(b.fcmp_ordered("==", mp, k.f32(NEG_INF)), k.f32(0.0), k.exp(b.fsub(mp, m)))
                k.set(total, k.fma(f, read(b.add(pair, k.i64(1))), k.get(total, F32)))
                k.set(acc, k.fma(f, read(b.add(accs, b.sext(d, kir.I64))), k.get(acc, F32)))
            row = a.row(j, kvh, s, scores=False)
            a.store_y(row, d, a.finish(row, m, k.get(total, F32), k.get(acc, F32)))

    name = "soft_max_attn_combine" if var.v_trans else "flash_attn_combine"
    return kir.define(name, (var,), attn_params(var, *VEC_EXTRA), COMBINE_BLOCK, body)
