"""The native runtime: a persistent thread pool and ggml's barrier, written in LLVM IR.

A compiled split is `void split(ptr frame, i32 ith, i32 nth, ptr pool)`: every thread runs it
with its own ith and takes its share of each op, with `llamir_barrier` between dependent ops
(as ggml's CPU backend does). `llamir_pool_run` starts the workers on a split, runs thread 0
itself and returns when all are done; it is called through ctypes, which releases the GIL, so
no Python runs between ops. Idle workers spin briefly, then sleep on a futex (Linux).

Pool state (one cache line per field, no false sharing):
    +0 generation   +64 pending workers   +128 barrier count   +192 barrier passed
    +256 fn, +264 frame, +272 nth, +276 stop   +320 sleepers, +328 spin cycles
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
import threading
import weakref

import llvmlite.binding as llvm
import llvmlite.ir as ir
import numpy as np

from llamir.backends.llvm.emit import I32, I64, PTR, VOID, Emitter
from llamir.backends.llvm.target import Target, host_target

GEN, PENDING, BAR_COUNT, BAR_PASSED = 0, 64, 128, 192
FN, FRAME, NTH, STOP, SLEEPERS, SPIN = 256, 264, 272, 276, 320, 328
STATE_BYTES = 384
SPIN_SECONDS = 0.003            # an idle worker spins this long (checked on the cycle counter), then sleeps
YIELD_AFTER = 1 << 10           # pause loops before a barrier or join also yields the CPU
SYS_FUTEX, FUTEX_WAIT_PRIVATE, FUTEX_WAKE_PRIVATE = 202, 128, 129

SPLIT_FN_TYPE = ir.FunctionType(VOID, [PTR, I32, I32, PTR])


def _field(em: Emitter, state: ir.Value, offset: int) -> ir.Value:
    return em.gep(state, offset)


def _pause(em: Emitter) -> None:
    if em.target.triple.startswith("x86_64"):
        em.intrinsic("llvm.x86.sse2.pause", VOID, [])


def _spin_wait(em: Emitter, spins: ir.Value) -> None:
    """One idle step of a waiting thread: pause, and once it has waited YIELD_AFTER steps, also
    sched_yield, so that a waiter on an oversubscribed machine lets the thread it waits for run."""
    b = em.b
    n = em.get(spins)
    _pause(em)
    with em.if_(b.icmp_unsigned(">=", n, ir.Constant(I32, YIELD_AFTER))):
        b.call(em.declare("sched_yield", I32, []), [])
    em.set(spins, b.add(n, ir.Constant(I32, 1)))


def _futex(em: Emitter, addr: ir.Value, op: int, value: ir.Value) -> None:
    syscall = em.declare("syscall", I64, [I64], var_arg=True)
    em.b.call(syscall, [ir.Constant(I64, SYS_FUTEX), addr, ir.Constant(I64, op), em.b.zext(value, I64),
                        ir.Constant(PTR, None)])


def emit_barrier(module: ir.Module, target: Target) -> ir.Function:
    """`void llamir_barrier(ptr state, i32 nth)`, internal to `module` (ggml_barrier)."""
    name = "llamir_barrier"
    if name in module.globals:
        return module.globals[name]
    fn = ir.Function(module, ir.FunctionType(VOID, [PTR, I32]), name)
    fn.linkage = "internal"
    fn.attributes.add("noinline")   # called between every two stages; one copy is enough
    state, nth = fn.args
    em = Emitter(module, fn, target)
    b = em.b
    with em.if_(b.icmp_signed(">", nth, ir.Constant(I32, 1))):
        passed_ptr = _field(em, state, BAR_PASSED)
        count_ptr = _field(em, state, BAR_COUNT)
        passed = b.load_atomic(passed_ptr, "acquire", 4, typ=I32)
        arrived = b.atomic_rmw("add", count_ptr, ir.Constant(I32, 1), "acq_rel")
        last = b.icmp_signed("==", arrived, b.sub(nth, ir.Constant(I32, 1)))
        with em.if_else(last) as (then, otherwise):
            with then:
                b.atomic_rmw("xchg", count_ptr, ir.Constant(I32, 0), "monotonic")
                b.atomic_rmw("add", passed_ptr, ir.Constant(I32, 1), "seq_cst")
            with otherwise:
                spins = em.var(I32, ir.Constant(I32, 0))
                head = fn.append_basic_block("wait")
                done = fn.append_basic_block("passed")
                b.branch(head)
                b.position_at_end(head)
                now = b.load_atomic(passed_ptr, "acquire", 4, typ=I32)
                spin = fn.append_basic_block("spin")
                b.cbranch(b.icmp_signed("==", now, passed), spin, done)
                b.position_at_end(spin)
                _spin_wait(em, spins)
                b.branch(head)
                b.position_at_end(done)
    em.finish()
    return fn


def _call_split(em: Emitter, state: ir.Value, ith: ir.Value) -> None:
    b = em.b
    fn_addr = em.load(I64, state, FN, align=8)
    frame = em.load(PTR, state, FRAME, align=8)
    nth = em.load(I32, state, NTH, align=4)
    with em.if_(b.icmp_signed("<", ith, nth)):
        b.call(b.inttoptr(fn_addr, ir.PointerType(SPLIT_FN_TYPE)), [frame, ith, nth, state])


def _emit_worker(module: ir.Module, target: Target) -> None:
    """`void llamir_pool_worker(ptr state, i32 ith)`: wait for a new generation, run, repeat."""
    fn = ir.Function(module, ir.FunctionType(VOID, [PTR, I32]), "llamir_pool_worker")
    state, ith = fn.args
    em = Emitter(module, fn, target)
    b = em.b
    gen_ptr = _field(em, state, GEN)
    seen = em.var(I32, ir.Constant(I32, 0), "seen")  # generation 0 is the pool's start: never work
    outer = fn.append_basic_block("next")
    b.branch(outer)
    b.position_at_end(outer)
    idle_since = em.var(I64, em.intrinsic("llvm.readcyclecounter", I64, []), "idle_since")
    wait = fn.append_basic_block("wait")
    work = fn.append_basic_block("work")
    b.branch(wait)
    b.position_at_end(wait)
    now = b.load_atomic(gen_ptr, "acquire", 4, typ=I32)
    idle = fn.append_basic_block("idle")
    b.cbranch(b.icmp_signed("==", now, em.get(seen)), idle, work)
    b.position_at_end(idle)
    waited = b.sub(em.intrinsic("llvm.readcyclecounter", I64, []), em.get(idle_since))
    spin_cycles = em.load(I64, state, SPIN, align=8)
    with em.if_else(b.icmp_unsigned("<", waited, spin_cycles)) as (then, otherwise):
        with then:
            _pause(em)
        with otherwise:
            sleepers = _field(em, state, SLEEPERS)
            b.atomic_rmw("add", sleepers, ir.Constant(I32, 1), "seq_cst")
            _futex(em, gen_ptr, FUTEX_WAIT_PRIVATE, em.get(seen))
            b.atomic_rmw("sub", sleepers, ir.Constant(I32, 1), "seq_cst")
            em.set(idle_since, em.intrinsic("llvm.readcyclecounter", I64, []))
    b.branch(wait)
    b.position_at_end(work)
    em.set(seen, now)
    stop = b.load_atomic(_field(em, state, STOP), "acquire", 4, typ=I32)
    exit_block = fn.append_basic_block("exit")
    run = fn.append_basic_block("run")
    b.cbranch(b.icmp_signed("!=", stop, ir.Constant(I32, 0)), exit_block, run)
    b.position_at_end(run)
    _call_split(em, state, ith)
    b.atomic_rmw("sub", _field(em, state, PENDING), ir.Constant(I32, 1), "release")
    b.branch(outer)
    b.position_at_end(exit_block)
    b.atomic_rmw("sub", _field(em, state, PENDING), ir.Constant(I32, 1), "release")
    em.finish()


def _emit_run(module: ir.Module, target: Target) -> None:
    """`void llamir_pool_run(ptr state, i64 fn, ptr frame, i32 nth, i32 n_workers)`: publish the
    work, wake sleepers, run thread 0, wait for the workers."""
    fn = ir.Function(module, ir.FunctionType(VOID, [PTR, I64, PTR, I32, I32]), "llamir_pool_run")
    state, fn_addr, frame, nth, n_workers = fn.args
    em = Emitter(module, fn, target)
    b = em.b
    em.store(fn_addr, state, FN, align=8)
    em.store(frame, state, FRAME, align=8)
    em.store(nth, state, NTH, align=4)
    b.atomic_rmw("xchg", _field(em, state, PENDING), n_workers, "release")
    gen_ptr = _field(em, state, GEN)
    b.atomic_rmw("add", gen_ptr, ir.Constant(I32, 1), "seq_cst")
    sleepers = b.load_atomic(_field(em, state, SLEEPERS), "seq_cst", 4, typ=I32)
    with em.if_(b.icmp_signed("!=", sleepers, ir.Constant(I32, 0))):
        _futex(em, gen_ptr, FUTEX_WAKE_PRIVATE, ir.Constant(I32, 0x7FFFFFFF))
    _call_split(em, state, ir.Constant(I32, 0))
    spins = em.var(I32, ir.Constant(I32, 0))
    head = fn.append_basic_block("join")
    done = fn.append_basic_block("joined")
    spin = fn.append_basic_block("spin")
    b.branch(head)
    b.position_at_end(head)
    pending = b.load_atomic(_field(em, state, PENDING), "acquire", 4, typ=I32)
    b.cbranch(b.icmp_signed("==", pending, ir.Constant(I32, 0)), done, spin)
    b.position_at_end(spin)
    _spin_wait(em, spins)
    b.branch(head)
    b.position_at_end(done)
    em.finish()


def runtime_module(target: Target) -> ir.Module:
    module = ir.Module("llamir_runtime")
    module.triple = target.triple
    _emit_worker(module, target)
    _emit_run(module, target)
    cycles = ir.Function(module, ir.FunctionType(I64, []), "llamir_cycles")
    em = Emitter(module, cycles, target)
    em.b.ret(em.intrinsic("llvm.readcyclecounter", I64, []))
    em.finish()
    return module


# -- the JIT ---------------------------------------------------------------------------------
_lib_counter = itertools.count()
_jit_lock = threading.Lock()


@functools.cache
def _lljit(target: Target):
    return llvm.create_lljit_compiler(target.machine())


def load_object(target: Target, objects: bytes | list[bytes], exports: list[str]):
    """Link object code into the process; returns (tracker, {name: address}). The code stays
    loaded while the tracker is referenced."""
    if isinstance(objects, bytes):
        objects = [objects]
    with _jit_lock:
        name = f"llamir_{next(_lib_counter)}"
        builder = llvm.JITLibraryBuilder()
        for obj in objects:
            builder.add_object_img(obj)
        builder.add_current_process()
        for e in exports:
            builder.export_symbol(e)
        tracker = builder.link(_lljit(target), name)
    return tracker, {e: tracker[e] for e in exports}


@functools.cache
def _runtime_library(target: Target):
    from llamir.backends.llvm.compiler import optimize_and_emit

    obj = optimize_and_emit(runtime_module(target), target)
    return load_object(target, obj, ["llamir_pool_worker", "llamir_pool_run", "llamir_cycles"])


def read_cycles() -> int:
    """The CPU's cycle counter (rdtsc), for profiles."""
    _, addrs = _runtime_library(host_target())
    return ctypes.CFUNCTYPE(ctypes.c_int64)(addrs["llamir_cycles"])()


