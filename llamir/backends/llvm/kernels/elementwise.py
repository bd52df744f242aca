"""Element-wise kernels: one loop nest per fused chain of element-wise ops.

A chain (add, mul, scale, unary functions, GLUs, casts, copies) whose inner values have a single
user and the same shape becomes one expression tree over the chain's inputs, evaluated in one
pass: each thread takes whole rows; each row runs chunks of the profile's vector width (ggml's chunking,
which decides how silu rounds) and then a scalar tail. Inputs may be any strided view, and are
tiled ggml-style (an axis of size 1 broadcasts, a smaller one repeats).

Tree nodes (hashable tuples, part of the kernel key):
    ("x", i)  ("c", value)  ("un", name, f32_lanes, a)  ("bin", op, a, b)  ("scale", s, b, a)
    ("clamp", lo, hi, a)  ("glu", kind, f32_lanes, a, b)  ("round", dtype, a)
"""

from __future__ import annotations

import math

import llvmlite.ir as ir

from llamir.backends.llvm import expr as E
from llamir.backends.llvm import vmath
from llamir.backends.llvm.emit import F32, I32, Emitter, storage_type, vec
from llamir.backends.llvm.plan import Kernel, Part, Ref

FLOAT_STORAGE = ("f32", "f16", "bf16")
INT_STORAGE = ("i8", "i16", "i32", "i64")


def axis_modes(src: tuple, dst: tuple) -> tuple[str, ...]:
    """Per axis (both padded to rank 4): "eq" same extent, "one" broadcast, "mod" tiled."""
    return tuple("eq" if s == d else ("one" if s == 1 else "mod") for s, d in zip(src, dst, strict=True))


class Elementwise(Kernel):
    """y = tree(inputs) over y's (padded rank-4) shape; thread ith takes rows of y."""

    def __init__(self, tree: tuple, out: Ref, inputs: list[Ref], raw: bool = False):
        self.tree = tree
        self.raw = raw                       # a plain copy: move storage units, no float conversion
        out = out.padded()
        inputs = [r.padded() for r in inputs]
        self.out_dtype = out.dtype.name
        self.in_dtypes = tuple(r.dtype.name for r in inputs)
        self.modes = tuple(axis_modes(r.shape, out.shape) for r in inputs)
        # a unit's bytes come from its dtype, never from the last stride: a transposed or strided
        # view's last stride is not its element size, and only a unit step may load a vector
        self.elem_sizes = (_unit_bytes(out),) + tuple(_unit_bytes(r) for r in inputs)
        ints = list(out.shape) + list(out.strides)
        for r in inputs:
            ints += list(r.shape) + list(r.strides)
        self.n_ptrs = 1 + len(inputs)
        super().__init__(ints)

    def config(self) -> tuple:
        return (self.tree, self.raw, self.out_dtype, self.in_dtypes, self.modes)

    def emit(self, em: Emitter, a) -> None:
        ints = a.ints
        shape, ostr = ints[0:4], ints[4:8]
        ins = [(ints[8 + 8 * i:12 + 8 * i], ints[12 + 8 * i:16 + 8 * i]) for i in range(len(self.in_dtypes))]
        n_rows = em.n_rows(shape)
        cols = shape[3]
        r0, r1 = em.split(n_rows, a.ith, a.nth)
        with em.loop(r0, r1, name="row") as r:
            i2 = em.rem(r, shape[2])
            rest = em.div(r, shape[2])
            i1 = em.rem(rest, shape[1])
            i0 = em.div(rest, shape[1])
            idx = (i0, i1, i2)
            out_row = em.gep(a.ptrs[0], _dot(em, idx, ostr[:3]))
            rows = []
            for (ishape, istr), modes, ptr in zip(ins, self.modes, a.ptrs[1:], strict=True):
                off = 0
                for ax in range(3):
                    off = em.add(off, em.mul(_index(em, idx[ax], modes[ax], ishape[ax]), istr[ax]))
                rows.append(em.gep(ptr, off))
            self._row(em, out_row, rows, cols, ostr[3], [s[3] for _, s in ins], [s[3] for s, _ in ins])

    def _row(self, em: Emitter, out_row, rows, cols, out_step, in_steps, in_lens) -> None:
        lanes = vmath.lanes(em)   # v_silu's chunks are the profile's vectors; the tail is scalar
        chunks = em.mul(em.div(cols, lanes), lanes)
        with em.loop(0, chunks, lanes, name="col") as c:
            values = [self._load(em, rows[i], c, lanes, in_steps[i], in_lens[i], i) for i in range(len(rows))]
            self._store(em, out_row, c, self._value(em, values, lanes), out_step)
        with em.loop(chunks, cols, name="tail") as c:
            values = [self._load(em, rows[i], c, 0, in_steps[i], in_lens[i], i) for i in range(len(rows))]
            self._store(em, out_row, c, self._value(em, values, 0), out_step)

    def _value(self, em: Emitter, values, lanes: int):
        if self.raw:
            return values[0]
        return eval_tree(em, self.tree, values, lanes)

    def _load(self, em: Emitter, row, c, lanes: int, step, length, i: int):
        dtype = self.in_dtypes[i]
        mode = self.modes[i][3]
        ety = storage_type(dtype)
        size = self.elem_sizes[1 + i]
        if mode == "one":
            x = em.load(ety, row, 0)
            x = self._convert_in(em, x, dtype)
            return em.splat(x, lanes) if lanes else x
        contiguous = mode == "eq" and isinstance(step, int) and step == size
        if lanes and contiguous:
            x = em.load(vec(ety, lanes), row, em.mul(c, size))
            return self._convert_in(em, x, dtype)
        if not lanes:
            col = em.rem(c, length) if mode == "mod" else c
            return self._convert_in(em, em.load(ety, row, em.mul(col, step)), dtype)
        out = ir.Constant(vec(F32 if not self.raw else ety, lanes), None)
        for j in range(lanes):
            col = em.add(c, j)
            if mode == "mod":
                col = em.rem(col, length)
            x = self._convert_in(em, em.load(ety, row, em.mul(col, step)), dtype)
            out = em.b.insert_element(out, x, ir.Constant(I32, j))
        return out

    def _convert_in(self, em: Emitter, x, dtype: str):
        return x if self.raw else em.to_f32(x, dtype)

    def _store(self, em: Emitter, out_row, c, value, step) -> None:
        size = self.elem_sizes[0]
        y = value if self.raw else em.from_f32(value, self.out_dtype)
        if not isinstance(value.type, ir.VectorType):
            em.store(y, out_row, em.mul(c, step))
        elif isinstance(step, int) and step == size:
            em.store(y, out_row, em.mul(c, size))
        else:
            for j in range(value.type.count):
                em.store(em.b.extract_element(y, ir.Constant(I32, j)), out_row, em.mul(em.add(c, j), step))


