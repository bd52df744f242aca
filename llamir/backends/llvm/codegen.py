"""From a Plan to an LLVM module: one function per distinct kernel, one entry per split.

The entry `void llamir_split(ptr frame, i32 ith, i32 nth, ptr pool)` reads everything it needs
from the frame (an i64 array the executable fills per call), evaluates the run-time shape
expressions once, and calls the kernels stage by stage with a barrier between stages.
`i64 llamir_arena_size(ptr frame)` gives the arena bytes the dims in the frame need.

Frame slots: 0 arena, 1 error code, 2 error detail, 3 error site, 4 thread count, 5 a profile
buffer (or 0), then the dims, the leaf pointers and the output pointers, then a cache line per
step whose kernel shares its work by chunks (the chunk counter, zeroed before each run; see
FrameLayout and emit.Claims).
With a profile buffer, each thread records the cycle counter at the start, after each step and
after each barrier, in its own row: [start, step 0.., barrier 1..].
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import llvmlite.ir as ir

from llamir.backends.llvm import expr as E
from llamir.backends.llvm.emit import I32, I64, PTR, VOID, Emitter, Val
from llamir.backends.llvm.plan import Buffer, Kernel, Plan, Ref
from llamir.backends.llvm.runtime import SPLIT_FN_TYPE, emit_barrier
from llamir.backends.llvm.target import Target

ARENA, ERR_CODE, ERR_DETAIL, ERR_SITE, N_THREADS, PROFILE = 0, 1, 2, 3, 4, 5
FIRST_DIM = 6
ENTRY, ARENA_SIZE = "llamir_split", "llamir_arena_size"


COUNTER_SLOTS = 8       # a chunk counter's own cache line


@dataclass
class FrameLayout:
    dims: dict[str, int]
    leaves: dict[str, int]
    outputs: dict[str, int]
    size: int
    counters: dict[int, int] = field(default_factory=dict)   # step index -> its chunk counter's slot

    @property
    def counter_slots(self) -> slice:
        """The frame's counter lines (to zero before a run)."""
        if not self.counters:
            return slice(0, 0)
        return slice(min(self.counters.values()), self.size)

    @classmethod
    def of(cls, plan: Plan) -> FrameLayout:
        slot = FIRST_DIM
        dims = {}
        for name in plan.dim_names:
            dims[name] = slot
            slot += 1
        leaves = {}
        for name in plan.leaves:
            leaves[name] = slot
            slot += 1
        outputs = {}
        for name in plan.outputs:
            outputs[name] = slot
            slot += 1
        for name in plan.packed:
            leaves[name] = slot
            slot += 1
        counters = {}
        for i, step in enumerate(plan.steps):
            if step.kernel.shares_work:
                slot += -slot % COUNTER_SLOTS
                counters[i] = slot
                slot += COUNTER_SLOTS
        return cls(dims, leaves, outputs, slot, counters)


@dataclass
class KernelArgs:
    """What a kernel's emit() works with."""

    ith: ir.Value          # i64
    nth: ir.Value          # i64
    ptrs: list[ir.Value]
    ints: list[Val]
    frame: ir.Value
    counter: ir.Value | None = None    # the step's chunk counter (a kernel that shares_work)


def report_error(em: Emitter, frame: ir.Value, code: int, detail: ir.Value, site: Val) -> None:
    """Record an error in the frame (the executable raises it after the run)."""
    em.b.atomic_rmw("xchg", em.gep(frame, ERR_CODE * 8), ir.Constant(I64, code), "monotonic")
    em.store(em.i64(detail), frame, ERR_DETAIL * 8, align=8)
    em.store(em.i64(site), frame, ERR_SITE * 8, align=8)


def kernel_symbol(kernel: Kernel) -> str:
    """A stable symbol for a kernel: its class and a hash of its key (its static configuration).

    The symbol is also the kernel's identity within a module: keys compared as tuples would
    split one NaN attribute (NaN != NaN) into two kernels with one symbol, and merge 0.0 with
    -0.0; their repr (exact for floats, 'nan' for every NaN) is what the code depends on."""
    digest = hashlib.sha256(repr(kernel.key()).encode()).hexdigest()[:24]
    return f"llamir_{type(kernel).__name__}_{digest}"


def kernel_fn_type(kernel: Kernel) -> ir.FunctionType:
    """void (i32 ith, i32 nth, ptr x n_ptrs, i64 x run-time ints, ptr frame[, ptr counter])."""
    n_rt = sum(1 for p in kernel.pattern if p is None)
    tail = [PTR, PTR] if kernel.shares_work else [PTR]
    return ir.FunctionType(VOID, [I32, I32] + [PTR] * kernel.n_ptrs + [I64] * n_rt + tail)


def kernel_module(kernel: Kernel, target: Target) -> ir.Module:
    """A module defining one kernel function (external, named by kernel_symbol)."""
    module = ir.Module(kernel_symbol(kernel))
    module.triple = target.triple
    fn = ir.Function(module, kernel_fn_type(kernel), kernel_symbol(kernel))
    args = list(fn.args)
    counter = args.pop() if kernel.shares_work else None
    em = Emitter(module, fn, target, kernel.numerics)
    rt = iter(args[2 + kernel.n_ptrs:-1])
    ints: list[Val] = [p if p is not None else next(rt) for p in kernel.pattern]
    kargs = KernelArgs(em.b.zext(args[0], I64), em.b.zext(args[1], I64), args[2:2 + kernel.n_ptrs], ints,
                       args[-1], counter)
    kernel.emit(em, kargs)
    em.finish()
    return module


