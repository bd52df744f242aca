"""Row kernels: norms (with the fused weight/bias), softmax, row sums, argmax, cumsum, sorting.

Each thread takes whole rows. Sums follow ggml's CPU code: norms add the row in order into a
double (ggml_float), softmax sums each vector of exps (16 or 8 lanes, per profile) in float and
adds those sums into a double, the variance of `norm` does the same for its squares.
"""

from __future__ import annotations

import llvmlite.ir as ir

from llamir.backends.llvm import vmath
from llamir.backends.llvm.emit import F32, F64, I32, I64, Emitter, storage_type, vec
from llamir.backends.llvm.kernels.elementwise import axis_modes
from llamir.backends.llvm.plan import Kernel, Ref
from llamir.ir import dtype_named


def row_pointer(em: Emitter, ptr, r, shape3, strides3, modes=("eq", "eq", "eq"), in_shape3=None):
    """Pointer to row r of a padded rank-4 tensor iterated over `shape3` (outer three axes);
    `modes`/`in_shape3` tile a smaller tensor (ggml repeat)."""
    i2 = em.rem(r, shape3[2])
    rest = em.div(r, shape3[2])
    i1 = em.rem(rest, shape3[1])
    i0 = em.div(rest, shape3[1])
    off = 0
    for ax, i in enumerate((i0, i1, i2)):
        mode = modes[ax]
        if mode == "one":
            continue
        if mode == "mod":
            i = em.rem(i, in_shape3[ax])
        off = em.add(off, em.mul(i, strides3[ax]))
    return em.gep(ptr, off)


def load_row_value(em: Emitter, row, col, dtype: str, step, lanes: int = 0):
    """Element(s) `col`.. of a row as f32: one vector load when the step is the element size, one
    load a lane otherwise (a transposed or strided row)."""
    ety = storage_type(dtype)
    if not lanes:
        return em.to_f32(em.load(ety, row, em.mul(col, step)), dtype)
    if isinstance(step, int) and step == dtype_named(dtype).type_size:
        return em.to_f32(em.load(vec(ety, lanes), row, em.mul(col, step)), dtype)
    x = ir.Constant(vec(ety, lanes), None)
    for j in range(lanes):
        x = em.b.insert_element(x, em.load(ety, row, em.mul(em.add(col, j), step)), ir.Constant(I32, j))
    return em.to_f32(x, dtype)


