"""Emitter: a thin layer over llvmlite's IRBuilder for writing kernels.

Integer arguments may be Python ints (compile-time constants, folded here) or i64 IR values,
so one kernel generator serves both static and run-time shapes. Loops are structured
(`with em.loop(a, b) as i:`), loop-carried values live in entry-block allocas (`em.var`),
which LLVM promotes to registers, and memory is addressed as a byte pointer plus offset.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import llvmlite.ir as ir

from llamir.backends.llvm.target import Target
from llamir.ir.numerics import AVX512, Numerics

I1, I8, I16, I32, I64 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
F16, F32, F64 = ir.HalfType(), ir.FloatType(), ir.DoubleType()
PTR = ir.PointerType()
VOID = ir.VoidType()
Val = int | ir.Value


def vec(t: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(t, n)


def _tname(t: ir.Type) -> str:
    """LLVM's overload suffix for a type: f32, v16f32, v8i32, ..."""
    if isinstance(t, ir.VectorType):
        return f"v{t.count}{_tname(t.element)}"
    if isinstance(t, ir.IntType):
        return f"i{t.width}"
    return {"float": "f32", "double": "f64", "half": "f16"}[str(t)]


class Emitter:
    """Builds one function's body."""

    def __init__(self, module: ir.Module, fn: ir.Function, target: Target, numerics: Numerics = AVX512):
        self.module = module
        self.fn = fn
        self.target = target
        self.numerics = numerics   # whose arithmetic the body reproduces (llamir.ir.numerics)
        self._entry = fn.append_basic_block("entry")
        self._body = fn.append_basic_block("body")
        self.b = ir.IRBuilder(self._body)
        self._alloca_builder = ir.IRBuilder(self._entry)

    def finish(self) -> None:
        """Close the function: the entry block jumps to the body; the body returns."""
        if not self.b.block.is_terminated:
            self.b.ret_void()
        self._alloca_builder.branch(self._body)

    # -- declarations -----------------------------------------------------------------------
    def declare(self, name: str, ret: ir.Type, args: Sequence[ir.Type], var_arg: bool = False) -> ir.Function:
        existing = self.module.globals.get(name)
        if existing is not None:
            return existing
        return ir.Function(self.module, ir.FunctionType(ret, list(args), var_arg=var_arg), name)

    def intrinsic(self, name: str, ret: ir.Type, args: Sequence[ir.Value]) -> ir.Value:
        fn = self.declare(name, ret, [a.type for a in args])
        return self.b.call(fn, list(args))

    def prefetch(self, ptr: ir.Value, offset: Val = 0, into_l1: bool = True) -> None:
        """A read prefetch of the cache line at ptr + offset, into L1 (or L2); never faults."""
        i32 = ir.IntType(32)
        self.intrinsic("llvm.prefetch.p0", ir.VoidType(), [self.gep(ptr, offset), ir.Constant(i32, 0),
                                                           ir.Constant(i32, 3 if into_l1 else 2), ir.Constant(i32, 1)])

    def prefetch_ahead(self, ptr: ir.Value, n_bytes: int, offset: Val = 0) -> None:
        """Prefetch the n_bytes a weight stream reads the target's prefetch distance after those
        at ptr + offset, into L1; called once per step of a loop that reads n_bytes a step. A step
        longer than that (a K-quant super-block) prefetches the next step into L2: a whole step's
        lines at once into L1 would hold up the loads behind the line-fill buffers (q6_k on
        Emerald Rapids: 10% slower)."""
        distance = self.target.prefetch_distance
        near = n_bytes <= distance
        ahead = distance if near else n_bytes
        for line in range(0, n_bytes, 64):
            self.prefetch(ptr, self.add(offset, ahead + line), into_l1=near)

    # -- integers -----------------------------------------------------------------------------
    def i64(self, v: Val) -> ir.Value:
        if isinstance(v, int):
            return ir.Constant(I64, v)
        if v.type == I64:
            return v
        return self.b.sext(v, I64)

    def i32(self, v: Val) -> ir.Value:
        if isinstance(v, int):
            return ir.Constant(I32, v)
        return v if v.type == I32 else self.b.trunc(v, I32)

    def add(self, a: Val, b: Val) -> Val:
        if isinstance(a, int) and isinstance(b, int):
            return a + b
        if a == 0:
            return b
        if b == 0:
            return a
        return self.b.add(self.i64(a), self.i64(b))

    def sub(self, a: Val, b: Val) -> Val:
        if isinstance(a, int) and isinstance(b, int):
            return a - b
        if b == 0:
            return a
        return self.b.sub(self.i64(a), self.i64(b))

    def mul(self, a: Val, b: Val) -> Val:
        if isinstance(a, int) and isinstance(b, int):
            return a * b
        if a == 1:
            return b
        if b == 1:
            return a
        if a == 0 or b == 0:
            return 0
        return self.b.mul(self.i64(a), self.i64(b))


    def n_rows(self, shape: Sequence[Val]) -> Val:
        """Rows of a padded rank-4 tensor: shape[0] * shape[1] * shape[2] (shape[3] is the row)."""
        return self.mul(self.mul(shape[0], shape[1]), shape[2])

    def offset(self, index: Sequence[Val], strides: Sequence[Val]) -> Val:
        """sum(index[k] * strides[k]): where element `index` is, in units of the strides."""
        total: Val = 0
        for i, st in zip(index, strides, strict=True):
            total = self.add(total, self.mul(i, st))
        return total
    def div(self, a: Val, b: Val) -> Val:
        """Floor division of non-negative values."""
        if isinstance(a, int) and isinstance(b, int):
            return a // b
        if b == 1:
            return a
        if isinstance(b, int) and b > 0 and b & (b - 1) == 0:
            return self.b.lshr(self.i64(a), ir.Constant(I64, b.bit_length() - 1))
        return self.b.udiv(self.i64(a), self.i64(b))

    def rem(self, a: Val, b: Val) -> Val:
        if isinstance(a, int) and isinstance(b, int):
            return a % b
        if b == 1:
            return 0
        if isinstance(b, int) and b > 0 and b & (b - 1) == 0:
            return self.b.and_(self.i64(a), ir.Constant(I64, b - 1))
        return self.b.urem(self.i64(a), self.i64(b))

    def cdiv(self, a: Val, b: Val) -> Val:
        return self.div(self.add(a, self.sub(b, 1)), b)

    def min(self, a: Val, b: Val) -> Val:
        if isinstance(a, int) and isinstance(b, int):
            return min(a, b)
        a, b = self.i64(a), self.i64(b)
        return self.b.select(self.b.icmp_signed("<", a, b), a, b)

    def max(self, a: Val, b: Val) -> Val:
        if isinstance(a, int) and isinstance(b, int):
            return max(a, b)
        a, b = self.i64(a), self.i64(b)
        return self.b.select(self.b.icmp_signed(">", a, b), a, b)

    def icmp(self, op: str, a: Val, b: Val) -> ir.Value:
        return self.b.icmp_signed(op, self.i64(a), self.i64(b))

    def split(self, n: Val, ith: ir.Value, nth: ir.Value, unit: int = 1) -> tuple[Val, Val]:
        """Thread ith's share [start, end) of range(n), in whole `unit`s (ggml-style static split:
        units [ith*u/nth, (ith+1)*u/nth))."""
        units = self.cdiv(n, unit)
        i, t = self.i64(ith), self.i64(nth)
        u0 = self.b.udiv(self.b.mul(self.i64(units), i), t)
        u1 = self.b.udiv(self.b.mul(self.i64(units), self.b.add(i, ir.Constant(I64, 1))), t)
        return self.min(self.mul(u0, unit), n), self.min(self.mul(u1, unit), n)

    # -- memory -------------------------------------------------------------------------------
    def gep(self, ptr: ir.Value, offset: Val) -> ir.Value:
        if isinstance(offset, int) and offset == 0:
            return ptr
        return self.b.gep(ptr, [self.i64(offset)], source_etype=I8, inbounds=True)

    def load(self, ty: ir.Type, ptr: ir.Value, offset: Val = 0, align: int = 1) -> ir.Value:
        return self.b.load(self.gep(ptr, offset), typ=ty, align=align)

    def store(self, value: ir.Value, ptr: ir.Value, offset: Val = 0, align: int = 1) -> None:
        self.b.store(value, self.gep(ptr, offset), align=align)

    def var(self, ty: ir.Type, init: ir.Value | None = None, name: str = "") -> ir.Value:
        """A mutable local (an entry-block alloca), optionally initialised here."""
        slot = self._alloca_builder.alloca(ty, name=name)
        if init is not None:
            self.b.store(init, slot)
        return slot

    def get(self, slot: ir.Value) -> ir.Value:
        return self.b.load(slot, typ=slot.allocated_type)

    def set(self, slot: ir.Value, value: ir.Value) -> None:
        self.b.store(value, slot)

    def masked_load(self, ty: ir.VectorType, ptr: ir.Value, offset: Val, mask: ir.Value,
                    passthru: ir.Value | None = None) -> ir.Value:
        if passthru is None:
            passthru = ir.Constant(ty, None)
        fn = self.declare(f"llvm.masked.load.{_tname(ty)}.p0", ty, [PTR, I32, mask.type, ty])
        return self.b.call(fn, [self.gep(ptr, offset), ir.Constant(I32, 1), mask, passthru])

    def masked_store(self, value: ir.Value, ptr: ir.Value, offset: Val, mask: ir.Value) -> None:
        ty = value.type
        fn = self.declare(f"llvm.masked.store.{_tname(ty)}.p0", VOID, [ty, PTR, I32, mask.type])
        self.b.call(fn, [value, self.gep(ptr, offset), ir.Constant(I32, 1), mask])

    def lane_mask(self, n: int, count: Val) -> ir.Value:
        """<n x i1>: lane j is set when j < count."""
        lanes = ir.Constant(vec(I32, n), list(range(n)))
        return self.b.icmp_signed("<", lanes, self.splat(self.i32(count), n))

    # -- control flow -------------------------------------------------------------------------
    @contextmanager
    def loop(self, start: Val, stop: Val, step: Val = 1, name: str = "i") -> Iterator[ir.Value]:
        """for (i = start; i < stop; i += step): yields i (i64); step > 0, compiled in or run-time."""
        b = self.b
        start, stop = self.i64(start), self.i64(stop)
        pre = b.block
        head = self.fn.append_basic_block(f"{name}.head")
        body = self.fn.append_basic_block(f"{name}.body")
        done = self.fn.append_basic_block(f"{name}.done")
        b.branch(head)
        b.position_at_end(head)
        i = b.phi(I64, name=name)
        i.add_incoming(start, pre)
        b.cbranch(b.icmp_signed("<", i, stop), body, done)
        b.position_at_end(body)
        yield i
        nxt = b.add(i, self.i64(step))
        i.add_incoming(nxt, b.block)
        b.branch(head)
        b.position_at_end(done)

    def claims(self, a) -> Claims:
        """Work sharing by chunks for a kernel that shares_work (KernelArgs `a`): see Claims."""
        return Claims(self, a.ith, a.nth, a.counter)

    def tiles(self, start: Val, stop: Val, width: int, tile: Callable[[Val, int], None], name: str = "t") -> None:
        """tile(t, w) over [start, stop): full tiles of `width` in a loop, then the remainder, with
        its width compiled in (one branch per possible remainder)."""
        full = self.add(start, self.mul(self.div(self.sub(stop, start), width), width))
        with self.loop(start, full, width, name=name) as t:
            tile(t, width)
        rest = self.sub(stop, full)
        for w in range(1, width):
            with self.if_(self.icmp("==", rest, w)):
                tile(full, w)

    @contextmanager
    def if_(self, cond: ir.Value) -> Iterator[None]:
        with self.b.if_then(cond):
            yield

    @contextmanager
    def if_else(self, cond: ir.Value):
        with self.b.if_else(cond) as (then, otherwise):
            yield then, otherwise

    # -- floats and vectors -------------------------------------------------------------------
    def f32(self, v: float) -> ir.Constant:
        return ir.Constant(F32, v)

    def splat(self, value: ir.Value | float, n: int, ty: ir.Type = F32) -> ir.Value:
        if not isinstance(value, ir.Value):
            return ir.Constant(vec(ty, n), [value] * n)
        if isinstance(value, ir.Constant):
            return ir.Constant(vec(value.type, n), [value.constant] * n)
        vt = vec(value.type, n)
        one = self.b.insert_element(ir.Constant(vt, None), value, ir.Constant(I32, 0))
        return self.b.shuffle_vector(one, ir.Constant(vt, None), ir.Constant(vec(I32, n), [0] * n))

    def fma(self, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
        return self.intrinsic(f"llvm.fma.{_tname(a.type)}", a.type, [a, b, c])

    def fmax(self, a: ir.Value, b: ir.Value) -> ir.Value:
        """maxps semantics: b when either is NaN (ggml's max loops use the same compare)."""
        return self.b.select(self.b.fcmp_ordered(">", a, b), a, b)

    def fmin(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.b.select(self.b.fcmp_ordered("<", a, b), a, b)

    def shuffle(self, a: ir.Value, b: ir.Value | None, lanes: Sequence[int]) -> ir.Value:
        if b is None:
            b = ir.Constant(a.type, None)
        return self.b.shuffle_vector(a, b, ir.Constant(vec(I32, len(lanes)), list(lanes)))

    def halves(self, v: ir.Value) -> tuple[ir.Value, ir.Value]:
        n = v.type.count
        return self.shuffle(v, None, range(n // 2)), self.shuffle(v, None, range(n // 2, n))

    def concat(self, lo: ir.Value, hi: ir.Value) -> ir.Value:
        return self.shuffle(lo, hi, range(2 * lo.type.count))

    def reduce_add_tree(self, v: ir.Value) -> ir.Value:
        """Sum of lanes as _mm512_reduce_add_ps / hsum: upper half + lower half, repeatedly; the
        last four lanes as (l0 + l2) + (l1 + l3)."""
        while v.type.count > 4:
            lo, hi = self.halves(v)
            v = self.b.fadd(hi, lo)
        if v.type.count == 4:
            e = [self.b.extract_element(v, ir.Constant(I32, j)) for j in range(4)]
            return self.b.fadd(self.b.fadd(e[0], e[2]), self.b.fadd(e[1], e[3]))
        if v.type.count == 2:
            return self.b.fadd(self.b.extract_element(v, ir.Constant(I32, 0)),
                               self.b.extract_element(v, ir.Constant(I32, 1)))
        return self.b.extract_element(v, ir.Constant(I32, 0))

    def reduce_int_add(self, v: ir.Value) -> ir.Value:
        return self.intrinsic(f"llvm.vector.reduce.add.{_tname(v.type)}", v.type.element, [v])

    def reduce_fmax(self, v: ir.Value) -> ir.Value:
        while v.type.count > 1:
            lo, hi = self.halves(v)
            v = self.fmax(lo, hi)
        return self.b.extract_element(v, ir.Constant(I32, 0))

    # -- element conversions --------------------------------------------------------------------
    def to_f32(self, v: ir.Value, storage: str) -> ir.Value:
        """A loaded value (or vector) of storage dtype `storage` as f32."""
        n = v.type.count if isinstance(v.type, ir.VectorType) else 0
        f = vec(F32, n) if n else F32
        if storage == "f32":
            return v
        if storage == "f16":
            return self.b.fpext(v, f)
        if storage == "bf16":
            wide = self.b.zext(v, vec(I32, n) if n else I32)
            return self.b.bitcast(self.b.shl(wide, self._const_like(wide, 16)), f)
        if storage in ("i32", "i16", "i8", "i64"):
            return self.b.sitofp(v, f)
        raise ValueError(f"no f32 conversion from {storage}")

    def from_f32(self, v: ir.Value, storage: str) -> ir.Value:
        """f32 (vector) to storage dtype `storage`: f16 rounds to nearest even, bf16 as ggml."""
        n = v.type.count if isinstance(v.type, ir.VectorType) else 0
        if storage == "f32":
            return v
        if storage == "f16":
            return self.b.fptrunc(v, vec(F16, n) if n else F16)
        if storage == "bf16":
            return self.f32_to_bf16(v)
        if storage in ("i32", "i16", "i8", "i64"):
            width = {"i8": 8, "i16": 16, "i32": 32, "i64": 64}[storage]
            t = ir.IntType(width)
            return self.b.fptosi(v, vec(t, n) if n else t)
        raise ValueError(f"no conversion from f32 to {storage}")

    def f32_to_bf16(self, v: ir.Value) -> ir.Value:
        """ggml_compute_fp32_to_bf16: round to nearest even; NaN becomes a quiet NaN."""
        n = v.type.count if isinstance(v.type, ir.VectorType) else 0
        it = vec(I32, n) if n else I32
        u = self.b.bitcast(v, it)
        lsb = self.b.and_(self.b.lshr(u, self._const_like(u, 16)), self._const_like(u, 1))
        rounded = self.b.lshr(self.b.add(u, self.b.add(lsb, self._const_like(u, 0x7FFF))), self._const_like(u, 16))
        quiet = self.b.or_(self.b.lshr(u, self._const_like(u, 16)), self._const_like(u, 64))
        is_nan = self.b.icmp_unsigned(">", self.b.and_(u, self._const_like(u, 0x7FFFFFFF)),
                                      self._const_like(u, 0x7F800000))
        out = self.b.select(is_nan, quiet, rounded)
        return self.b.trunc(out, vec(I16, n) if n else I16)

    def _const_like(self, v: ir.Value, c: int) -> ir.Constant:
        t = v.type
        if isinstance(t, ir.VectorType):
            return ir.Constant(t, [c] * t.count)
        return ir.Constant(t, c)


STORAGE_TYPES = {"f32": F32, "f16": F16, "bf16": I16, "i32": I32, "i64": I64, "i16": I16, "i8": I8}


def storage_type(dtype_name: str) -> ir.Type:
    """The IR element type a value of this (non-quantized) dtype is stored as."""
    return STORAGE_TYPES[dtype_name]


class Claims:
    """The chunks of one kernel call's loops, claimed by its threads as ggml's mul_mat claims its
    chunks: a thread takes value ith first, then nth plus an atomic increment of the step's
    counter (zeroed before each run), so every value goes to one thread. The loops of a call
    (planes, modes, blocks of tokens) number their chunks one after another, each from where the
    last left off, and a thread carries the value it holds from one loop into the next: one counter
    serves them all and no thread waits between them. A thread that runs ahead (its core's share
    of the memory bandwidth, another process) takes more chunks instead of waiting at the barrier."""

    def __init__(self, em: Emitter, ith: ir.Value, nth: ir.Value, counter: ir.Value):
        if counter is None:
            raise ValueError("Claims need the step's counter: the kernel must declare shares_work")
        self.em, self.nth, self.counter = em, nth, counter
        self.cursor = em.var(I64, em.i64(ith), "claim")     # the value this thread holds
        self.base = em.var(I64, ir.Constant(I64, 0), "claims_before")   # chunks of the earlier loops

    @contextmanager
    def chunks(self, n: Val, name: str = "chunk") -> Iterator[ir.Value]:
        """For each of chunks 0..n-1 of this loop that this thread claims: yields the chunk (i64)."""
        em = self.em
        b = em.b
        base = em.get(self.base)
        head = em.fn.append_basic_block(f"{name}.head")
        body = em.fn.append_basic_block(f"{name}.body")
        done = em.fn.append_basic_block(f"{name}.done")
        b.branch(head)
        b.position_at_end(head)
        local = b.sub(em.get(self.cursor), base)
        b.cbranch(b.icmp_signed("<", local, em.i64(n)), body, done)
        b.position_at_end(body)
        yield local
        taken = b.atomic_rmw("add", self.counter, ir.Constant(I64, 1), "monotonic")
        em.set(self.cursor, b.add(taken, em.i64(self.nth)))
        b.branch(head)
        b.position_at_end(done)
        em.set(self.base, b.add(base, em.i64(n)))

    @contextmanager
    def ranges(self, n: Val, per: int, passes: Val = 1, name: str = "chunk") -> Iterator[tuple]:
        """Chunks of range(n) for each of `passes` passes over it: yields (pass, start, stop). Each
        pass is one contiguous share a thread (as Emitter.split would give, of the first 7/8 of the
        range) and then chunks of `per` units: a thread mostly reads one long stream, as in a static
        split (small chunks that interleave the threads' reads cost a DRAM-bound GEMV 10-20%), and
        the last eighth goes to whichever threads get there first."""
        em = self.em
        b = em.b
        nth = em.i64(self.nth)
        tail = em.mul(em.cdiv(em.div(n, 8), per), per)
        own = em.div(em.sub(n, em.min(tail, n)), nth)
        per_pass = em.add(nth, em.cdiv(em.sub(n, em.mul(own, nth)), per))
        with self.chunks(em.mul(passes, per_pass), name) as c:
            local = em.rem(c, per_pass)
            mine = em.icmp("<", local, nth)
            start = b.select(mine, em.i64(em.mul(local, own)),
                             em.i64(em.add(em.mul(own, nth), em.mul(em.sub(local, nth), per))))
            size = b.select(mine, em.i64(own), em.i64(per))
            yield em.div(c, per_pass), start, em.min(em.add(start, size), n)
