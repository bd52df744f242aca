"""The mma attention kernel (prompts: many query rows per KV head; ggml-cuda's fattn-mma-f16).

A warp owns 16 rows, a block up to 64. Per tile of BC cells, K [cell][dk] and V^T [dv][cell] are
staged in shared memory as f16 (converted or dequantized on the way in); S = Q K^T and O += P V
run on the tensor cores (mma.m16n8k16, f16 inputs, f32 accumulation), P passing from S's
accumulators to the A fragments of P V in registers. Q is scaled and rounded to f16 once: into
registers, or for wide heads (whose accumulators fill the registers) into shared memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from llamir_cuda import kir
from llamir_cuda.attention_common import NEG_INF, AttnView, Row, Variant, attn_params, imin, pack_h2
from llamir_cuda.kir import F32, I32, WARP
from llamir_cuda.lowering import ceil_div

MMA_MAX_WARPS = 4
MMA_MAX_HEAD = 256       # O accumulators live in registers
MMA_REGS = 136           # fragment registers a lane may hold (of 255; ptxas needs the rest)
MMA_SHARED = 48 << 10    # static shared memory of a block


@dataclass(frozen=True)
class MmaShape:
    """The tile geometry of an mma variant: head sizes padded to the fragments (dk to 16, dv to 8),
    BC cells per tile, the most warps (16 rows each) a block takes, and whether Q's fragments
    stay in registers or are read from shared memory (when with the accumulators they would not
    fit). Shared rows are strided by an odd multiple of 4 words, so that the eight rows a
    fragment load touches fall in distinct banks."""

    dkp: int
    dvp: int
    bc: int
    max_warps: int
    q_in_regs: bool

    @classmethod
    def of(cls, dk: int, dv: int) -> MmaShape:
        dkp, dvp = ceil_div(dk, 16) * 16, ceil_div(dv, 8) * 8
        for q_in_regs in (True, False):
            for warps in (MMA_MAX_WARPS, 2):
                for bc in (64, 32, 16):
                    shape = cls(dkp, dvp, bc, warps, q_in_regs)
                    if shape.registers <= MMA_REGS and shape.shared_bytes <= MMA_SHARED:
                        return shape
        raise ValueError(f"no mma tiles for head sizes {dk}/{dv}")

    @property
    def registers(self) -> int:
        """The fragments a lane holds: Q's (when in registers), O's and S's accumulators."""
        return self.dkp // 4 * self.q_in_regs + self.dvp // 2 + self.bc // 2

    @property
    def shared_bytes(self) -> int:
        q_rows = 0 if self.q_in_regs else 16 * self.max_warps
        return 4 * ((q_rows + self.bc) * self.k_stride + self.dvp * self.v_stride)

    @property
    def k_stride(self) -> int:
        return self.dkp // 2 + 4

    @property
    def v_stride(self) -> int:
        return self.bc // 2 + 4


def mma_fits(dk: int, dv: int) -> bool:
    """Whether the heads fit the kernel (its O accumulators live in registers)."""
    return max(dk, dv) <= MMA_MAX_HEAD