def _unit_bytes(ref: Ref) -> int:
    """The bytes of one element of `ref` (quantized rows come as bytes: elementwise_lower._bytes)."""
    if ref.dtype.block_size != 1:
        raise ValueError(f"element-wise kernels take whole elements, got {ref.dtype.name} of shape {ref.shape}")
    return ref.dtype.type_size


def _index(em: Emitter, i, mode: str, n):
    if mode == "eq":
        return i
    if mode == "one":
        return 0
    return em.rem(i, n)


def _dot(em: Emitter, idx, strides):
    off = 0
    for i, s in zip(idx, strides, strict=True):
        off = em.add(off, em.mul(i, s))
    return off


# -- the expression tree ---------------------------------------------------------------------
def _c(em: Emitter, value: float, lanes: int):
    return vmath.splat(em, value, lanes) if lanes else ir.Constant(F32, value)


def eval_tree(em: Emitter, t: tuple, values: list, lanes: int):
    """The f32 value (a vector of `lanes`, or a scalar when lanes == 0) of tree `t`."""
    kind = t[0]
    b = em.b
    if kind == "x":
        return values[t[1]]
    if kind == "c":
        return _c(em, t[1], lanes)
    if kind == "bin":
        x, y = eval_tree(em, t[2], values, lanes), eval_tree(em, t[3], values, lanes)
        return {"add": b.fadd, "sub": b.fsub, "mul": b.fmul, "div": b.fdiv}[t[1]](x, y)
    if kind == "scale":
        _, s, bias, sub = t
        x = b.fmul(eval_tree(em, sub, values, lanes), _c(em, s, lanes))
        return b.fadd(x, _c(em, bias, lanes)) if bias else x
    if kind == "clamp":
        _, lo, hi, sub = t
        x = eval_tree(em, sub, values, lanes)
        return em.fmin(em.fmax(x, _c(em, lo, lanes)), _c(em, hi, lanes))
    if kind == "un":
        _, name, f32_lanes, sub = t
        return unary(em, name, eval_tree(em, sub, values, lanes), lanes, f32_lanes)
    if kind == "glu":
        _, name, f32_lanes, ta, tb = t
        act = {"swiglu": "silu", "geglu": "gelu", "reglu": "relu", "geglu_erf": "gelu_erf",
               "geglu_quick": "gelu_quick"}[name]
        x = unary(em, act, eval_tree(em, ta, values, lanes), lanes, f32_lanes)
        return b.fmul(x, eval_tree(em, tb, values, lanes))
    if kind == "round":
        _, dtype, sub = t
        return em.to_f32(em.from_f32(eval_tree(em, sub, values, lanes), dtype), dtype)
    raise ValueError(f"unknown element-wise tree node {t!r}")