class RowNorm(Kernel):
    """y = norm(x) (* w) (+ b) row by row; kind: "rms" | "norm" | "l2"."""

    def __init__(self, kind: str, eps: float, out: Ref, x: Ref, w: Ref | None, b: Ref | None, mid_dtype: str):
        self.kind, self.eps = kind, float(eps)
        out, x = out.padded(), x.padded()
        self.dtypes = (out.dtype.name, x.dtype.name, w.dtype.name if w else "", b.dtype.name if b else "")
        self.mid = mid_dtype            # the dtype the unfused norm would store (rounding)
        extra = [r.padded() for r in (w, b) if r is not None]
        self.modes = tuple(axis_modes(r.shape, out.shape) for r in extra)
        ints = list(out.shape) + list(out.strides) + list(x.strides)
        for r in extra:
            ints += list(r.shape) + list(r.strides)
        self.n_ptrs = 2 + len(extra)
        super().__init__(ints)

    def config(self) -> tuple:
        return (self.kind, self.eps, self.dtypes, self.mid, self.modes)

    def emit(self, em: Emitter, a) -> None:
        b = em.b
        shape, ostr, xstr = a.ints[0:4], a.ints[4:8], a.ints[8:12]
        extra = [(a.ints[12 + 8 * i:16 + 8 * i], a.ints[16 + 8 * i:20 + 8 * i]) for i in range(len(self.modes))]
        n = shape[3]
        rows = em.n_rows(shape)
        r0, r1 = em.split(rows, a.ith, a.nth)
        out_dt, x_dt = self.dtypes[0], self.dtypes[1]
        with em.loop(r0, r1, name="row") as r:
            xrow = row_pointer(em, a.ptrs[1], r, shape[:3], xstr[:3])
            yrow = row_pointer(em, a.ptrs[0], r, shape[:3], ostr[:3])
            extra_rows = [row_pointer(em, p, r, shape[:3], st[:3], m, sh[:3])
                          for p, (sh, st), m in zip(a.ptrs[2:], extra, self.modes, strict=True)]
            mean = None
            if self.kind == "norm":
                total = _sum_f64(em, n, lambda c: load_row_value(em, xrow, c, x_dt, xstr[3]))
                mean = b.fdiv(b.fptrunc(total, F32), b.sitofp(em.i64(n), F32))
                var = _chunked_sum_f64(em, n, lambda c, lanes: _sq(em, b.fsub(
                    load_row_value(em, xrow, c, x_dt, xstr[3], lanes), em.splat(mean, lanes) if lanes else mean)))
                var = b.fptrunc(b.fdiv(var, b.sitofp(em.i64(n), F64)), F32)
                scale = b.fdiv(em.f32(1.0), _sqrt(em, b.fadd(var, em.f32(self.eps))))
            else:
                total = _sum_f64(em, n, lambda c: _sq(em, load_row_value(em, xrow, c, x_dt, xstr[3])))
                if self.kind == "rms":
                    m = b.fptrunc(b.fdiv(total, b.sitofp(em.i64(n), F64)), F32)
                    scale = b.fdiv(em.f32(1.0), _sqrt(em, b.fadd(m, em.f32(self.eps))))
                else:
                    norm = _sqrt(em, b.fptrunc(total, F32))
                    scale = b.fdiv(em.f32(1.0), em.fmax(norm, em.f32(self.eps)))
            with em.loop(0, n, name="col") as c:
                x = load_row_value(em, xrow, c, x_dt, xstr[3])
                if mean is not None:
                    x = b.fsub(x, mean)
                y = b.fmul(x, scale)
                if self.mid != "f32":
                    y = em.to_f32(em.from_f32(y, self.mid), self.mid)
                for i, (row, (sh, st)) in enumerate(zip(extra_rows, extra, strict=True)):
                    col = em.rem(c, sh[3]) if self.modes[i][3] == "mod" else (0 if self.modes[i][3] == "one" else c)
                    v = load_row_value(em, row, col, self.dtypes[2 + i], st[3])
                    y = b.fmul(y, v) if i == 0 else b.fadd(y, v)
                    if self.mid != "f32" and i == 0 and len(extra_rows) == 2:
                        y = em.to_f32(em.from_f32(y, self.mid), self.mid)
                em.store(em.from_f32(y, out_dt), yrow, em.mul(c, ostr[3]))


def _sq(em: Emitter, x):
    return em.b.fmul(x, x)


def _sqrt(em: Emitter, x):
    return em.intrinsic("llvm.sqrt.f32", F32, [x])


def _sum_f64(em: Emitter, n, value) -> ir.Value:
    """sum_{c < n} (double) value(c), added in order (ggml_float sums)."""
    acc = em.var(F64, ir.Constant(F64, 0.0))
    with em.loop(0, n, name="sum") as c:
        em.set(acc, em.b.fadd(em.get(acc), em.b.fpext(value(c), F64)))
    return em.get(acc)