def mma_kernel(var: Variant, warps: int) -> kir.Kernel:
    """16 rows per warp, `warps` (at most the shape's max_warps) per block; grid (row blocks, Hkv, S)."""
    shape = MmaShape.of(var.dk, var.dv)

    def body(k: kir.KernelBuilder) -> None:
        k.min_blocks_per_sm = 1  # the fragments take up to 255 registers
        a, b = AttnView(k, var), k.b
        st = _MmaState(k, var, shape, warps)
        kvh, s = k.ctaid(1), k.ctaid(2)
        kvs = a.kv_stream(s)
        first = b.add(b.mul(k.ctaid(0), k.i32(16 * warps)), b.add(b.mul(k.warp(), k.i32(16)), st.group))
        rows = [a.row(first, kvh, s), a.row(b.add(first, k.i32(8)), kvh, s)]
        if shape.q_in_regs:
            st.q_frags = [st.q_frag(a, rows, step) for step in range(shape.dkp // 16)]
        else:
            st.stage_q(a, b.mul(k.ctaid(0), k.i32(16 * warps)), kvh, s)
        with k.loop(k.i32(0), a.n_kv, shape.bc) as c0:
            st.stage(a, c0, kvh, kvs)
            k.barrier()  # (the first also publishes a staged Q)
            probs = st.softmax(a, rows, c0, st.scores())
            st.pv(probs)
            k.barrier()  # the next tile overwrites the shared tiles
        st.finish(a, rows)

    name = "soft_max_attn_mma" if var.v_trans else "flash_attn_mma"
    return kir.define(name, (var, warps), attn_params(var), warps * WARP, body)


class _MmaState:
    """A warp's 16 rows in mma fragments. Lane l holds rows g = l/4 and g + 8 of the warp, and of
    every 8-wide column tile the columns 2*(l%4) and +1 (accumulator element e: row g + 8*(e >= 2),
    column 2*(l%4) + e%2); the running max and this lane's share of the sum per row."""

    def __init__(self, k: kir.KernelBuilder, var: Variant, shape: MmaShape, warps: int):
        self.k, self.var, self.shape, self.n_threads = k, var, shape, warps * WARP
        lane = k.lane()
        self.group, self.quad = k.b.lshr(lane, k.i32(2)), k.b.and_(lane, k.i32(3))
        self.k_sh = k.shared(I32, shape.bc * shape.k_stride, "k_tile")      # [cell][dk/2] f16 pairs
        self.q_sh = None if shape.q_in_regs else k.shared(I32, 16 * warps * shape.k_stride, "q_rows")
        self.q_frags: list[list[ir.Value]] = []
        self.v_sh = k.shared(I32, shape.dvp * shape.v_stride, "v_tile")     # [dv][cell/2] f16 pairs
        self.m = [k.var(F32, k.f32(NEG_INF)) for _ in range(2)]
        self.sum = [k.var(F32, k.f32(0.0)) for _ in range(2)]
        self.acc = [[k.var(F32, k.f32(0.0)) for _ in range(4)] for _ in range(shape.dvp // 8)]

    def _q_value(self, a: AttnView, row: Row, d: ir.Value) -> ir.Value:
        """q * scale at dim d of a row (0 past dk)."""
        k, b, dk = self.k, self.k.b, self.var.dk
        x = k.load_f32(a.q.ptr, k.offset(a.q, imin(k, d, k.i32(dk - 1)), row.t, row.h, row.s), "f32")
        return k.select(b.icmp_signed("<", d, k.i32(dk)), b.fmul(x, k.args["scale"]), k.f32(0.0))

    def q_frag(self, a: AttnView, rows: list[Row], step: int) -> list[ir.Value]:
        """The A fragment of q * scale as f16 for dims 16*step .. +15, from q."""
        k, b = self.k, self.k.b
        regs = []
        for half_k in (0, 8):  # registers (row g, row g+8) of k 0..7, then of k 8..15
            d = b.add(b.mul(self.quad, k.i32(2)), k.i32(16 * step + half_k))
            for row in rows:
                regs.append(pack_h2(k, self._q_value(a, row, d), self._q_value(a, row, b.add(d, k.i32(1)))))
        return regs

    def stage_q(self, a: AttnView, row0: ir.Value, kvh, s) -> None:
        """The block's rows of q * scale into shared memory as f16 pairs [row][dk/2]."""
        k, b = self.k, self.k.b
        words = self.shape.dkp // 2
        with k.loop(k.tid(0), k.i32(self.n_threads // WARP * 16 * words), self.n_threads) as i:
            r, w = b.udiv(i, k.i32(words)), b.urem(i, k.i32(words))
            row = a.row(b.add(row0, r), kvh, s, scores=False)
            d = b.mul(w, k.i32(2))
            pair = pack_h2(k, self._q_value(a, row, d), self._q_value(a, row, b.add(d, k.i32(1))))
            k.sstore(pair, self.q_sh, b.add(b.mul(r, k.i32(self.shape.k_stride)), w))

    def _q_frag_shared(self, step: int) -> list[ir.Value]:
        """q_frag's fragment, from the rows stage_q wrote."""
        k, b, stride = self.k, self.k.b, self.shape.k_stride
        row = b.add(b.mul(k.warp(), k.i32(16)), self.group)
        base = b.add(b.mul(row, k.i32(stride)), b.add(self.quad, k.i32(8 * step)))
        return [k.sload(self.q_sh, b.add(base, k.i32(off))) for off in (0, 8 * stride, 4, 8 * stride + 4)]

    def stage(self, a: AttnView, c0: ir.Value, kvh, kvs) -> None:
        """K [cell][dk] and V^T [dv][cell] of the tile into shared memory as f16 pairs (cells past
        n_kv and dims past the head are 0), each read along its contiguous axis."""
        k, b, shape, var = self.k, self.k.b, self.shape, self.var
        tid = k.tid(0)
        n_kv = a.n_kv

        def element(read, d, size, cell):
            ok = b.and_(b.icmp_signed("<", d, k.i32(size)), b.icmp_signed("<", cell, n_kv))
            x = read(imin(k, d, k.i32(size - 1)), imin(k, cell, b.sub(n_kv, k.i32(1))), kvh, kvs)
            return k.select(ok, x, k.f32(0.0))

        k_words = shape.dkp // 2
        with k.loop(tid, k.i32(shape.bc * k_words), self.n_threads) as i:
            cell, dw = b.udiv(i, k.i32(k_words)), b.urem(i, k.i32(k_words))
            d, c = b.mul(dw, k.i32(2)), b.add(c0, cell)
            pair = pack_h2(k, element(a.k_at, d, var.dk, c), element(a.k_at, b.add(d, k.i32(1)), var.dk, c))
            k.sstore(pair, self.k_sh, b.add(b.mul(cell, k.i32(shape.k_stride)), dw))
        v_words = shape.bc // 2
        with k.loop(tid, k.i32(shape.dvp * v_words), self.n_threads) as i:
            if var.v_trans:  # V [n, dv]: consecutive threads read consecutive cells
                d, cw = b.udiv(i, k.i32(v_words)), b.urem(i, k.i32(v_words))
            else:            # V [dv, n]: consecutive threads read consecutive dims
                d, cw = b.urem(i, k.i32(shape.dvp)), b.udiv(i, k.i32(shape.dvp))
            c = b.add(c0, b.mul(cw, k.i32(2)))
            pair = pack_h2(k, element(a.v_at, d, var.dv, c), element(a.v_at, d, var.dv, b.add(c, k.i32(1))))
            k.sstore(pair, self.v_sh, b.add(b.mul(d, k.i32(shape.v_stride)), cw))

    def _b_frag(self, arr: kir.SharedArray, n_row: int, stride: int, step: int) -> list[ir.Value]:
        """The B fragment of k-step `step` for the 8 columns from n_row: rows of the shared tile
        n_row + g, words 8*step + l%4 and 4 further (k 2*(l%4).. and + 8)."""
        k, b = self.k, self.k.b
        base = b.add(b.mul(b.add(self.group, k.i32(n_row)), k.i32(stride)), b.add(self.quad, k.i32(8 * step)))
        return [k.sload(arr, base), k.sload(arr, b.add(base, k.i32(4)))]

    def scores(self) -> list[list[ir.Value]]:
        """S = (q * scale) K^T for the tile: BC/8 accumulator tiles."""
        k = self.k
        tiles = [[k.f32(0.0)] * 4 for _ in range(self.shape.bc // 8)]
        for step in range(self.shape.dkp // 16):
            a_frag = self.q_frags[step] if self.shape.q_in_regs else self._q_frag_shared(step)
            for n, acc in enumerate(tiles):
                tiles[n] = k.mma_f16(a_frag, self._b_frag(self.k_sh, 8 * n, self.shape.k_stride, step), acc)
        return tiles

    def softmax(self, a: AttnView, rows: list[Row], c0: ir.Value, tiles) -> list[list[ir.Value]]:
        """Logits of the tile, the running max and sum of both rows (a row's 4 lanes reduce its
        max), the accumulators rescaled; returns the probabilities in the same layout."""
        k, b = self.k, self.k.b
        last = b.sub(a.n_kv, k.i32(1))
        logits = [[None] * 4 for _ in tiles]
        for n, tile in enumerate(tiles):
            for e in range(4):
                cell = b.add(c0, b.add(b.mul(self.quad, k.i32(2)), k.i32(8 * n + e % 2)))
                x = a.logit(tile[e], rows[e // 2], imin(k, cell, last))
                logits[n][e] = k.select(b.icmp_signed("<", cell, a.n_kv), x, k.f32(NEG_INF))
        probs = [[None] * 4 for _ in tiles]
        for r in range(2):
            mine = [(n, e) for n in range(len(tiles)) for e in (2 * r, 2 * r + 1)]
            tile_max = logits[mine[0][0]][mine[0][1]]
            for n, e in mine[1:]:
                tile_max = k.fmax(tile_max, logits[n][e])
            tile_max = k.warp_max(tile_max, 4)
            m_new, live, ms = a.rescale(k.get(self.m[r], F32), tile_max)
            total = b.fmul(k.get(self.sum[r], F32), ms)
            for n, e in mine:
                probs[n][e] = a.prob(live, logits[n][e], m_new)
                total = b.fadd(total, probs[n][e])
            k.set(self.sum[r], total)
            k.set(self.m[r], m_new)
            for acc in self.acc:
                for e in (2 * r, 2 * r + 1):
                    k.set(acc[e], b.fmul(k.get(acc[e], F32), ms))
        return probs

    def pv(self, probs: list[list[ir.Value]]) -> None:
        """O += P V: the probabilities of column tiles 2i and 2i+1 are the A fragment of k-step i."""
        k = self.k
        acc = [[k.get(slot, F32) for slot in tile] for tile in self.acc]
        for step in range(self.shape.bc // 16):
            lo, hi = probs[2 * step], probs[2 * step + 1]
            a_frag = [pack_h2(k, lo[0], lo[1]), pack_h2(k, lo[2], lo[3]),
                      pack_h2(k, hi[0], hi[1]), pack_h2(k, hi[2], hi[3])]
            for n in range(len(acc)):
                acc[n] = k.mma_f16(a_frag, self._b_frag(self.v_sh, 8 * n, self.shape.v_stride, step), acc[n])
        for slots, values in zip(self.acc, acc, strict=True):
            for slot, v in zip(slots, values, strict=True):
                k.set(slot, v)

    def finish(self, a: AttnView, rows: list[Row]) -> None:
        k, b = self.k, self.k.b
        for r, row in enumerate(rows):
            total = k.warp_sum(k.get(self.sum[r], F32), 4)
            m = k.get(self.m[r], F32)
            for n, tile in enumerate(self.acc):
                for e in (2 * r, 2 * r + 1):
                    d = b.add(b.mul(self.quad, k.i32(2)), k.i32(8 * n + e % 2))
                    with k.if_then(b.and_(row.valid, b.icmp_signed("<", d, k.i32(self.var.dv)))):
                        a.store_y(row, d, a.finish(row, m, total, k.get(tile[e], F32)))
