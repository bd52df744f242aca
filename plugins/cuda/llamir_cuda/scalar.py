"""Scalar code written as C reads: f32 and i32 values with Python's operators, mutable locals,
thread-private arrays and counted loops over a KernelBuilder.

Each operator is one IR instruction rounded on its own, in the order written (LLVM contracts
nothing without fast-math flags, and NVPTX prints `mul.rn` / `add.rn`, which ptxas does not
fuse), so a transcription of ggml's reference C computes what the C computes, bit for bit.
Floats compare ordered (a NaN compares false), ints signed; `>>` is C's signed shift.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from llvmlite import ir

from llamir_cuda import kir
from llamir_cuda.kir import F32, I32


class Val:
    """An f32, i32 or i1 value of a kernel being built."""

    __slots__ = ("k", "v")

    def __init__(self, k: kir.KernelBuilder, v: ir.Value):
        self.k, self.v = k, v

    @property
    def is_float(self) -> bool:
        return self.v.type == F32

    def _lift(self, other) -> ir.Value:
        if isinstance(other, Val):
            return other.v
        if isinstance(other, ir.Value):
            return other
        return ir.Constant(self.v.type, float(other) if self.is_float else int(other))

    def _op(self, other, float_op: str, int_op: str, swap: bool = False) -> Val:
        a, c = self.v, self._lift(other)
        if swap:
            a, c = c, a
        return Val(self.k, getattr(self.k.b, float_op if self.is_float else int_op)(a, c))

    def __add__(self, o):
        return self._op(o, "fadd", "add")

    def __radd__(self, o):
        return self._op(o, "fadd", "add", swap=True)

    def __sub__(self, o):
        return self._op(o, "fsub", "sub")

    def __rsub__(self, o):
        return self._op(o, "fsub", "sub", swap=True)

    def __mul__(self, o):
        return self._op(o, "fmul", "mul")

    def __rmul__(self, o):
        return self._op(o, "fmul", "mul", swap=True)

    def __truediv__(self, o):
        return self._op(o, "fdiv", "sdiv")

    def __rtruediv__(self, o):
        return self._op(o, "fdiv", "sdiv", swap=True)

    def __neg__(self):
        return Val(self.k, self.k.b.fneg(self.v)) if self.is_float else Val(self.k, self.k.b.neg(self.v))

    def __and__(self, o):
        return Val(self.k, self.k.b.and_(self.v, self._lift(o)))

    def __or__(self, o):
        return Val(self.k, self.k.b.or_(self.v, self._lift(o)))

    def __rshift__(self, o):
        return Val(self.k, self.k.b.ashr(self.v, self._lift(o)))

    def __lshift__(self, o):
        return Val(self.k, self.k.b.shl(self.v, self._lift(o)))

    def _cmp(self, op: str, other) -> Val:
        b = self.k.b
        c = self._lift(other)
        return Val(self.k, b.fcmp_ordered(op, self.v, c) if self.is_float else b.icmp_signed(op, self.v, c))

    def __lt__(self, o):
        return self._cmp("<", o)

    def __le__(self, o):
        return self._cmp("<=", o)

    def __gt__(self, o):
        return self._cmp(">", o)

    def __ge__(self, o):
        return self._cmp(">=", o)

    def eq(self, o) -> Val:
        return self._cmp("==", o)

    def ne(self, o) -> Val:
        """!= (for floats: ordered, so a NaN is not != 0, as `d ? a : b` in C would have it true;
        the quantizers never see one)."""
        return self._cmp("!=", o)


def f32(k: kir.KernelBuilder, x: float) -> Val:
    return Val(k, k.f32(x))


def i32(k: kir.KernelBuilder, n: int) -> Val:
    return Val(k, k.i32(n))


def lift(k: kir.KernelBuilder, v: Val | ir.Value | int) -> Val:
    """An i32 Val of a Python int, or a Val of an IR value."""
    if isinstance(v, Val):
        return v
    return Val(k, v) if isinstance(v, ir.Value) else i32(k, v)


def select(cond: Val, a: Val, c: Val | float | int) -> Val:
    return Val(a.k, a.k.b.select(cond.v, a.v, a._lift(c)))


def to_float(v: Val) -> Val:
    """(float) of an int."""
    return Val(v.k, v.k.b.sitofp(v.v, F32))


def to_int(v: Val) -> Val:
    """(int) of a float: truncation toward zero."""
    return Val(v.k, v.k.b.fptosi(v.v, I32))


def nearest_int(v: Val) -> Val:
    """ggml's nearest_int: round half to even (its 1.5 * 2^23 trick, for |v| < 2^22)."""
    return to_int(Val(v.k, v.k.rint(v.v)))


def fabs(v: Val) -> Val:
    return Val(v.k, v.k.fabs(v.v))


