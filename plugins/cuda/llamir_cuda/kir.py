"""Kernel IR: CUDA kernels written once in Python over llvmlite, lowered to two targets.

A kernel is a function of its parameters (tensors and scalars) run by a grid of thread blocks.
Its body is built with a `KernelBuilder`: llvmlite's IRBuilder (`k.b`) for arithmetic, plus the
SIMT primitives (thread and block ids, shared memory, barriers, warp shuffles, tensor-core mma,
dp4a) that differ between the targets:

- NVPTX: a `ptx_kernel` in global memory (addrspace 1) and static shared memory (addrspace 3),
  the ids as `llvm.nvvm.read.ptx.sreg.*`, `barrier0`, `shfl.sync.bfly`, `mma.sync`; LLVM's NVPTX
  target prints it as PTX for the driver's JIT or for ptxas.
- HOST: the same body compiled for this CPU, one call per GPU thread (`emulator.py` runs them as
  fibers). The ids, the block's shared memory and the kernel's arguments come from the thread's
  record; a barrier or a shuffle yields to the emulator's scheduler.

So the kernels the GPU runs are the kernels the tests run here, up to the primitives.

A tensor parameter is passed as its data pointer (the first byte of the tensor), ne0..ne3
(int32, ggml's order: ne0 is the innermost axis) and nb0..nb3 (int64 byte strides); a kernel's
flat signature (`Kernel.params`) lists one of "p", "i", "l", "f" per argument.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from llvmlite import binding as llvm
from llvmlite import ir

NVPTX, HOST = "nvptx", "host"

I1, I8, I16, I32, I64 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
F16, F32, F64 = ir.HalfType(), ir.FloatType(), ir.DoubleType()
VOID = ir.VoidType()
PTR = ir.PointerType()  # opaque, address space 0
GLOBAL, SHARED = 1, 3  # NVPTX address spaces
WARP = 32

# the host thread record (emulator.py writes it): int32 fields, then pointers
REC_TID, REC_CTAID, REC_NTID, REC_NCTAID = 0, 12, 24, 36
REC_LINEAR, REC_STATE = 48, 52
REC_SHARED, REC_XCHG, REC_ARGS, REC_SCHED = 56, 64, 72, 80
REC_SWITCH, REC_SP = 88, 96  # the emulator's context switch, and the fiber's saved stack pointer
XCHG_WORDS = 16  # exchange words per thread (a shuffle uses 1, an mma 10)
SYNC_BLOCK, SYNC_WARP = 1, 2  # what a thread waits for when it yields (REC_STATE)

PARAM_KINDS = {"p": None, "i": I32, "l": I64, "f": F32}


@dataclass
class Tensor:
    """A tensor parameter: its data pointer, ne (4 x i32) and nb (4 x i64 byte strides)."""

    name: str
    ptr: ir.Value
    ne: list[ir.Value]
    nb: list[ir.Value]


@dataclass
class SharedArray:
    """A block's shared-memory array of `count` elements of `ty` (or, made by `local`, a
    thread's private one)."""

    ty: ir.Type
    count: int
    base: ir.Value  # a pointer (addrspace 3 on NVPTX)


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # "tensor", "p", "i", "l", "f"


def tensor(name: str) -> Param:
    return Param(name, "tensor")


def scalar(name: str, kind: str) -> Param:
    if kind not in PARAM_KINDS:
        raise ValueError(f"scalar kind must be one of {sorted(PARAM_KINDS)}, got {kind!r}")
    return Param(name, kind)


def flat_signature(params: tuple[Param, ...]) -> tuple[str, ...]:
    out: list[str] = []
    for p in params:
        out += ["p", "i", "i", "i", "i", "l", "l", "l", "l"] if p.kind == "tensor" else [p.kind]
    return tuple(out)


