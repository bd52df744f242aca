"""get_rows (gather, dequantising) and set_rows (scatter, converting or quantising) kernels.
Indices are checked: an index outside the rows is reported (the executable raises), never used."""

from __future__ import annotations

import llvmlite.ir as ir

from llamir.backends.llvm.codegen import report_error
from llamir.backends.llvm.emit import F32, I32, I64, Emitter, storage_type, vec
from llamir.backends.llvm.executable import ERR_INDEX
from llamir.backends.llvm.kernels.quant import dequant_value, quantize_block_cpu
from llamir.backends.llvm.plan import Kernel, Ref

LANES = 16


def _load_index(em: Emitter, ptr, off, dtype: str):
    return em.i64(em.load(I32 if dtype == "i32" else I64, ptr, off))


def _check(em: Emitter, a, idx, n, site) -> ir.Value:
    """idx in [0, n)? Reports the first bad one; returns the i1 condition."""
    b = em.b
    ok = b.and_(em.icmp(">=", idx, 0), em.icmp("<", idx, n))
    with em.if_(b.not_(ok)):
        report_error(em, a.frame, ERR_INDEX, idx, site)
    return ok


def copy_row(em: Emitter, dst_row, src_row, n, src_dtype: str, dst_dtype: str, src_step, dst_step,
             block_bytes: int = 0, block_size: int = 1) -> None:
    """dst_row[0:n] = convert(src_row[0:n]); quantized sources are dequantised block by block."""
    b = em.b
    if block_size > 1:
        with em.loop(0, em.div(n, block_size), name="blk") as k:
            blk = em.gep(src_row, em.mul(k, block_bytes))
            with em.loop(0, block_size, name="j") as j:
                v = dequant_value(em, src_dtype, blk, j)
                em.store(em.from_f32(v, dst_dtype), dst_row, em.mul(em.add(em.mul(k, block_size), j), dst_step))
        return
    if src_dtype == dst_dtype:
        ety = storage_type(src_dtype)
        size = ety.width // 8 if isinstance(ety, ir.IntType) else {"float": 4, "half": 2}[str(ety)]
        if isinstance(src_step, int) and isinstance(dst_step, int) and src_step == size == dst_step:
            chunks = em.mul(em.div(n, LANES), LANES)
            with em.loop(0, chunks, LANES, name="v") as c:
                em.store(em.load(vec(ety, LANES), src_row, em.mul(c, size)), dst_row, em.mul(c, size))
            with em.loop(chunks, n, name="t") as c:
                em.store(em.load(ety, src_row, em.mul(c, size)), dst_row, em.mul(c, size))
            return
        with em.loop(0, n, name="c") as c:
            em.store(em.load(ety, src_row, em.mul(c, src_step)), dst_row, em.mul(c, dst_step))
        return
    with em.loop(0, n, name="c") as c:
        v = em.to_f32(em.load(storage_type(src_dtype), src_row, em.mul(c, src_step)), src_dtype)
        em.store(em.from_f32(v, dst_dtype), dst_row, em.mul(c, dst_step))
    del b


class GetRows(Kernel):
    """y[b3, b2, i, :] = a[b3, b2, idx[b3, b2, i], :] (as f32, or raw for i32 data)."""

    def __init__(self, out: Ref, a: Ref, idx: Ref, site):
        out, a, idx = out.padded(), a.padded(), idx.padded(3)
        self.dtypes = (out.dtype.name, a.dtype.name, idx.dtype.name)
        self.block = (a.dtype.block_size, a.dtype.type_size)
        self.n_ptrs = 3
        super().__init__(list(out.shape) + list(out.strides) + list(a.shape[2:]) + list(a.strides)
                         + list(idx.strides) + [site])

    def config(self) -> tuple:
        return (self.dtypes, self.block)

    def emit(self, em: Emitter, a) -> None:
        shape, ostr = a.ints[0:4], a.ints[4:8]
        n_src_rows = a.ints[8]
        astr, istr, site = a.ints[10:14], a.ints[14:17], a.ints[17]
        rows = em.n_rows(shape)
        r0, r1 = em.split(rows, a.ith, a.nth)
        out_dt, a_dt, i_dt = self.dtypes
        bs, bb = self.block
        with em.loop(r0, r1, name="row") as r:
            i = em.rem(r, shape[2])
            rest = em.div(r, shape[2])
            i2, i3 = em.rem(rest, shape[1]), em.div(rest, shape[1])
            idx = _load_index(em, a.ptrs[2], em.offset((i3, i2, i), istr[:3]), i_dt)
            ok = _check(em, a, idx, n_src_rows, site)
            with em.if_(ok):
                src = em.gep(a.ptrs[1], em.offset((i3, i2, idx), astr[:3]))
                dst = em.gep(a.ptrs[0], em.offset((i3, i2, i), ostr[:3]))
                copy_row(em, dst, src, shape[3], a_dt, out_dt, astr[3], ostr[3], bb, bs)