def _chunked_sum_f64(em: Emitter, n, value) -> ir.Value:
    """ggml's chunked sums: each vector of the profile's width summed in float (_mm512_reduce_add_ps
    or the 128-bit hsum: the reduce_add tree), added into a double in order, then the tail values
    one by one. value(c, lanes) gives f32 (vector)."""
    acc = em.var(F64, ir.Constant(F64, 0.0))
    lanes = vmath.lanes(em)
    chunks = em.mul(em.div(n, lanes), lanes)
    with em.loop(0, chunks, lanes, name="chunk") as c:
        s = em.reduce_add_tree(value(c, lanes))
        em.set(acc, em.b.fadd(em.get(acc), em.b.fpext(s, F64)))
    with em.loop(chunks, n, name="tail") as c:
        em.set(acc, em.b.fadd(em.get(acc), em.b.fpext(value(c, 0), F64)))
    return em.get(acc)


class SoftMax(Kernel):
    """y = softmax(x*scale + slope*mask) per row, with optional sinks (ggml_soft_max_ext)."""

    def __init__(self, out: Ref, x: Ref, mask: Ref | None, sinks: Ref | None, scale: float, max_bias: float,
                 alibi: tuple[float, ...] | None):
        out, x = out.padded(), x.padded()
        self.scale, self.max_bias = float(scale), float(max_bias)
        self.alibi = alibi                  # per-head slopes (static; None when max_bias == 0)
        self.has_mask, self.has_sinks = mask is not None, sinks is not None
        self.mask_dtype = mask.dtype.name if mask is not None else ""
        ints = list(out.shape) + list(out.strides) + list(x.strides)
        if mask is not None:
            m = mask.padded()
            ints += list(m.shape) + list(m.strides)
        self.n_ptrs = 2 + int(self.has_mask) + int(self.has_sinks)
        super().__init__(ints)

    def config(self) -> tuple:
        return (self.scale, self.max_bias, self.alibi, self.has_mask, self.has_sinks, self.mask_dtype)

    def emit(self, em: Emitter, a) -> None:
        b = em.b
        shape, ostr, xstr = a.ints[0:4], a.ints[4:8], a.ints[8:12]
        n = shape[3]
        rows = em.n_rows(shape)
        r0, r1 = em.split(rows, a.ith, a.nth)
        ptrs = list(a.ptrs)
        if self.has_mask:
            msh, mst = a.ints[12:16], a.ints[16:20]
        with em.loop(r0, r1, name="row") as r:
            i2 = em.rem(r, shape[2])
            head = em.rem(em.div(r, shape[2]), shape[1])
            i0 = em.div(em.div(r, shape[2]), shape[1])
            xrow = row_pointer(em, ptrs[1], r, shape[:3], xstr[:3])
            yrow = row_pointer(em, ptrs[0], r, shape[:3], ostr[:3])
            slope = em.f32(1.0)
            if self.alibi is not None:
                table = _const_table(em, "alibi", self.alibi)
                slope = em.load(F32, table, em.mul(head, 4))
            mrow = None
            if self.has_mask:
                off = em.offset((em.rem(i0, msh[0]), em.rem(head, msh[1]), i2), mst[:3])
                mrow = em.gep(ptrs[2], off)
            # w = x*scale (+ slope*mask), kept in y; then the row max
            mx = em.var(F32, em.f32(float("-inf")))
            with em.loop(0, n, name="w") as c:
                w = b.fmul(load_row_value(em, xrow, c, "f32", xstr[3]), em.f32(self.scale))
                if mrow is not None:
                    m = load_row_value(em, mrow, c, self.mask_dtype, mst[3])
                    w = em.fma(slope, m, w) if self.alibi is not None else b.fadd(w, m)
                em.store(w, yrow, em.mul(c, ostr[3]))
                em.set(mx, _np_max(em, em.get(mx), w))
            row_max = em.get(mx)
            sink = None
            if self.has_sinks:
                sink = em.load(F32, ptrs[-1], em.mul(head, 4))
                row_max = _np_max(em, row_max, sink)
            total = _exp_row(em, yrow, n, ostr[3], row_max)
            if sink is not None:
                total = b.fadd(total, b.fpext(vmath.expf(em, b.fsub(sink, row_max)), F64))
            inv = b.fptrunc(b.fdiv(ir.Constant(F64, 1.0), total), F32)
            with em.loop(0, n, name="norm") as c:
                y = em.load(F32, yrow, em.mul(c, ostr[3]))
                em.store(b.fmul(y, inv), yrow, em.mul(c, ostr[3]))