_RUN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32)
_WORKER = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int32)
_SPLIT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p)


class ThreadPool:
    """n_threads - 1 worker threads (the caller is thread 0) that run compiled splits."""

    def __init__(self, n_threads: int, target: Target | None = None):
        if n_threads < 1:
            raise ValueError(f"n_threads must be >= 1, got {n_threads}")
        self.target = target or host_target()
        self.n_threads = n_threads
        self._tracker, addrs = _runtime_library(self.target)
        self._run = _RUN(addrs["llamir_pool_run"])
        worker = _WORKER(addrs["llamir_pool_worker"])
        self._state = np.zeros(STATE_BYTES + 64, dtype=np.uint8)
        base = self._state.ctypes.data
        self._state_ptr = base + (-base % 64)
        from llamir.backends.llvm.executable import tsc_hz

        spin = int(SPIN_SECONDS * tsc_hz())
        self._state.view(np.int64)[(self._state_ptr - base + SPIN) // 8] = spin
        self.lock = threading.Lock()
        self._direct: dict[int, object] = {}
        self._threads = [threading.Thread(target=worker, args=(self._state_ptr, i), daemon=True,
                                          name=f"llamir-worker-{i}") for i in range(1, n_threads)]
        for t in self._threads:
            t.start()
        self._pid = os.getpid()
        self._finalizer = weakref.finalize(self, _stop, self._run, self._state, self._state_ptr,
                                           self._threads, self._tracker, self._pid)

    def run(self, fn_addr: int, frame_ptr: int, n_threads: int | None = None) -> None:
        """Run `fn_addr` (a compiled split) on `frame_ptr` with all threads; returns when done.
        The caller holds `lock` (one run at a time per pool)."""
        if self._pid != os.getpid():
            raise RuntimeError("this thread pool was created in another process (after fork, create a new "
                               "backend or call close() and use it again)")
        nth = self.n_threads if n_threads is None else max(1, min(n_threads, self.n_threads))
        if nth == 1:   # no workers to wake: run the split on this thread alone
            fn = self._direct.get(fn_addr)
            if fn is None:
                fn = self._direct[fn_addr] = _SPLIT(fn_addr)
            fn(frame_ptr, 0, 1, self._state_ptr)
            return
        self._run(self._state_ptr, fn_addr, frame_ptr, nth, len(self._threads))

    def close(self) -> None:
        self._finalizer()


def _stop(run, state, state_ptr, threads, tracker, pid: int) -> None:
    """Tell the workers to exit (stop flag, new generation, futex wake) and join them. In a forked
    child (a compile worker) the pool's threads do not exist: waiting for them would spin forever."""
    if not threads or os.getpid() != pid:
        return
    state.view(np.int32)[(state_ptr - state.ctypes.data + STOP) // 4] = 1
    run(state_ptr, 0, 0, 0, len(threads))   # nth = 0: nobody runs the (null) split; workers see stop
    for t in threads:
        t.join(timeout=5)
    del tracker