def sqrt(v: Val) -> Val:
    return Val(v.k, v.k.sqrt(v.v))


def fmax(a: Val, c: Val | float) -> Val:
    return Val(a.k, a.k.fmax(a.v, a._lift(c)))


def fmin(a: Val, c: Val | float) -> Val:
    return Val(a.k, a.k.fmin(a.v, a._lift(c)))


def exp(v: Val) -> Val:
    return Val(v.k, v.k.exp(v.v))


def log(v: Val) -> Val:
    return Val(v.k, v.k.log(v.v))


def tanh(v: Val) -> Val:
    return Val(v.k, v.k.tanh(v.v))


def erf(v: Val) -> Val:
    return Val(v.k, v.k.erf(v.v))


def imin(a: Val, c: Val | int) -> Val:
    """C's MIN of two ints."""
    return select(a < c, a, c)


def imax(a: Val, c: Val | int) -> Val:
    return select(a > c, a, c)


def clamp(v: Val, lo: int, hi: int) -> Val:
    """MAX(lo, MIN(hi, v)) of an int."""
    return imax(imin(v, hi), lo)


def f16_round(v: Val) -> Val:
    """An f32 through the f16 a block stores (GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(v)))."""
    return Val(v.k, v.k.h2f(v.k.f2h(v.v)))


class Var:
    """A mutable local of f32 or i32."""

    def __init__(self, k: kir.KernelBuilder, init: Val | float | int):
        init = init if isinstance(init, Val) else f32(k, init) if isinstance(init, float) else i32(k, init)
        self.k, self.ty = k, init.v.type
        self.slot = k.var(self.ty, init.v)

    def get(self) -> Val:
        return Val(self.k, self.k.get(self.slot, self.ty))

    def set(self, value: Val | float | int) -> None:
        self.k.set(self.slot, value.v if isinstance(value, Val) else ir.Constant(self.ty, value))


class Array:
    """A thread-private array of f32 or i32 (kir's local), indexed by Val or int."""

    def __init__(self, k: kir.KernelBuilder, ty: ir.Type, count: int):
        self.k, self.ty = k, ty
        self.mem = k.local(ty, count)

    def __getitem__(self, i: Val | int) -> Val:
        return Val(self.k, self.k.sload(self.mem, lift(self.k, i).v))

    def __setitem__(self, i: Val | int, value: Val | float | int) -> None:
        v = value.v if isinstance(value, Val) else ir.Constant(self.ty, value)
        self.k.sstore(v, self.mem, lift(self.k, i).v)


@contextlib.contextmanager
def loop(k: kir.KernelBuilder, start: Val | int, stop: Val | int, step: int = 1) -> Iterator[Val]:
    """for (int i = start; i < stop; i += step)."""
    with k.loop(lift(k, start).v, lift(k, stop).v, step) as i:
        yield Val(k, i)


def when(cond: Val):
    """if (cond) { ... }"""
    return cond.k.if_then(cond.v)


def when_else(cond: Val):
    """if (cond) { ... } else { ... }: `with when_else(c) as (then, otherwise):`."""
    return cond.k.if_else(cond.v)


class Bytes:
    """The fields of a block at byte `base` (i64) of `ptr`: little-endian bytes and fp16."""

    def __init__(self, k: kir.KernelBuilder, ptr: ir.Value, base: ir.Value):
        self.k, self.ptr, self.base = k, ptr, base

    def _at(self, offset: Val | int) -> ir.Value:
        off = lift(self.k, offset).v
        return self.k.b.add(self.base, self.k.b.sext(off, kir.I64))

    def u8(self, offset: Val | int) -> Val:
        return Val(self.k, self.k.b.zext(self.k.load(self.ptr, kir.I8, self._at(offset)), I32))

    def i8(self, offset: Val | int) -> Val:
        return Val(self.k, self.k.b.sext(self.k.load(self.ptr, kir.I8, self._at(offset)), I32))

    def f16(self, offset: Val | int) -> Val:
        """The fp16 at an even offset, as f32."""
        return Val(self.k, self.k.h2f(self.k.load(self.ptr, kir.I16, self._at(offset), align=2)))

    def put_u8(self, offset: Val | int, v: Val) -> None:
        self.k.store(self.k.b.trunc(v.v, kir.I8), self.ptr, self._at(offset))

    def put_f16(self, offset: Val | int, v: Val) -> None:
        """v rounded to fp16 (to nearest even), at an even offset."""
        self.k.store(self.k.f2h(v.v), self.ptr, self._at(offset), align=2)

    def put_u32(self, offset: int, v: Val) -> None:
        """A 32-bit word at a 2-byte aligned offset (the qh of q5_0 / q5_1), as four bytes."""
        for i in range(4):
            self.put_u8(offset + i, (v >> (8 * i)) & 0xFF)