def _np_max(em: Emitter, acc, x):
    """np.max semantics: NaN wins."""
    b = em.b
    is_nan = b.fcmp_unordered("uno", x, x)
    bigger = b.fcmp_ordered(">", x, acc)
    return b.select(b.or_(is_nan, bigger), x, acc)


def _exp_row(em: Emitter, row, n, step, row_max) -> ir.Value:
    """row[i] = exp(row[i] - max) in place (v_expf on the profile's vectors, libm expf tail); returns
    the double sum (ggml_vec_soft_max_f32). Assumes a contiguous row when step is the f32 size."""
    b = em.b
    acc = em.var(F64, ir.Constant(F64, 0.0))
    lanes = vmath.lanes(em)
    chunks = em.mul(em.div(n, lanes), lanes)
    mvec = em.splat(row_max, lanes)
    contiguous = isinstance(step, int) and step == 4
    with em.loop(0, chunks, lanes, name="exp") as c:
        if contiguous:
            x = em.load(vec(F32, lanes), row, em.mul(c, 4))
        else:
            x = ir.Constant(vec(F32, lanes), None)
            for j in range(lanes):
                x = b.insert_element(x, em.load(F32, row, em.mul(em.add(c, j), step)), ir.Constant(I32, j))
        e = vmath.v_expf(em, b.fsub(x, mvec))
        if contiguous:
            em.store(e, row, em.mul(c, 4))
        else:
            for j in range(lanes):
                em.store(b.extract_element(e, ir.Constant(I32, j)), row, em.mul(em.add(c, j), step))
        em.set(acc, b.fadd(em.get(acc), b.fpext(em.reduce_add_tree(e), F64)))
    with em.loop(chunks, n, name="exptail") as c:
        e = vmath.expf(em, b.fsub(em.load(F32, row, em.mul(c, step)), row_max))
        em.store(e, row, em.mul(c, step))
        em.set(acc, b.fadd(em.get(acc), b.fpext(e, F64)))
    return em.get(acc)


def _const_table(em: Emitter, name: str, values: tuple[float, ...]) -> ir.Value:
    """A private constant f32 array in the module (deduplicated by contents)."""
    key = f"{name}_{abs(hash(values)):x}"
    if key in em.module.globals:
        return em.module.globals[key]
    ty = ir.ArrayType(F32, len(values))
    g = ir.GlobalVariable(em.module, ty, key)
    g.initializer = ir.Constant(ty, [float(v) for v in values])
    g.global_constant = True
    g.linkage = "private"
    return g


class RowSum(Kernel):
    """y[..., 0] = sum (or mean) of each row, the sum in order in a double."""

    def __init__(self, out: Ref, x: Ref, mean: bool):
        out, x = out.padded(), x.padded()
        self.mean = mean
        self.dtypes = (out.dtype.name, x.dtype.name)
        self.n_ptrs = 2
        super().__init__(list(x.shape) + list(out.strides) + list(x.strides))

    def config(self) -> tuple:
        return (self.mean, self.dtypes)

    def emit(self, em: Emitter, a) -> None:
        b = em.b
        shape, ostr, xstr = a.ints[0:4], a.ints[4:8], a.ints[8:12]
        rows = em.n_rows(shape)
        r0, r1 = em.split(rows, a.ith, a.nth)
        with em.loop(r0, r1, name="row") as r:
            xrow = row_pointer(em, a.ptrs[1], r, shape[:3], xstr[:3])
            yrow = row_pointer(em, a.ptrs[0], r, shape[:3], ostr[:3])
            s = b.fptrunc(_sum_f64(em, shape[3], lambda c: load_row_value(em, xrow, c, self.dtypes[1], xstr[3])), F32)
            if self.mean:
                s = b.fdiv(s, b.sitofp(em.i64(shape[3]), F32))
            em.store(em.from_f32(s, self.dtypes[0]), yrow)


