"""mul_mat_id (mixture-of-experts matmul): y[t, i] = as[ids[t, i]] @ b[t, i % n_b], one output row
per (token, slot), each dot product in the order ggml uses for the expert's type (ggml_vec_dot
for floats: mul_mat_id never goes to tinyBLAS; the exact orders for the block types)."""

from __future__ import annotations

from llamir.backends.llvm.emit import I32, Emitter
from llamir.backends.llvm.kernels.matmul_float import float_tiles, vec_dot_rows
from llamir.backends.llvm.kernels.matmul_quant import MatMulQDirect
from llamir.backends.llvm.kernels.quant_act import act_layout
from llamir.backends.llvm.kernels.repack import QFormat
from llamir.backends.llvm.plan import Kernel, Ref


class MatMulId(Kernel):
    def __init__(self, y: Ref, w: Ref, b: Ref, ids: Ref, site, fmt: QFormat | None, b_row_bytes, K: int,
                 repacked: bool = False):
        self.w_dtype = w.dtype.name
        self.fmt = fmt
        self.K = K
        self.repacked = repacked      # Q4_0 experts in ggml's CPU_REPACK: every row through its gemv
        self.n_ptrs = 4
        super().__init__(list(y.shape) + list(y.strides[:2]) + list(w.shape[:1]) + list(w.strides[:2])
                         + [b.shape[1], b_row_bytes] + list(ids.strides) + [site])

    def config(self) -> tuple:
        return (self.w_dtype, self.fmt, self.K, self.repacked)

    def emit(self, em: Emitter, a) -> None:
        from llamir.backends.llvm.codegen import report_error
        from llamir.backends.llvm.executable import ERR_INDEX

        b = em.b
        T, k, M = a.ints[0:3]
        ys = a.ints[3:5]
        n_expert = a.ints[5]
        ws = a.ints[6:8]
        n_b, b_row = a.ints[8:10]
        ids_st = a.ints[10:12]
        site = a.ints[12]
        y_ptr, w_ptr, b_ptr, ids_ptr = a.ptrs
        units = em.mul(T, k)
        u0, u1 = em.split(units, a.ith, a.nth)
        with em.loop(u0, u1, name="unit") as u:
            i = em.rem(u, k)
            t = em.div(u, k)
            e = em.i64(em.load(I32, ids_ptr, em.add(em.mul(t, ids_st[0]), em.mul(i, ids_st[1]))))
            ok = b.and_(em.icmp(">=", e, 0), em.icmp("<", e, n_expert))
            with em.if_else(ok) as (then, otherwise):
                with then:
                    W = em.gep(w_ptr, em.mul(e, ws[0]))
                    brow = em.gep(b_ptr, em.mul(em.add(em.mul(t, n_b), em.rem(i, n_b)), b_row))
                    yrow = em.gep(y_ptr, em.add(em.mul(t, ys[0]), em.mul(i, ys[1])))
                    self._row(em, W, ws[1], brow, yrow, M)
                with otherwise:
                    report_error(em, a.frame, ERR_INDEX, e, site)

    def _row(self, em: Emitter, W, w_row, brow, yrow, M) -> None:
        if self.fmt is None:   # ggml_vec_dot_f16/f32 per output, weight rows sharing each b load
            size = {"f32": 4, "f16": 2}[self.w_dtype]
            rows = float_tiles(em, self.w_dtype).dot_rows
            full = em.mul(em.div(M, rows), rows)
            for start, stop, n in ((0, full, rows), (full, M, 1)):
                with em.loop(start, stop, n, name=f"m{n}") as m:
                    rows = [em.gep(W, em.mul(em.add(m, r), w_row)) for r in range(n)]
                    totals = vec_dot_rows(em, rows, self.w_dtype, brow, "f32", self.K, size, 4)
                    for r, total in enumerate(totals):
                        em.store(total, yrow, em.mul(em.add(m, r), 4))
            return
        nb, off_d, off_aux, _, _ = act_layout(self.fmt, self.K)
        helper = MatMulQDirect.__new__(MatMulQDirect)
        helper.dtype = self.w_dtype
        bsize = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24}[self.w_dtype]
        with em.loop(0, M, name="m") as m:
            arow = em.gep(W, em.mul(m, w_row))
            em.store(helper._dot(em, arow, brow, nb, bsize, off_d, off_aux, self.repacked), yrow, em.mul(m, 4))