class SetRows(Kernel):
    """dst[b3, b2, idx[b3 % I3, b2 % I2, i], :] = convert(src[b3, b2, i, :]) (quantising for
    quantized dst); thread ith takes source rows."""

    runtime_ints = (8, 9, 10, 11)   # dst's row count and outer strides (a KV cache's follow its size)

    def __init__(self, dst: Ref, src: Ref, idx: Ref, site):
        dst, src, idx = dst.padded(), src.padded(), idx.padded(3)
        self.dtypes = (dst.dtype.name, src.dtype.name, idx.dtype.name)
        self.block = (dst.dtype.block_size, dst.dtype.type_size)
        self.n_ptrs = 3
        super().__init__(list(src.shape) + list(src.strides) + list(dst.shape[2:3]) + list(dst.strides)
                         + list(idx.shape) + list(idx.strides) + [site])

    def config(self) -> tuple:
        return (self.dtypes, self.block)

    def emit(self, em: Emitter, a) -> None:
        shape, sstr = a.ints[0:4], a.ints[4:8]
        n_dst_rows = a.ints[8]
        dstr, ish, istr, site = a.ints[9:13], a.ints[13:16], a.ints[16:19], a.ints[19]
        rows = em.n_rows(shape)
        r0, r1 = em.split(rows, a.ith, a.nth)
        dst_dt, src_dt, i_dt = self.dtypes
        bs, bb = self.block
        with em.loop(r0, r1, name="row") as r:
            i = em.rem(r, shape[2])
            rest = em.div(r, shape[2])
            i2, i3 = em.rem(rest, shape[1]), em.div(rest, shape[1])
            ioff = em.offset((em.rem(i3, ish[0]), em.rem(i2, ish[1]), i), istr[:3])
            idx = _load_index(em, a.ptrs[2], ioff, i_dt)
            ok = _check(em, a, idx, n_dst_rows, site)
            with em.if_(ok):
                src = em.gep(a.ptrs[1], em.offset((i3, i2, i), sstr[:3]))
                dst = em.gep(a.ptrs[0], em.offset((i3, i2, idx), dstr[:3]))
                if bs == 1:
                    copy_row(em, dst, src, shape[3], src_dt, dst_dt, sstr[3], dstr[3])
                else:
                    with em.loop(0, em.div(shape[3], bs), name="blk") as k:
                        def value(j, k=k, src=src):
                            col = em.add(em.mul(k, bs), j)
                            return em.to_f32(em.load(storage_type(src_dt), src, em.mul(col, sstr[3])), src_dt)
                        quantize_block_cpu(em, dst_dt, value, em.gep(dst, em.mul(k, bb)))


__all__ = ["F32", "GetRows", "SetRows", "copy_row"]


class ConvertRows(Kernel):
    """dst = src converted row by row where a side is quantized (ggml_cpy: dequantize_row_* or
    ggml-cpu's from_float); threads take rows."""

    def __init__(self, dst: Ref, src: Ref):
        dst, src = dst.padded(), src.padded()
        self.dtypes = (dst.dtype.name, src.dtype.name)
        self.blocks = ((dst.dtype.block_size, dst.dtype.type_size), (src.dtype.block_size, src.dtype.type_size))
        self.n_ptrs = 2
        super().__init__(list(src.shape) + list(src.strides) + list(dst.strides))

    def config(self) -> tuple:
        return (self.dtypes, self.blocks)

    def emit(self, em: Emitter, a) -> None:
        from llamir.backends.llvm.kernels.rows import row_pointer

        shape, sst, dstr = a.ints[0:4], a.ints[4:8], a.ints[8:12]
        rows = em.n_rows(shape)
        r0, r1 = em.split(rows, a.ith, a.nth)
        (dbs, dbb), (sbs, sbb) = self.blocks
        d_dt, s_dt = self.dtypes
        with em.loop(r0, r1, name="row") as r:
            src = row_pointer(em, a.ptrs[1], r, shape[:3], sst[:3])
            dst = row_pointer(em, a.ptrs[0], r, shape[:3], dstr[:3])

            def value(col, src=src):
                if sbs == 1:
                    return em.to_f32(em.load(storage_type(s_dt), src, em.mul(col, sst[3])), s_dt)
                blk = em.gep(src, em.mul(em.div(col, sbs), sbb))
                return dequant_value(em, s_dt, blk, em.rem(col, sbs))

            if dbs == 1:
                with em.loop(0, shape[3], name="c") as c:
                    em.store(em.from_f32(value(c), d_dt), dst, em.mul(c, dstr[3]))
            else:
                with em.loop(0, em.div(shape[3], dbs), name="blk") as k:
                    base = em.mul(k, dbs)
                    quantize_block_cpu(em, d_dt, lambda j, base=base: value(em.add(base, j)),
                                       em.gep(dst, em.mul(k, dbb)))