class TotalSum(Kernel):
    """y[0] = sum of all elements: each row summed in a double, then the row sums in order."""

    def __init__(self, out: Ref, x: Ref):
        x = x.padded()
        self.dtypes = (out.dtype.name, x.dtype.name)
        self.n_ptrs = 2
        super().__init__(list(x.shape) + list(x.strides))

    def config(self) -> tuple:
        return self.dtypes

    def emit(self, em: Emitter, a) -> None:
        b = em.b
        shape, xstr = a.ints[0:4], a.ints[4:8]
        rows = em.n_rows(shape)
        with em.if_(b.icmp_signed("==", a.ith, ir.Constant(I64, 0))):
            acc = em.var(F64, ir.Constant(F64, 0.0))
            with em.loop(0, rows, name="row") as r:
                xrow = row_pointer(em, a.ptrs[1], r, shape[:3], xstr[:3])
                s = _sum_f64(em, shape[3], lambda c: load_row_value(em, xrow, c, self.dtypes[1], xstr[3]))
                em.set(acc, b.fadd(em.get(acc), s))
            em.store(em.from_f32(b.fptrunc(em.get(acc), F32), self.dtypes[0]), a.ptrs[0])


class RowArgmax(Kernel):
    """y[r] = ggml_vec_argmax_f32 of f32 row r: m = m > x ? m : x from m = -inf, idx = i whenever
    m == x (the last of equal maxima; NaN restarts the maximum). One i32 per row."""

    # the shape is only loop bounds: every argmax shares one function, and LLVM 22 never sees a
    # constant trip count (vectorizing and unrolling this loop at 31..33 columns does not terminate)
    runtime_ints = (0, 1, 2, 3)

    def __init__(self, out: Ref, x: Ref):
        x, out = x.padded(), out.padded()
        self.n_ptrs = 2
        super().__init__(list(x.shape) + list(x.strides) + [out.strides[3]])

    def emit(self, em: Emitter, a) -> None:
        b = em.b
        shape, xstr, ostep = a.ints[0:4], a.ints[4:8], a.ints[8]
        rows = em.n_rows(shape)
        r0, r1 = em.split(rows, a.ith, a.nth)
        with em.loop(r0, r1, name="row") as r:
            xrow = row_pointer(em, a.ptrs[1], r, shape[:3], xstr[:3])
            running = em.var(F32, em.f32(float("-inf")))
            idx = em.var(I64, ir.Constant(I64, 0))
            with em.loop(0, shape[3], name="col") as c:
                x = load_row_value(em, xrow, c, "f32", xstr[3])
                m = em.fmax(em.get(running), x)
                em.set(running, m)
                em.set(idx, b.select(b.fcmp_ordered("==", m, x), c, em.get(idx)))
            em.store(b.trunc(em.get(idx), I32), a.ptrs[0], em.mul(r, ostep))


class RowCumsum(Kernel):
    """y[..., i] = y[..., i - 1] + x[..., i] along each f32 row, in order in f32 (ggml_vec_cumsum_f32)."""

    runtime_ints = (0, 1, 2, 3)     # the shape is only loop bounds: every cumsum shares one function

    def __init__(self, out: Ref, x: Ref):
        out, x = out.padded(), x.padded()
        self.n_ptrs = 2
        super().__init__(list(x.shape) + list(out.strides) + list(x.strides))

    def emit(self, em: Emitter, a) -> None:
        b = em.b
        shape, ostr, xstr = a.ints[0:4], a.ints[4:8], a.ints[8:12]
        rows = em.n_rows(shape)
        r0, r1 = em.split(rows, a.ith, a.nth)
        with em.loop(r0, r1, name="row") as r:
            xrow = row_pointer(em, a.ptrs[1], r, shape[:3], xstr[:3])
            yrow = row_pointer(em, a.ptrs[0], r, shape[:3], ostr[:3])
            # -0.0 + x is x for every x (a -0.0 stays -0.0), so y[0] = x[0] exactly as ggml stores it
            acc = em.var(F32, em.f32(-0.0))
            with em.loop(0, shape[3], name="col") as c:
                em.set(acc, b.fadd(em.get(acc), load_row_value(em, xrow, c, "f32", xstr[3])))
                em.store(em.get(acc), yrow, em.mul(c, ostr[3]))