class KernelBuilder:
    """Builds one kernel's function for one target. `k.b` is the IRBuilder of the body."""

    def __init__(self, target: str, name: str, params: tuple[Param, ...], block: tuple[int, int, int]):
        self.target, self.name, self.block = target, name, block
        self.module = ir.Module(name=name)
        self.gspace = GLOBAL if target == NVPTX else 0
        self.gptr = ir.PointerType(addrspace=self.gspace)
        sig = flat_signature(params)
        if target == NVPTX:
            types = [self.gptr if s == "p" else PARAM_KINDS[s] for s in sig]
            self.fn = ir.Function(self.module, ir.FunctionType(VOID, types), name)
            self.fn.calling_convention = "ptx_kernel"
            self.fn.attributes.add("nounwind")
        else:
            self.fn = ir.Function(self.module, ir.FunctionType(VOID, [PTR]), name)
        self.b = ir.IRBuilder(self.fn.append_basic_block("entry"))
        self.uses_sync = False
        self.shared_bytes = 0
        # blocks per SM ptxas must allow for (.minnctapersm): 1 lets a register-heavy kernel use
        # all 255 registers rather than spill under ptxas's occupancy heuristic; None: no bound
        self.min_blocks_per_sm: int | None = None
        self._intrinsics: dict[str, ir.Function] = {}
        self.args: dict[str, Tensor | ir.Value] = {}
        raw = list(self.fn.args) if target == NVPTX else [self._host_arg(i, s) for i, s in enumerate(sig)]
        it = iter(raw)
        for p in params:
            if p.kind == "tensor":
                ptr, ne, nb = next(it), [next(it) for _ in range(4)], [next(it) for _ in range(4)]
                self.args[p.name] = Tensor(p.name, ptr, ne, nb)
            else:
                self.args[p.name] = next(it)

    # -- host records ----------------------------------------------------------------------------
    @property
    def rec(self) -> ir.Value:
        return self.fn.args[0]

    def _rec_field(self, offset: int, ty: ir.Type) -> ir.Value:
        return self.b.load(self.b.gep(self.rec, [ir.Constant(I64, offset)], source_etype=I8), typ=ty)

    def _host_arg(self, index: int, kind: str) -> ir.Value:
        slots = self._rec_field(REC_ARGS, PTR)
        slot = self.b.gep(slots, [ir.Constant(I64, 8 * index)], source_etype=I8)
        return self.b.load(slot, typ=PTR if kind == "p" else PARAM_KINDS[kind])

    # -- constants and intrinsics ----------------------------------------------------------------
    @staticmethod
    def i32(v: int) -> ir.Constant:
        return ir.Constant(I32, int(v))

    @staticmethod
    def i64(v: int) -> ir.Constant:
        return ir.Constant(I64, int(v))

    @staticmethod
    def f32(v: float) -> ir.Constant:
        return ir.Constant(F32, float(v))

    def intrinsic(self, name: str, ret: ir.Type, args: list[ir.Type]) -> ir.Function:
        fn = self._intrinsics.get(name)
        if fn is None:
            fn = self.module.globals.get(name) or ir.Function(self.module, ir.FunctionType(ret, args), name)
            self._intrinsics[name] = fn
        return fn

    def call(self, name: str, ret: ir.Type, *args: ir.Value) -> ir.Value:
        return self.b.call(self.intrinsic(name, ret, [a.type for a in args]), list(args))

    # -- ids -------------------------------------------------------------------------------------
    def _sreg(self, reg: str, axis: int, host_offset: int) -> ir.Value:
        if self.target == NVPTX:
            return self.call(f"llvm.nvvm.read.ptx.sreg.{reg}.{'xyz'[axis]}", I32)
        return self._rec_field(host_offset + 4 * axis, I32)

    def tid(self, axis: int = 0) -> ir.Value:
        return self._sreg("tid", axis, REC_TID)

    def ctaid(self, axis: int = 0) -> ir.Value:
        return self._sreg("ctaid", axis, REC_CTAID)

    def ntid(self, axis: int = 0) -> ir.Value:
        """The block size along `axis` (a constant: blocks are fixed when a kernel is built)."""
        return self.i32(self.block[axis])

    def nctaid(self, axis: int = 0) -> ir.Value:
        return self._sreg("nctaid", axis, REC_NCTAID)

    def linear_tid(self) -> ir.Value:
        b, (bx, by, _) = self.b, self.block
        t = self.tid(0)
        if by > 1 or self.block[2] > 1:
            t = b.add(t, b.mul(self.tid(1), self.i32(bx)))
        if self.block[2] > 1:
            t = b.add(t, b.mul(self.tid(2), self.i32(bx * by)))
        return t

    def lane(self) -> ir.Value:
        return self.b.and_(self.linear_tid(), self.i32(WARP - 1))

    def warp(self) -> ir.Value:
        return self.b.lshr(self.linear_tid(), self.i32(5))

    # -- memory ----------------------------------------------------------------------------------
    def at(self, ptr: ir.Value, byte_offset: ir.Value) -> ir.Value:
        """`ptr` advanced by `byte_offset` bytes (an i32 offset is widened)."""
        if byte_offset.type != I64:
            byte_offset = self.b.sext(byte_offset, I64)
        return self.b.gep(ptr, [byte_offset], source_etype=I8)

    def load(self, ptr: ir.Value, ty: ir.Type, byte_offset: ir.Value | None = None, align: int | None = None):
        p = ptr if byte_offset is None else self.at(ptr, byte_offset)
        v = self.b.load(p, typ=ty)
        if align:
            v.align = align
        return v

    def store(self, value: ir.Value, ptr: ir.Value, byte_offset: ir.Value | None = None, align: int | None = None):
        p = ptr if byte_offset is None else self.at(ptr, byte_offset)
        s = self.b.store(value, p)
        if align:
            s.align = align
        return s

    def offset(self, t: Tensor, *index: ir.Value) -> ir.Value:
        """The byte offset of element (i0, i1, i2, i3) of `t` (ggml's order; missing indices 0)."""
        b, off = self.b, self.i64(0)
        for i, idx in enumerate(index):
            if idx is None:
                continue
            wide = b.sext(idx, I64) if idx.type != I64 else idx
            off = b.add(off, b.mul(wide, t.nb[i]))
        return off

    def shared(self, ty: ir.Type, count: int, name: str = "smem") -> SharedArray:
        """A static shared-memory array of the block (16-byte aligned)."""
        size = int(count) * _type_size(ty)
        if self.target == NVPTX:
            arr = ir.ArrayType(ty, int(count))
            g = ir.GlobalVariable(self.module, arr, f"{self.name}_{name}_{len(self.module.globals)}", addrspace=SHARED)
            g.linkage = "internal"
            g.initializer = ir.Constant(arr, ir.Undefined)
            g.align = 16
            g.type = ir.PointerType(addrspace=SHARED)  # opaque, as LLVM 22 prints it
            base = g
        else:
            base = self.at(self._rec_field(REC_SHARED, PTR), self.i64(self.shared_bytes))
        self.shared_bytes += -(-size // 16) * 16
        return SharedArray(ty, int(count), base)

    def local(self, ty: ir.Type, count: int) -> SharedArray:
        """A thread-private array (a stack slot: registers where every index is constant once
        loops are unrolled, else local memory); sload / sstore read and write it too."""
        with self.b.goto_entry_block():
            base = self.b.alloca(ty, size=self.i32(count))
        return SharedArray(ty, int(count), base)

    def sptr(self, arr: SharedArray, index: ir.Value) -> ir.Value:
        return self.b.gep(arr.base, [index], source_etype=arr.ty)

    def sload(self, arr: SharedArray, index: ir.Value) -> ir.Value:
        return self.b.load(self.sptr(arr, index), typ=arr.ty)

    def sstore(self, value: ir.Value, arr: SharedArray, index: ir.Value) -> None:
        self.b.store(value, self.sptr(arr, index))

    # -- control flow ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def loop(self, start: ir.Value, stop: ir.Value, step: ir.Value | int = 1) -> Iterator[ir.Value]:
        """for (i = start; i < stop; i += step): the body is built inside the `with`."""
        b = self.b
        step = ir.Constant(start.type, step) if isinstance(step, int) else step
        pre = b.block
        head, body, done = (self.fn.append_basic_block(n) for n in ("loop", "body", "done"))
        b.branch(head)
        b.position_at_end(head)
        i = b.phi(start.type)
        i.add_incoming(start, pre)
        b.cbranch(b.icmp_signed("<", i, stop), body, done)
        b.position_at_end(body)
        yield i
        nxt = b.add(i, step)
        i.add_incoming(nxt, b.block)
        b.branch(head)
        b.position_at_end(done)

    def if_then(self, cond: ir.Value):
        return self.b.if_then(cond)

    def if_else(self, cond: ir.Value):
        return self.b.if_else(cond)

    def var(self, ty: ir.Type, init: ir.Value | None = None) -> ir.Value:
        """A mutable local (an alloca in the entry block; LLVM promotes it to registers)."""
        with self.b.goto_entry_block():
            slot = self.b.alloca(ty)
        if init is not None:
            self.b.store(init, slot)
        return slot

    def get(self, slot: ir.Value, ty: ir.Type) -> ir.Value:
        return self.b.load(slot, typ=ty)

    def set(self, slot: ir.Value, value: ir.Value) -> None:
        self.b.store(value, slot)

    def select(self, cond, a, b):
        return self.b.select(cond, a, b)

    # -- synchronization -------------------------------------------------------------------------
    def _host_yield(self, kind: int) -> None:
        fn = self.intrinsic("llamir_emu_yield", VOID, [PTR, I32])
        self.b.call(fn, [self.rec, self.i32(kind)])

    def barrier(self) -> None:
        """__syncthreads(): every thread of the block reaches this point before any goes on."""
        self.uses_sync = True
        if self.target == NVPTX:
            self.call("llvm.nvvm.barrier0", VOID)
        else:
            self._host_yield(SYNC_BLOCK)

    def _xchg(self, slot: int, lane_expr: ir.Value | None = None) -> ir.Value:
        """This thread's (or lane `lane_expr` of its warp's) exchange word `slot` (host)."""
        b = self.b
        t = self.linear_tid()
        if lane_expr is not None:
            t = b.or_(b.and_(t, self.i32(~(WARP - 1))), lane_expr)
        word = b.add(b.mul(t, self.i32(XCHG_WORDS)), self.i32(slot))
        return self.at(self._rec_field(REC_XCHG, PTR), b.mul(word, self.i32(4)))

    def shfl_xor(self, value: ir.Value, mask: int) -> ir.Value:
        """__shfl_xor_sync(0xffffffff, value, mask): the value of lane (lane ^ mask), for a 32-bit
        int or float, the whole warp taking part."""
        self.uses_sync = True
        b = self.b
        as_int = b.bitcast(value, I32) if value.type == F32 else value
        if self.target == NVPTX:
            r = self.call("llvm.nvvm.shfl.sync.bfly.i32", I32, self.i32(-1), as_int, self.i32(mask), self.i32(0x1F))
        else:
            b.store(as_int, self._xchg(0))
            self._host_yield(SYNC_WARP)
            r = b.load(self._xchg(0, b.xor(self.lane(), self.i32(mask))), typ=I32)
            self._host_yield(SYNC_WARP)
        return b.bitcast(r, F32) if value.type == F32 else r

    def shfl_idx(self, value: ir.Value, src_lane: ir.Value) -> ir.Value:
        """__shfl_sync(0xffffffff, value, src_lane): the value of lane `src_lane` (an i32 below 32)
        for a 32-bit int or float, the whole warp taking part (a broadcast when it is uniform)."""
        self.uses_sync = True
        b = self.b
        as_int = b.bitcast(value, I32) if value.type == F32 else value
        if self.target == NVPTX:
            r = self.call("llvm.nvvm.shfl.sync.idx.i32", I32, self.i32(-1), as_int, src_lane, self.i32(0x1F))
        else:
            b.store(as_int, self._xchg(0))
            self._host_yield(SYNC_WARP)
            r = b.load(self._xchg(0, src_lane), typ=I32)
            self._host_yield(SYNC_WARP)
        return b.bitcast(r, F32) if value.type == F32 else r

    def warp_reduce(self, value: ir.Value, op: Callable[[ir.Value, ir.Value], ir.Value], width: int = WARP):
        """`op` over the `width` lanes of each aligned group (butterfly: every lane gets it)."""
        m = width // 2
        while m:
            value = op(value, self.shfl_xor(value, m))
            m //= 2
        return value

    def warp_sum(self, value: ir.Value, width: int = WARP) -> ir.Value:
        return self.warp_reduce(value, self.b.fadd if value.type == F32 else self.b.add, width)

    def warp_max(self, value: ir.Value, width: int = WARP) -> ir.Value:
        return self.warp_reduce(value, self.fmax, width)

    def block_reduce(self, value: ir.Value, op: Callable[[ir.Value, ir.Value], ir.Value],
                     identity: ir.Value) -> ir.Value:
        """`op` over every thread of the block, returned to all (warp shuffles, then one word per
        warp in shared memory; two barriers)."""
        n_threads = self.block[0] * self.block[1] * self.block[2]
        value = self.warp_reduce(value, op)
        n_warps = -(-n_threads // WARP)
        if n_warps == 1:
            return value
        b = self.b
        buf = self.shared(value.type, WARP, "reduce")
        lane, warp = self.lane(), self.warp()
        with self.if_then(b.icmp_unsigned("==", lane, self.i32(0))):
            self.sstore(value, buf, warp)
        self.barrier()
        mine = self.select(b.icmp_unsigned("<", lane, self.i32(n_warps)), self.sload(buf, lane), identity)
        total = self.warp_reduce(mine, op)
        self.barrier()  # buf may be reused by the next reduction
        return total

    # -- math ------------------------------------------------------------------------------------
    def fma(self, a, c, d):
        return self.call(f"llvm.fma.{_suffix(a.type)}", a.type, a, c, d)

    def fmax(self, a, c):
        return self.call(f"llvm.maxnum.{_suffix(a.type)}", a.type, a, c)

    def fmin(self, a, c):
        return self.call(f"llvm.minnum.{_suffix(a.type)}", a.type, a, c)

    def fabs(self, a):
        return self.call(f"llvm.fabs.{_suffix(a.type)}", a.type, a)

    def sqrt(self, a):
        return self.call(f"llvm.sqrt.{_suffix(a.type)}", a.type, a)

    def floor(self, a):
        return self.call(f"llvm.floor.{_suffix(a.type)}", a.type, a)

    def rint(self, a):
        """Round half to even."""
        return self.call(f"llvm.rint.{_suffix(a.type)}", a.type, a)

    def exp2(self, x):
        """2^x for f32 (ex2.approx on the GPU: relative error below 2^-22)."""
        if self.target == NVPTX:
            return self.call("llvm.nvvm.ex2.approx.f", F32, x)
        return self.call("llvm.exp2.f32", F32, x)

    def exp(self, x):
        return self.exp2(self.b.fmul(x, self.f32(math.log2(math.e))))

    def log(self, x):
        """ln x for f32 (lg2.approx on the GPU)."""
        if self.target == NVPTX:
            return self.b.fmul(self.call("llvm.nvvm.lg2.approx.f", F32, x), self.f32(math.log(2.0)))
        return self.call("llvm.log.f32", F32, x)

    def tanh(self, x):
        """tanh through exp, accurate for f32 over the whole range (saturates at +-1)."""
        b = self.b
        a = self.fmin(self.fabs(x), self.f32(10.0))
        e = self.exp(b.fmul(a, self.f32(2.0)))
        t = b.fsub(self.f32(1.0), b.fdiv(self.f32(2.0), b.fadd(e, self.f32(1.0))))
        return self.call("llvm.copysign.f32", F32, t, x)

    def erf(self, x):
        """erf(x) for f32: Abramowitz-Stegun 7.1.26 refined (|error| < 1.5e-7)."""
        b = self.b
        a = self.fabs(x)
        t = b.fdiv(self.f32(1.0), self.fma(a, self.f32(0.3275911), self.f32(1.0)))
        poly = self.f32(1.061405429)
        for c in (-1.453152027, 1.421413741, -0.284496736, 0.254829592):
            poly = self.fma(poly, t, self.f32(c))
        y = b.fsub(self.f32(1.0), b.fmul(b.fmul(poly, t), self.exp(b.fneg(b.fmul(a, a)))))
        return self.call("llvm.copysign.f32", F32, y, x)

    def sincos(self, x: ir.Value) -> tuple[ir.Value, ir.Value]:
        """(sin x, cos x) of an f32 as f32, correctly rounded in practice: the argument reduced
        by pi/2 in double and both series evaluated in double, so the GPU and the host agree to
        the last bit and large angles (rope's positions) stay accurate."""
        b = self.b
        xd = b.fpext(x, F64)
        q = self.rint(b.fmul(xd, ir.Constant(F64, 2.0 / math.pi)))
        r = self.fma(q, ir.Constant(F64, -1.5707963267948966), xd)
        r = self.fma(q, ir.Constant(F64, -6.123233995736766e-17), r)
        r2 = b.fmul(r, r)
        s = ir.Constant(F64, 1.0 / math.factorial(15) * -1)
        for n in (13, 11, 9, 7, 5, 3):
            s = self.fma(s, r2, ir.Constant(F64, (-1) ** ((n - 1) // 2) / math.factorial(n)))
        s = self.fma(b.fmul(s, r2), r, r)
        c = ir.Constant(F64, 1.0 / math.factorial(16))
        for n in (14, 12, 10, 8, 6, 4, 2):
            c = self.fma(c, r2, ir.Constant(F64, (-1) ** (n // 2) / math.factorial(n)))
        c = self.fma(c, r2, ir.Constant(F64, 1.0))
        quadrant = b.and_(b.fptosi(q, I32), self.i32(3))
        swap = b.icmp_unsigned("!=", b.and_(quadrant, self.i32(1)), self.i32(0))
        sin_v, cos_v = self.select(swap, c, s), self.select(swap, s, c)
        neg_sin = b.icmp_unsigned("!=", b.and_(quadrant, self.i32(2)), self.i32(0))
        neg_cos = b.icmp_unsigned("!=", b.and_(b.add(quadrant, self.i32(1)), self.i32(2)), self.i32(0))
        sin_v = self.select(neg_sin, b.fneg(sin_v), sin_v)
        cos_v = self.select(neg_cos, b.fneg(cos_v), cos_v)
        return b.fptrunc(sin_v, F32), b.fptrunc(cos_v, F32)

    def pow(self, base: float, x: ir.Value) -> ir.Value:
        """base ** x for a constant base > 0 and an f32 exponent, in double (rope's theta)."""
        b = self.b
        xd = b.fpext(x, F64) if x.type != F64 else x
        e = b.fmul(xd, ir.Constant(F64, math.log(base)))
        return self._exp_f64(e)

    def _exp_f64(self, x: ir.Value) -> ir.Value:
        """e^x in double: x = n ln2 + r, |r| <= ln2/2, a degree-13 series, scaled by 2^n."""
        b = self.b
        n = self.rint(b.fmul(x, ir.Constant(F64, 1.0 / math.log(2.0))))
        r = self.fma(n, ir.Constant(F64, -0.6931471805599453), x)
        r = self.fma(n, ir.Constant(F64, -2.3190468138462996e-17), r)
        p = ir.Constant(F64, 1.0 / math.factorial(13))
        for k in range(12, -1, -1):
            p = self.fma(p, r, ir.Constant(F64, 1.0 / math.factorial(k)))
        ni = b.fptosi(n, I64)
        bits = b.shl(b.add(ni, ir.Constant(I64, 1023)), ir.Constant(I64, 52))
        return b.fmul(p, b.bitcast(bits, F64))

    # -- conversions -----------------------------------------------------------------------------
    def h2f(self, bits16: ir.Value) -> ir.Value:
        """An f16 (as its 16 bits) to f32."""
        return self.b.fpext(self.b.bitcast(bits16, F16), F32)

    def f2h(self, x: ir.Value) -> ir.Value:
        """f32 to f16 bits, rounding to nearest even."""
        return self.b.bitcast(self.b.fptrunc(x, F16), I16)

    def bf2f(self, bits16: ir.Value) -> ir.Value:
        return self.b.bitcast(self.b.shl(self.b.zext(bits16, I32), self.i32(16)), F32)

    def f2bf(self, x: ir.Value) -> ir.Value:
        """f32 to bf16 bits as ggml rounds (to nearest even; NaN kept quiet)."""
        b = self.b
        u = b.bitcast(x, I32)
        rounded = b.lshr(b.add(u, b.add(self.i32(0x7FFF), b.and_(b.lshr(u, self.i32(16)), self.i32(1)))),
                         self.i32(16))
        is_nan = b.icmp_unsigned(">", b.and_(u, self.i32(0x7FFFFFFF)), self.i32(0x7F800000))
        nan = b.or_(b.lshr(u, self.i32(16)), self.i32(64))
        return b.trunc(self.select(is_nan, nan, rounded), I16)

    def load_f32(self, ptr: ir.Value, byte_offset: ir.Value, dtype: str) -> ir.Value:
        """An element of a float or int32 tensor (storage type `dtype`) as f32."""
        if dtype == "f32":
            return self.load(ptr, F32, byte_offset)
        if dtype == "f16":
            return self.h2f(self.load(ptr, I16, byte_offset))
        if dtype == "bf16":
            return self.bf2f(self.load(ptr, I16, byte_offset))
        if dtype == "i32":
            return self.b.sitofp(self.load(ptr, I32, byte_offset), F32)
        raise ValueError(f"no f32 load of {dtype}")

    def store_f32(self, value: ir.Value, ptr: ir.Value, byte_offset: ir.Value, dtype: str) -> None:
        """Store an f32 into a tensor of storage type `dtype` (ggml's rounding)."""
        if dtype == "f32":
            self.store(value, ptr, byte_offset)
        elif dtype == "f16":
            self.store(self.f2h(value), ptr, byte_offset)
        elif dtype == "bf16":
            self.store(self.f2bf(value), ptr, byte_offset)
        elif dtype == "i32":
            self.store(self.b.fptosi(value, I32), ptr, byte_offset)
        else:
            raise ValueError(f"no f32 store to {dtype}")

    def unravel(self, index: ir.Value, ne: list[ir.Value]) -> list[ir.Value]:
        """(i0, i1, i2, i3) of a flat i32 index over the extents ne0..ne2 (ne3 is the rest)."""
        b, out = self.b, []
        for n in ne[:3]:
            out.append(b.srem(index, n))
            index = b.sdiv(index, n)
        return [*out, index]

    def global_id(self) -> ir.Value:
        """blockIdx.x * blockDim.x + threadIdx.x as i32."""
        return self.b.add(self.b.mul(self.ctaid(0), self.i32(self.block[0])), self.tid(0))

    def count(self, t: Tensor) -> ir.Value:
        """ne0 * ne1 * ne2 * ne3 of `t` (i32)."""
        b = self.b
        return b.mul(b.mul(t.ne[0], t.ne[1]), b.mul(t.ne[2], t.ne[3]))

    # -- integer dot products and tensor cores ---------------------------------------------------
    def dp4a(self, a: ir.Value, c: ir.Value, acc: ir.Value) -> ir.Value:
        """acc + the dot product of the four signed bytes of `a` and of `c` (__dp4a)."""
        if self.target == NVPTX:
            return self.call("llvm.nvvm.idp4a.s.s", I32, a, c, acc)
        b = self.b
        va, vc = b.bitcast(a, ir.VectorType(I8, 4)), b.bitcast(c, ir.VectorType(I8, 4))
        wa, wc = b.sext(va, ir.VectorType(I32, 4)), b.sext(vc, ir.VectorType(I32, 4))
        prod = b.mul(wa, wc)
        total = acc
        for i in range(4):
            total = b.add(total, b.extract_element(prod, self.i32(i)))
        return total

    def mma_f16(self, a: list[ir.Value], c: list[ir.Value], acc: list[ir.Value]) -> list[ir.Value]:
        """mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 for the whole warp: `a` 4 x i32
        (8 halves of the 16x16 A tile), `c` 2 x i32 (4 halves of the 16x8 B tile, column-major)
        and `acc` 4 x f32 per lane, in PTX's fragment layout; returns D (4 x f32 per lane)."""
        self.uses_sync = True
        if self.target == NVPTX:
            h2 = ir.VectorType(F16, 2)
            args = [self.b.bitcast(v, h2) for v in (*a, *c)] + list(acc)
            ret = ir.LiteralStructType([F32] * 4)
            fn = self.intrinsic("llvm.nvvm.mma.m16n8k16.row.col.f32.f32", ret, [h2] * 6 + [F32] * 4)
            d = self.b.call(fn, args)
            return [self.b.extract_value(d, i) for i in range(4)]
        return self._host_mma(a, c, acc, self.h2f)

    def mma_bf16(self, a: list[ir.Value], c: list[ir.Value], acc: list[ir.Value]) -> list[ir.Value]:
        """mma_f16's product with bf16 inputs (mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32,
        sm_80+): the same fragments, each i32 two bf16s (the lower one first)."""
        self.uses_sync = True
        if self.target == NVPTX:
            ret = ir.LiteralStructType([F32] * 4)
            d = self.call("llvm.nvvm.mma.m16n8k16.row.col.bf16", ret, *a, *c, *acc)
            return [self.b.extract_value(d, i) for i in range(4)]
        return self._host_mma(a, c, acc, self.bf2f)

    def _host_mma(self, a, c, acc, widen: Callable[[ir.Value], ir.Value]):
        """The warp's mma through the exchange words: every lane publishes its fragments, then
        computes its own four outputs from the others' in a helper made once per module."""
        b = self.b
        for i, v in enumerate((*a, *c)):
            b.store(v, self._xchg(i))
        self._host_yield(SYNC_WARP)
        out = self.var(ir.ArrayType(F32, 4))
        b.call(self._host_mma_helper(widen), [self.rec, *acc, out])
        result = [b.load(b.gep(out, [self.i64(0), self.i32(j)], source_etype=ir.ArrayType(F32, 4)), typ=F32)
                  for j in range(4)]
        self._host_yield(SYNC_WARP)
        return result

    def _host_mma_helper(self, widen: Callable[[ir.Value], ir.Value]) -> ir.Function:
        """llamir_emu_mma_<kind>(rec, c0..c3, out): this lane's four outputs of the warp's m16n8k16
        product from the fragments in the exchange words (PTX ISA, 'Matrix Fragments for
        mma.m16n8k16 with floating point type'); `widen` takes an input's 16 bits to f32."""
        name = f"llamir_emu_mma_{widen.__name__}"
        fn = self.module.globals.get(name)
        if fn is not None:
            return fn
        fn = ir.Function(self.module, ir.FunctionType(VOID, [PTR, F32, F32, F32, F32, PTR]), name)
        fn.linkage = "internal"
        fn.attributes.add("noinline")
        saved = self.fn, self.b
        self.fn, self.b = fn, ir.IRBuilder(fn.append_basic_block())
        try:
            b = self.b
            lane = self.lane()
            group, tig = b.lshr(lane, self.i32(2)), b.and_(lane, self.i32(3))
            for j in range(4):  # d_j: row group + 8*(j >= 2), column 2*tig + (j & 1)
                row = b.add(group, self.i32(8 * (j >= 2)))
                col = b.add(b.mul(tig, self.i32(2)), self.i32(j & 1))
                total = fn.args[1 + j]
                for kk in range(16):
                    # A[row][kk]: lane 4*(row % 8) + (kk % 8) // 2, register (row >= 8) + 2*(kk >= 8),
                    # half kk % 2
                    a_lane = b.add(b.mul(b.and_(row, self.i32(7)), self.i32(4)), self.i32((kk % 8) // 2))
                    a_reg = b.add(b.lshr(row, self.i32(3)), self.i32(2 * (kk >= 8)))
                    a_val = widen(self._half_of(self._xchg_dynamic(a_lane, a_reg), kk % 2))
                    # B[kk][col]: lane 4*col + (kk % 8) // 2, register 4 + (kk >= 8), half kk % 2
                    b_lane = b.add(b.mul(col, self.i32(4)), self.i32((kk % 8) // 2))
                    b_val = widen(self._half_of(self._xchg_dynamic(b_lane, self.i32(4 + (kk >= 8))), kk % 2))
                    total = self.fma(a_val, b_val, total)
                b.store(total, b.gep(fn.args[5], [self.i64(4 * j)], source_etype=I8))
            b.ret_void()
        finally:
            self.fn, self.b = saved
        return fn

    def _xchg_dynamic(self, lane: ir.Value, slot: ir.Value) -> ir.Value:
        b = self.b
        t = b.or_(b.and_(self.linear_tid(), self.i32(~(WARP - 1))), lane)
        word = b.add(b.mul(t, self.i32(XCHG_WORDS)), slot)
        return b.load(self.at(self._rec_field(REC_XCHG, PTR), b.mul(word, self.i32(4))), typ=I32)

    def _half_of(self, word: ir.Value, which: int) -> ir.Value:
        """The lower (0) or upper (1) 16 bits of an i32."""
        b = self.b
        return b.trunc(b.lshr(word, self.i32(16 * which)), I16)

    # -- finishing -------------------------------------------------------------------------------
    def finish(self) -> ir.Module:
        if not self.b.block.is_terminated:
            self.b.ret_void()
        if self.target == NVPTX:
            n = self.block[0] * self.block[1] * self.block[2]
            self.fn.attributes.add("nounwind")
            md = self.module.add_named_metadata("nvvm.annotations")
            md.add(self.module.add_metadata([self.fn, ir.MetaDataString(self.module, "maxntidx"), self.i32(n)]))
            if self.min_blocks_per_sm is not None:
                md.add(self.module.add_metadata([self.fn, ir.MetaDataString(self.module, "minctasm"),
                                                 self.i32(self.min_blocks_per_sm)]))
        return self.module


def _suffix(ty: ir.Type) -> str:
    return {F32: "f32", F64: "f64", F16: "f16"}[ty]


def _type_size(ty: ir.Type) -> int:
    if isinstance(ty, ir.IntType):
        return max(ty.width // 8, 1)
    if isinstance(ty, ir.VectorType):
        return ty.count * _type_size(ty.element)
    return {F16: 2, F32: 4, F64: 8}[ty]


# -- kernels -------------------------------------------------------------------------------------
Body = Callable[[KernelBuilder], None]


@dataclass(eq=False)
class Kernel:
    """One generated kernel: its entry name, cache key, signature and block shape. Its IR is
    built per target on demand, its PTX per architecture (cached)."""

    name: str
    key: tuple
    params: tuple[str, ...]
    block: tuple[int, int, int]
    body: Body = field(repr=False)
    param_decls: tuple[Param, ...] = field(repr=False, default=())
    _built: dict = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def build(self, target: str) -> KernelBuilder:
        with self._lock:
            kb = self._built.get(target)
            if kb is None:
                kb = KernelBuilder(target, self.name, self.param_decls, self.block)
                self.body(kb)
                kb.finish()
                self._built[target] = kb
            return kb

    @property
    def shared_bytes(self) -> int:
        return self.build(HOST).shared_bytes

    @property
    def uses_sync(self) -> bool:
        return self.build(HOST).uses_sync

    def ir(self, target: str) -> str:
        return str(self.build(target).module)

    def ptx(self, arch: str = "sm_90") -> str:
        return ptx_of(self, arch)


_KERNELS: dict[tuple, Kernel] = {}
_KERNELS_LOCK = threading.Lock()


def define(name: str, key: tuple, params: tuple[Param, ...], block: tuple[int, int, int] | int, body: Body) -> Kernel:
    """The kernel `name` for a variant `key` (what its body depends on besides its arguments),
    made once per process. `name` must be a valid PTX identifier; the key's hash keeps variants
    apart."""
    block = (block, 1, 1) if isinstance(block, int) else tuple(block)
    full_key = (name, *key)
    with _KERNELS_LOCK:
        k = _KERNELS.get(full_key)
        if k is None:
            entry = f"{name}_{_digest(full_key)}"
            k = Kernel(entry, full_key, flat_signature(params), block, body, params)
            _KERNELS[full_key] = k
        return k


def defined_kernels() -> list[Kernel]:
    with _KERNELS_LOCK:
        return list(_KERNELS.values())


def _digest(key: tuple) -> str:
    return hashlib.sha1(repr(key).encode()).hexdigest()[:10]


# -- PTX -----------------------------------------------------------------------------------------
PTX_FEATURES = {"sm_80": "+ptx70", "sm_86": "+ptx71", "sm_89": "+ptx78", "sm_90": "+ptx78"}


@functools.cache
def _init_nvptx() -> None:
    llvm.initialize_all_targets()
    llvm.initialize_all_asmprinters()


@functools.cache
def _nvptx_machine(arch: str):
    _init_nvptx()
    target = llvm.Target.from_triple("nvptx64-nvidia-cuda")
    features = PTX_FEATURES.get(arch, "")
    return target.create_target_machine(cpu=arch, features=features, opt=3, codemodel="default")


_PTX_CACHE: dict[tuple, str] = {}


def cache_dir() -> Path:
    """Where PTX is kept between processes: LLAMIR_CUDA_CACHE, else ~/.cache/llamir/cuda, in a
    folder named by a hash of the plugin's sources (a change to a kernel or to kir makes new
    files, never a stale hit)."""
    root = os.environ.get("LLAMIR_CUDA_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "llamir", "cuda")
    return Path(root) / _sources_digest()


@functools.cache
def _sources_digest() -> str:
    h = hashlib.sha1(llvm.llvm_version_info.__repr__().encode())
    for path in sorted(Path(__file__).parent.glob("*.py")):
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def ptx_of(kernel: Kernel, arch: str) -> str:
    """The PTX text of `kernel` for `arch` (e.g. sm_80, sm_90), optimised at O3; memoized, and
    cached on disk by kernel name (its key's digest) and arch."""
    key = (kernel.key, arch)
    text = _PTX_CACHE.get(key)
    if text is None:
        path = cache_dir() / arch / f"{kernel.name}.ptx"
        if path.is_file():
            text = path.read_text()
            _PTX_CACHE[key] = text
            return text
        machine = _nvptx_machine(arch)
        ref = llvm.parse_assembly(kernel.ir(NVPTX))
        ref.triple = "nvptx64-nvidia-cuda"
        ref.data_layout = str(machine.target_data)
        ref.verify()
        _optimize(ref, machine)
        text = machine.emit_assembly(ref)
        _PTX_CACHE[key] = text
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(text)
            tmp.replace(path)
        except OSError:
            pass  # a read-only cache only costs the next process a compile
    return text


def _optimize(ref, machine, speed_level: int = 3) -> None:
    pto = llvm.create_pipeline_tuning_options(speed_level=speed_level)
    pto.loop_unrolling = True
    pto.slp_vectorization = True
    pto.loop_vectorization = True
    pb = llvm.create_pass_builder(machine, pto)
    pb.getModulePassManager().run(ref, pb)