class ModuleBuilder:
    """The entry module of a split: declarations of its kernels, the entry, the arena size."""

    def __init__(self, plan: Plan, target: Target, name: str = "split"):
        self.plan = plan
        self.target = target
        self.module = ir.Module(name)
        self.module.triple = target.triple
        self.layout = FrameLayout.of(plan)
        self.kernels: dict[str, ir.Function] = {}   # by kernel_symbol

    def build(self) -> ir.Module:
        self._entry()
        self._arena_size()
        return self.module

    def distinct_kernels(self) -> list[Kernel]:
        """One kernel per distinct key, in first-use order."""
        seen: dict[str, Kernel] = {}
        for step in self.plan.steps:
            seen.setdefault(kernel_symbol(step.kernel), step.kernel)
        return list(seen.values())

    def kernel_fn(self, kernel: Kernel) -> ir.Function:
        symbol = kernel_symbol(kernel)
        fn = self.kernels.get(symbol)
        if fn is None:
            fn = self.kernels[symbol] = ir.Function(self.module, kernel_fn_type(kernel), symbol)
        return fn

    # -- the entry -------------------------------------------------------------------------------
    def _entry(self) -> None:
        fn = ir.Function(self.module, SPLIT_FN_TYPE, ENTRY)
        frame, ith, nth, pool = fn.args
        barrier = emit_barrier(self.module, self.target)
        em = Emitter(self.module, fn, self.target)
        values: dict = {}
        bases: dict[int, ir.Value] = {}
        ith64 = em.b.zext(ith, I64)
        b = em.b
        prof = em.load(PTR, frame, PROFILE * 8, align=8)
        recording = b.icmp_unsigned("!=", b.ptrtoint(prof, I64), ir.Constant(I64, 0))
        n_steps = len(self.plan.steps)
        n_slots = 2 + n_steps + self.plan.n_stages
        mine = em.gep(prof, em.mul(ith64, n_slots * 8))      # each thread its own row of stamps

        def stamp(slot: int) -> None:
            with em.if_(recording):
                em.store(em.intrinsic("llvm.readcyclecounter", I64, []), mine, slot * 8, align=8)

        stamp(0)
        index = {id(s): i for i, s in enumerate(self.plan.steps)}
        for stage in range(self.plan.n_stages):
            if stage:
                guard = self.plan.conditional.get(stage)
                if guard is None:
                    b.call(barrier, [pool, nth])
                else:   # every thread evaluates the same run-time condition
                    args = [em.i64(self._expr(em, frame, e, values)) for e in guard.barrier_args]
                    with em.if_(guard.barrier_if(em, args)):
                        b.call(barrier, [pool, nth])
                stamp(1 + n_steps + stage)
            for step in (s for s in self.plan.steps if s.stage == stage):
                kfn = self.kernel_fn(step.kernel)
                ptrs = [self._pointer(em, frame, p, ith64, values, bases) for p in step.ptrs]
                rt = [em.i64(self._expr(em, frame, v, values))
                      for v, p in zip(step.kernel.ints, step.kernel.pattern, strict=True) if p is None]
                counter = [em.gep(frame, self.layout.counters[index[id(step)]] * 8)] if step.kernel.shares_work else []
                b.call(kfn, [ith, nth] + ptrs + rt + [frame] + counter)
                stamp(1 + index[id(step)])
        em.finish()

    def _expr(self, em: Emitter, frame: ir.Value, e, values: dict) -> Val:
        if isinstance(e, int):
            return e
        if e in values:
            return values[e]
        op = e[0]
        if op == "v":
            slot = N_THREADS if e[1] == E.NTH else self.layout.dims[e[1]]
            out = em.load(I64, frame, slot * 8, align=8)
        elif op == "lit":
            out = ir.Constant(I64, e[1])
        elif op in ("+", "*"):
            parts = [self._expr(em, frame, t, values) for t in e[1]]
            out = parts[0]
            for p in parts[1:]:
                out = em.add(out, p) if op == "+" else em.mul(out, p)
        elif op == "max":
            out = em.max(self._expr(em, frame, e[1], values), self._expr(em, frame, e[2], values))
        else:
            a = self._expr(em, frame, e[1], values)
            if op == "align":
                out = em.mul(em.cdiv(a, e[2]), e[2])
            elif op == "//":
                out = em.div(a, e[2])
            elif op == "cdiv":
                out = em.cdiv(a, e[2])
            else:
                raise ValueError(f"unknown expression {e!r}")
        values[e] = out
        return out

    def _base(self, em: Emitter, frame: ir.Value, buf: Buffer, ith64, values, bases) -> ir.Value:
        if id(buf) in bases:
            return bases[id(buf)]
        if buf.kind == "temp":
            arena = bases.get("arena")
            if arena is None:
                arena = bases["arena"] = em.load(PTR, frame, ARENA * 8, align=8)
            off = self._expr(em, frame, buf.offset, values)
            if buf.per_thread:
                off = em.add(off, em.mul(ith64, self._expr(em, frame, buf.size, values)))
            base = em.gep(arena, off)
        else:
            slots = self.layout.outputs if buf.kind == "output" else self.layout.leaves
            base = em.load(PTR, frame, slots[buf.name] * 8, align=8)
        bases[id(buf)] = base
        return base

    def _pointer(self, em, frame, p, ith64, values, bases) -> ir.Value:
        if isinstance(p, Ref):
            buf, offset = p.buf, p.offset
        else:
            buf, offset = p
        base = self._base(em, frame, buf, ith64, values, bases)
        return em.gep(base, self._expr(em, frame, offset, values))

    def _arena_size(self) -> None:
        fn = ir.Function(self.module, ir.FunctionType(I64, [PTR]), ARENA_SIZE)
        em = Emitter(self.module, fn, self.target)
        size = self._expr(em, fn.args[0], self.plan.arena_size, {})
        em.b.ret(em.i64(size))
        em.finish()