class Sort(Kernel):
    """Stable argsort of each f32 row (ascending or descending), keeping the first k indices.
    Bottom-up merge sort in a per-thread scratch of 2n int32."""

    def __init__(self, out: Ref, x: Ref, descending: bool, k: int | None):
        out, x = out.padded(), x.padded()
        self.descending = descending
        self.k = k
        self.n_ptrs = 3
        super().__init__(list(x.shape) + list(out.strides) + list(x.strides))

    def config(self) -> tuple:
        return (self.descending, self.k)

    def emit(self, em: Emitter, a) -> None:
        b = em.b
        shape, ostr, xstr = a.ints[0:4], a.ints[4:8], a.ints[8:12]
        n = shape[3]
        rows = em.n_rows(shape)
        r0, r1 = em.split(rows, a.ith, a.nth)
        scratch = a.ptrs[2]
        with em.loop(r0, r1, name="row") as r:
            xrow = row_pointer(em, a.ptrs[1], r, shape[:3], xstr[:3])
            yrow = row_pointer(em, a.ptrs[0], r, shape[:3], ostr[:3])
            src, dst = em.var(ir.PointerType(), scratch), em.var(ir.PointerType(), em.gep(scratch, em.mul(n, 4)))
            with em.loop(0, n, name="init") as c:
                em.store(b.trunc(c, I32), scratch, em.mul(c, 4))
            width = em.var(I64, ir.Constant(I64, 1))
            head = em.fn.append_basic_block("pass")
            body = em.fn.append_basic_block("passbody")
            done = em.fn.append_basic_block("sorted")
            b.branch(head)
            b.position_at_end(head)
            b.cbranch(em.icmp("<", em.get(width), n), body, done)
            b.position_at_end(body)
            w = em.get(width)
            self._merge_pass(em, xrow, xstr[3], em.get(src), em.get(dst), n, w)
            s, d = em.get(src), em.get(dst)
            em.set(src, d)
            em.set(dst, s)
            em.set(width, b.mul(w, ir.Constant(I64, 2)))
            b.branch(head)
            b.position_at_end(done)
            final = em.get(src)
            keep = n if self.k is None else self.k
            with em.loop(0, keep, name="out") as c:
                em.store(em.load(I32, final, em.mul(c, 4)), yrow, em.mul(c, ostr[3]))

    def _merge_pass(self, em: Emitter, xrow, xstep, src, dst, n, w) -> None:
        b = em.b
        lo = em.var(I64, ir.Constant(I64, 0))
        head = em.fn.append_basic_block("blocks")
        body = em.fn.append_basic_block("block")
        done = em.fn.append_basic_block("blocksdone")
        b.branch(head)
        b.position_at_end(head)
        b.cbranch(em.icmp("<", em.get(lo), n), body, done)
        b.position_at_end(body)
        start = em.get(lo)
        mid = em.min(em.add(start, w), n)
        end = em.min(em.add(start, em.mul(w, 2)), n)
        i, j = em.var(I64, em.i64(start)), em.var(I64, em.i64(mid))
        with em.loop(start, end, name="k") as k:
            ii, jj = em.get(i), em.get(j)
            left_ok = em.icmp("<", ii, mid)
            right_ok = em.icmp("<", jj, end)
            li = em.load(I32, src, em.mul(em.min(ii, em.sub(n, 1)), 4))
            rj = em.load(I32, src, em.mul(em.min(jj, em.sub(n, 1)), 4))
            lv = em.load(F32, xrow, em.mul(b.sext(li, I64), xstep))
            rv = em.load(F32, xrow, em.mul(b.sext(rj, I64), xstep))
            right_first = b.fcmp_ordered(">" if self.descending else "<", rv, lv)
            take_right = b.and_(right_ok, b.or_(b.not_(left_ok), right_first))
            em.store(b.select(take_right, rj, li), dst, em.mul(k, 4))
            em.set(i, b.select(take_right, ii, b.add(ii, ir.Constant(I64, 1))))
            em.set(j, b.select(take_right, b.add(jj, ir.Constant(I64, 1)), jj))
        em.set(lo, em.i64(end))
        b.branch(head)
        b.position_at_end(done)