def unary(em: Emitter, name: str, x, lanes: int, f32_lanes: bool):
    """One unary function, as the reference kernel computes it (libm where ggml uses libm)."""
    b = em.b

    def c(v):
        return _c(em, v, lanes)

    if name == "neg":
        return b.fneg(x)
    if name == "abs":
        return em.intrinsic(f"llvm.fabs.{f'v{lanes}f32' if lanes else 'f32'}", x.type, [x])
    if name == "sgn":
        pos = b.select(b.fcmp_ordered(">", x, c(0.0)), c(1.0), c(0.0))
        return b.select(b.fcmp_ordered("<", x, c(0.0)), c(-1.0), pos)
    if name == "step":
        return b.select(b.fcmp_ordered(">", x, c(0.0)), c(1.0), c(0.0))
    if name == "relu":
        return b.select(b.fcmp_ordered(">", x, c(0.0)), x, c(0.0))
    if name == "sqr":
        return b.fmul(x, x)
    if name == "sqrt":
        return em.intrinsic(f"llvm.sqrt.{f'v{lanes}f32' if lanes else 'f32'}", x.type, [x])
    if name == "silu":
        if lanes and f32_lanes:
            return vmath.v_silu(em, x)
        return vmath.silu_scalar(em, x)
    if name == "sigmoid":
        return b.fdiv(c(1.0), b.fadd(c(1.0), vmath.expf(em, b.fneg(x))))
    if name == "exp":
        return vmath.expf(em, x)
    if name in ("tanh", "log", "sin", "cos"):
        return vmath.libm(em, name + "f", x)
    if name == "elu":
        return b.select(b.fcmp_ordered(">", x, c(0.0)), x, vmath.libm(em, "expm1f", x))
    if name == "softplus":   # ggml's op_softplus: x > 20 ? x : logf(1 + expf(x))
        soft = vmath.libm(em, "logf", b.fadd(c(1.0), vmath.expf(em, x)))
        return b.select(b.fcmp_ordered(">", x, c(20.0)), x, soft)
    if name == "hardsigmoid":
        return em.fmin(em.fmax(b.fdiv(b.fadd(x, c(3.0)), c(6.0)), c(0.0)), c(1.0))
    if name == "hardswish":
        return b.fmul(x, em.fmin(em.fmax(b.fdiv(b.fadd(x, c(3.0)), c(6.0)), c(0.0)), c(1.0)))
    if name == "gelu_erf":
        erf = vmath.libm(em, "erff", b.fmul(x, c(float(1 / math.sqrt(2)))))
        return b.fmul(b.fmul(c(0.5), x), b.fadd(c(1.0), erf))
    if name == "gelu":
        return _gelu(em, x, lanes, f32_lanes)
    if name == "gelu_quick":
        return _gelu_quick(em, x, lanes, f32_lanes)
    raise ValueError(f"no lowering for unary {name}")


def _gelu_f32(em: Emitter, x, lanes: int):
    b = em.b

    def c(v):
        return _c(em, v, lanes)

    # ggml_gelu_f32: 0.5f*x*(1.0f + tanhf(SQRT_2_OVER_PI*x*(1.0f + GELU_COEF_A*x*x))), GCC fusing
    # the innermost 1 + (a*x)*x
    inner = b.fmul(b.fmul(c(float(math.sqrt(2 / math.pi))), x), em.fma(b.fmul(c(0.044715), x), x, c(1.0)))
    return b.fmul(b.fmul(c(0.5), x), b.fadd(c(1.0), vmath.libm(em, "tanhf", inner)))


def _round_f16(em: Emitter, x):
    return em.to_f32(em.from_f32(x, "f16"), "f16")


def _gelu(em: Emitter, x, lanes: int, table: bool):
    """ggml's gelu: an f16 lookup table of gelu_f32 (x rounded to f16), +-10 clamps; bf16 exact."""
    if not table:
        return _gelu_f32(em, x, lanes)
    b = em.b
    y = _round_f16(em, _gelu_f32(em, _round_f16(em, x), lanes))
    y = b.select(b.fcmp_ordered(">=", x, _c(em, 10.0, lanes)), x, y)
    return b.select(b.fcmp_ordered("<=", x, _c(em, -10.0, lanes)), _c(em, 0.0, lanes), y)


def _gelu_quick(em: Emitter, x, lanes: int, table: bool):
    b = em.b
    xh = _round_f16(em, x) if table else x
    y = b.fmul(xh, unary(em, "sigmoid", b.fmul(_c(em, 1.702, lanes), xh), lanes, False))
    return _round_f16(em, y) if table else y


def row_part(ref: Ref) -> Part | None:
    """The row split of a contiguous tensor (one unit per row of its last axis)."""
    if not ref.is_contiguous:
        return None
    return Part(ref.buf, ref.offset, ref.row_bytes(), E.prod(ref.shape[:-1]) if ref.rank > 1 else 1)