class GroupNorm(Kernel):
    """ggml_group_norm over x [B, C, L, W]: each group of g channels normalised over (g, L, W)."""

    def __init__(self, out: Ref, x: Ref, n_groups: int, eps: float):
        out, x = out.padded(), x.padded()
        self.n_groups, self.eps = n_groups, float(eps)
        self.dtypes = (out.dtype.name, x.dtype.name)
        self.n_ptrs = 2
        super().__init__(list(x.shape) + list(out.strides) + list(x.strides))

    def config(self) -> tuple:
        return (self.n_groups, self.eps, self.dtypes)

    def emit(self, em: Emitter, a) -> None:
        b = em.b
        shape, ostr, xstr = a.ints[0:4], a.ints[4:8], a.ints[8:12]
        channels = shape[1]
        per = em.cdiv(channels, self.n_groups)
        n_groups = em.cdiv(channels, per)
        units = em.mul(shape[0], n_groups)
        u0, u1 = em.split(units, a.ith, a.nth)
        with em.loop(u0, u1, name="group") as u:
            bi = em.div(u, n_groups)
            c0 = em.mul(em.rem(u, n_groups), per)
            c1 = em.min(em.add(c0, per), channels)
            count = b.sitofp(em.i64(em.mul(em.mul(em.sub(c1, c0), shape[2]), shape[3])), F64)

            def total(term) -> ir.Value:
                """ggml's group sums: each row's terms into a double, the row sums added in order."""
                acc = em.var(F64, ir.Constant(F64, 0.0))
                with em.loop(c0, c1, name="ch") as c, em.loop(0, shape[2], name="l") as li:
                    row = em.var(F64, ir.Constant(F64, 0.0))
                    with em.loop(0, shape[3], name="w") as wi:
                        em.set(row, b.fadd(em.get(row), b.fpext(term(value(c, li, wi)), F64)))
                    em.set(acc, b.fadd(em.get(acc), em.get(row)))
                return em.get(acc)

            def value(c, li, wi):
                xo = em.offset((bi, c, li, wi), xstr)
                return em.to_f32(em.load(storage_type(self.dtypes[1]), a.ptrs[1], xo), self.dtypes[1])

            mean = b.fptrunc(b.fdiv(total(lambda x: x), count), F32)
            v = b.fptrunc(b.fdiv(total(lambda x: b.fmul(b.fsub(x, mean), b.fsub(x, mean))), count), F32)
            scale = b.fdiv(em.f32(1.0), _sqrt(em, b.fadd(v, em.f32(self.eps))))
            with em.loop(c0, c1, name="ch") as c, em.loop(0, shape[2], name="l") as li, \
                    em.loop(0, shape[3], name="w") as wi:
                yo = em.offset((bi, c, li, wi), ostr)
                em.store(em.from_f32(b.fmul(b.fsub(value(c, li, wi), mean), scale), self.dtypes[0]), a.ptrs[0], yo)
