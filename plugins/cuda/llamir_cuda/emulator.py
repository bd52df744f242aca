"""A CUDA device emulated on the host: the kernels' HOST builds (kir.py) run under a SIMT
scheduler, over host memory, behind the same `DeviceContext` interface as the real driver.

Every GPU thread of a block is a fiber with its own small stack, switched by a few instructions
(x86-64: the callee-saved registers pushed, the stack pointer swapped; no system call). The scheduler
resumes each runnable thread until it yields at a barrier (it then waits for every live
thread of the block) or at a warp exchange (a shuffle or an mma: it waits for every live lane
of its warp), releases whoever may go on, and repeats until the block is done. Kernels without
barriers or shuffles run thread after thread without fibers. A block whose live threads all
wait and none can be released is a divergent barrier (a real GPU hangs or misbehaves on it):
the launch fails and says which block.

Blocks run one after another, so the emulator is slow and deterministic: for tests, not speed.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import platform
import threading

import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir

from llamir_cuda import kir
from llamir_cuda.driver import DeviceContext, DeviceInfo, Driver, DriverError, ImmediateStreams
from llamir_cuda.kir import I8, I32, I64, PTR, VOID

REC_BYTES = kir.REC_SP + 32

# llamir_emu_switch(save, sp): push the callee-saved registers, store the stack pointer at *save,
# continue on the stack `sp` (popping what its own switch pushed, returning where it was called).
# A new fiber's stack holds six zero registers and the address of llamir_emu_fiber.
SWITCH_ASM = (".text", ".globl llamir_emu_switch", ".type llamir_emu_switch,@function", ".p2align 4",
              "llamir_emu_switch:", "pushq %rbp", "pushq %rbx", "pushq %r12", "pushq %r13", "pushq %r14",
              "pushq %r15", "movq %rsp, (%rdi)", "movq %rsi, %rsp", "popq %r15", "popq %r14", "popq %r13",
              "popq %r12", "popq %rbx", "popq %rbp", "ret", ".size llamir_emu_switch, .-llamir_emu_switch")
SWITCH_TYPE = ir.FunctionType(VOID, [PTR, PTR])
STACK_BYTES = 64 << 10
RUN, DONE = 0, 3


def _runtime_module() -> ir.Module:
    """llamir_emu_launch(entry, args, recs, stacks, shared, xchg, sched, grid xyz, block xyz,
    shared_bytes, fibers) -> 0, or 1 + the index of a block whose barriers diverged."""
    m = ir.Module(name="llamir_emu_runtime")
    current_rec = ir.GlobalVariable(m, PTR, "llamir_emu_current_rec")
    current_rec.initializer = ir.Constant(PTR, None)
    current_rec.linkage = "internal"
    current_entry = ir.GlobalVariable(m, PTR, "llamir_emu_current_entry")
    current_entry.initializer = ir.Constant(PTR, None)
    current_entry.linkage = "internal"
    switch = ir.Function(m, SWITCH_TYPE, "llamir_emu_switch")
    memset = ir.Function(m, ir.FunctionType(VOID, [PTR, I8, I64, ir.IntType(1)]), "llvm.memset.p0.i64")
    entry_ty = ir.FunctionType(VOID, [PTR])

    # the fiber's body: run the kernel for the current thread, mark it done, switch back to the
    # scheduler for good
    fiber = ir.Function(m, ir.FunctionType(VOID, []), "llamir_emu_fiber")
    fiber.linkage = "internal"
    b = ir.IRBuilder(fiber.append_basic_block())
    rec = b.load(current_rec, typ=PTR)
    b.call(_TypedCallee(b.load(current_entry, typ=PTR), entry_ty), [rec])
    b.store(ir.Constant(I32, DONE), b.gep(rec, [ir.Constant(I64, kir.REC_STATE)], source_etype=I8))
    sched_sp = b.load(b.load(b.gep(rec, [ir.Constant(I64, kir.REC_SCHED)], source_etype=I8), typ=PTR), typ=PTR)
    b.call(switch, [b.gep(rec, [ir.Constant(I64, kir.REC_SP)], source_etype=I8), sched_sp])
    b.unreachable()

    args = [PTR, PTR, PTR, PTR, PTR, PTR, PTR] + [I32] * 6 + [I64, I32]
    fn = ir.Function(m, ir.FunctionType(I32, args), "llamir_emu_launch")
    (entry, kargs, recs, stacks, shared, xchg, sched, gx, gy, gz, bx, by, bz, shared_bytes, fibers) = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    b.store(entry, current_entry)
    n_thr = b.mul(b.mul(bx, by), bz)
    n_blk = b.mul(b.mul(gx, gy), gz)

    def put(r, offset, value):
        b.store(value, b.gep(r, [ir.Constant(I64, offset)], source_etype=I8))

    def get(r, offset, ty=I32):
        return b.load(b.gep(r, [ir.Constant(I64, offset)], source_etype=I8), typ=ty)

    def rec_of(t):
        return b.gep(recs, [b.mul(b.zext(t, I64), ir.Constant(I64, REC_BYTES))], source_etype=I8)

    loop = _Loops(fn, b)
    with loop.count(n_blk) as blk:
        cx = b.urem(blk, gx)
        cy = b.urem(b.udiv(blk, gx), gy)
        cz = b.udiv(blk, b.mul(gx, gy))
        b.call(memset, [shared, ir.Constant(I8, 0), shared_bytes, ir.Constant(ir.IntType(1), 0)])
        with loop.count(n_thr) as t:
            r = rec_of(t)
            for axis, v in enumerate((b.urem(t, bx), b.urem(b.udiv(t, bx), by), b.udiv(t, b.mul(bx, by)))):
                put(r, kir.REC_TID + 4 * axis, v)
            for axis, v in enumerate((cx, cy, cz)):
                put(r, kir.REC_CTAID + 4 * axis, v)
            for axis, v in enumerate((bx, by, bz)):
                put(r, kir.REC_NTID + 4 * axis, v)
            for axis, v in enumerate((gx, gy, gz)):
                put(r, kir.REC_NCTAID + 4 * axis, v)
            put(r, kir.REC_LINEAR, t)
            put(r, kir.REC_STATE, ir.Constant(I32, RUN))
            put(r, kir.REC_SHARED, shared)
            put(r, kir.REC_XCHG, xchg)
            put(r, kir.REC_ARGS, kargs)
            put(r, kir.REC_SCHED, sched)
            put(r, kir.REC_SWITCH, switch)
        no_fibers = b.icmp_unsigned("==", fibers, ir.Constant(I32, 0))
        with b.if_else(no_fibers) as (plain, with_fibers):
            with plain:
                with loop.count(n_thr) as t:
                    b.call(_TypedCallee(entry, entry_ty), [rec_of(t)])
            with with_fibers:
                with loop.count(n_thr) as t:
                    r = rec_of(t)
                    top = b.gep(stacks, [b.mul(b.zext(b.add(t, ir.Constant(I32, 1)), I64),
                                              ir.Constant(I64, STACK_BYTES))], source_etype=I8)
                    sp = b.gep(top, [ir.Constant(I64, -64)], source_etype=I8)
                    for slot in range(6):
                        put(sp, 8 * slot, ir.Constant(I64, 0))
                    put(sp, 48, fiber)
                    put(sp, 56, ir.Constant(I64, 0))
                    put(r, kir.REC_SP, sp)
                status = _schedule(b, loop, n_thr, rec_of, get, put, switch, sched, current_rec)
                failed = b.icmp_unsigned("!=", status, ir.Constant(I32, 0))
                with b.if_then(failed):
                    b.ret(b.add(blk, ir.Constant(I32, 1)))
    b.ret(ir.Constant(I32, 0))
    return m


class _TypedCallee:
    """A call target from an opaque function pointer, typed by the call's function type
    (llvmlite's call reads `.type` and `.function_type`)."""

    def __init__(self, ptr, fnty):
        self.ptr, self.function_type = ptr, fnty
        self.type = ptr.type

    def get_reference(self):
        return self.ptr.get_reference()

    def __str__(self):
        return str(self.ptr)


def _schedule(b, loop, n_thr, rec_of, get, put, switch, sched, current_rec):
    """Resume runnable threads until the block is done: 0, or 1 when its live threads all wait
    and none may go on."""
    fn = b.function
    head = fn.append_basic_block("sched")
    out = fn.append_basic_block("sched_out")
    result = b.alloca(I32)
    b.branch(head)
    b.position_at_end(head)
    with loop.count(n_thr) as t:
        r = rec_of(t)
        with b.if_then(b.icmp_unsigned("==", get(r, kir.REC_STATE), ir.Constant(I32, RUN))):
            b.store(r, current_rec)
            b.call(switch, [sched, get(r, kir.REC_SP, PTR)])
    live, at_barrier = b.alloca(I32), b.alloca(I32)
    b.store(ir.Constant(I32, 0), live)
    b.store(ir.Constant(I32, 0), at_barrier)
    with loop.count(n_thr) as t:
        state = get(rec_of(t), kir.REC_STATE)
        b.store(b.add(b.load(live), b.zext(b.icmp_unsigned("!=", state, ir.Constant(I32, DONE)), I32)), live)
        is_bar = b.icmp_unsigned("==", state, ir.Constant(I32, kir.SYNC_BLOCK))
        b.store(b.add(b.load(at_barrier), b.zext(is_bar, I32)), at_barrier)
    n_live = b.load(live)
    all_done = b.icmp_unsigned("==", n_live, ir.Constant(I32, 0))
    b.store(ir.Constant(I32, 0), result)
    cont = fn.append_basic_block("sched_more")
    b.cbranch(all_done, out, cont)
    b.position_at_end(cont)
    released = b.alloca(I32)
    b.store(ir.Constant(I32, 0), released)
    whole_block = b.icmp_unsigned("==", b.load(at_barrier), n_live)
    with b.if_else(whole_block) as (release_block, release_warps):
        with release_block:
            with loop.count(n_thr) as t:
                r = rec_of(t)
                with b.if_then(b.icmp_unsigned("==", get(r, kir.REC_STATE), ir.Constant(I32, kir.SYNC_BLOCK))):
                    put(r, kir.REC_STATE, ir.Constant(I32, RUN))
                    b.store(ir.Constant(I32, 1), released)
        with release_warps:
            n_warps = b.udiv(b.add(n_thr, ir.Constant(I32, kir.WARP - 1)), ir.Constant(I32, kir.WARP))
            with loop.count(n_warps) as w:
                lo = b.mul(w, ir.Constant(I32, kir.WARP))
                hi = b.add(lo, ir.Constant(I32, kir.WARP))
                hi = b.select(b.icmp_unsigned("<", hi, n_thr), hi, n_thr)
                wl, ww = b.alloca(I32), b.alloca(I32)
                b.store(ir.Constant(I32, 0), wl)
                b.store(ir.Constant(I32, 0), ww)
                with loop.range(lo, hi) as t:
                    state = get(rec_of(t), kir.REC_STATE)
                    b.store(b.add(b.load(wl), b.zext(b.icmp_unsigned("!=", state, ir.Constant(I32, DONE)), I32)), wl)
                    is_w = b.icmp_unsigned("==", state, ir.Constant(I32, kir.SYNC_WARP))
                    b.store(b.add(b.load(ww), b.zext(is_w, I32)), ww)
                n_wl = b.load(wl)
                ready = b.and_(b.icmp_unsigned("!=", n_wl, ir.Constant(I32, 0)),
                               b.icmp_unsigned("==", b.load(ww), n_wl))
                with b.if_then(ready):
                    with loop.range(lo, hi) as t:
                        r = rec_of(t)
                        with b.if_then(b.icmp_unsigned("==", get(r, kir.REC_STATE), ir.Constant(I32, kir.SYNC_WARP))):
                            put(r, kir.REC_STATE, ir.Constant(I32, RUN))
                    b.store(ir.Constant(I32, 1), released)
    stuck = b.icmp_unsigned("==", b.load(released), ir.Constant(I32, 0))
    b.store(ir.Constant(I32, 1), result)
    b.cbranch(stuck, out, head)
    b.position_at_end(out)
    return b.load(result)


class _Loops:
    """Counted loops for the runtime's builder."""

    def __init__(self, fn, b):
        self.fn, self.b = fn, b

    def count(self, n):
        return self.range(ir.Constant(I32, 0), n)

    def range(self, lo, hi):
        @contextlib.contextmanager
        def gen():
            b = self.b
            slot = b.alloca(I32)
            b.store(lo, slot)
            head, body, done = (self.fn.append_basic_block(n) for n in ("rt_loop", "rt_body", "rt_done"))
            b.branch(head)
            b.position_at_end(head)
            i = b.load(slot)
            b.cbranch(b.icmp_unsigned("<", i, hi), body, done)
            b.position_at_end(body)
            yield i
            b.store(b.add(i, ir.Constant(I32, 1)), slot)
            b.branch(head)
            b.position_at_end(done)

        return gen()


def _yield_definition(module: ir.Module) -> None:
    """llamir_emu_yield(rec, kind) inside a kernel's host module: mark what the thread waits for
    and switch to the scheduler."""
    fn = module.globals.get("llamir_emu_yield")
    if fn is None or not fn.is_declaration:
        return
    fn.linkage = "internal"
    rec, kind = fn.args
    b = ir.IRBuilder(fn.append_basic_block())

    def field(offset):
        return b.gep(rec, [ir.Constant(I64, offset)], source_etype=I8)

    b.store(kind, field(kir.REC_STATE))
    sched_sp = b.load(b.load(field(kir.REC_SCHED), typ=PTR), typ=PTR)
    b.call(_TypedCallee(b.load(field(kir.REC_SWITCH), typ=PTR), SWITCH_TYPE), [field(kir.REC_SP), sched_sp])
    b.ret_void()


# -- the JIT ---------------------------------------------------------------------------------
_jit_lock = threading.RLock()
_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int32, *([ctypes.c_void_p] * 7), *([ctypes.c_int32] * 6),
                           ctypes.c_int64, ctypes.c_int32)


@functools.cache
def _host_machine():
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    llvm.initialize_native_asmparser()  # the context switch is module-level assembly
    target = llvm.Target.from_default_triple()
    return target.create_target_machine(cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(),
                                        opt=1, jit=True)


@functools.cache
def _lljit():
    return llvm.create_lljit_compiler(_host_machine())


_counter = iter(range(1 << 62))


def _jit(module: ir.Module, exports: list[str], asm: tuple[str, ...] = ()) -> tuple[object, dict[str, int]]:
    machine = _host_machine()
    text = str(module) + "".join(f'\nmodule asm "{line}"' for line in asm)
    ref = llvm.parse_assembly(text)
    ref.triple = llvm.get_process_triple()
    ref.data_layout = str(machine.target_data)
    ref.verify()
    kir._optimize(ref, machine, speed_level=1)  # the emulator wants quick compiles over quick code
    obj = machine.emit_object(ref)
    with _jit_lock:
        builder = llvm.JITLibraryBuilder()
        builder.add_object_img(obj)
        builder.add_current_process()
        for e in exports:
            builder.export_symbol(e)
        tracker = builder.link(_lljit(), f"llamir_cuda_emu_{next(_counter)}")
    return tracker, {e: tracker[e] for e in exports}


@functools.cache
def _runtime():
    if platform.machine() not in ("x86_64", "AMD64"):
        raise DriverError(f"the CUDA emulator switches fibers with x86-64 code; this host is {platform.machine()}")
    tracker, addrs = _jit(_runtime_module(), ["llamir_emu_launch"], SWITCH_ASM)
    return tracker, _LAUNCH(addrs["llamir_emu_launch"])


@functools.cache
def _host_function(kernel: kir.Kernel) -> tuple[object, int]:
    kb = kernel.build(kir.HOST)
    module = kb.module
    _yield_definition(module)
    return _jit(module, [kernel.name])


# -- the device ------------------------------------------------------------------------------
EMULATED = DeviceInfo(0, "llamir SIMT emulator (host CPU)", (9, 0), 16 << 30, 1)


class Emulator(Driver):
    """One emulated device of sm_90's semantics and 16 GiB."""

    name = "emulator"

    def __init__(self):
        self._context: EmulatedContext | None = None

    def devices(self) -> list[DeviceInfo]:
        return [EMULATED]

    def context(self, index: int) -> EmulatedContext:
        if index != 0:
            raise DriverError(f"the emulator has one device, not {index + 1}")
        if self._context is None:
            self._context = EmulatedContext(EMULATED)
        return self._context


@functools.cache
def shared_emulator() -> Emulator:
    return Emulator()


class EmulatedContext(ImmediateStreams, DeviceContext):
    """Device memory is host memory; copies and launches run at once, so streams and events are
    already in order."""

    def __init__(self, info: DeviceInfo):
        self.info = info
        self._memory: dict[int, np.ndarray] = {}
        self._scratch: dict[int, tuple] = {}
        self._launch_lock = threading.Lock()
        self.n_launches = self.n_graphs = self.n_graph_launches = 0

    # -- memory ------------------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> int:
        raw = np.zeros(int(nbytes) + 256, np.uint8)
        ptr = (raw.ctypes.data + 255) // 256 * 256
        self._memory[ptr] = raw
        return ptr

    def free(self, ptr: int) -> None:
        if self._memory.pop(ptr, None) is None:
            raise DriverError(f"free of {ptr:#x}: not a device allocation")

    def alloc_host(self, nbytes: int) -> np.ndarray:
        return np.zeros(int(nbytes), np.uint8)

    def free_host(self, array: np.ndarray) -> None:
        pass

    def memcpy_htod_async(self, dst: int, src: np.ndarray, stream=None) -> None:
        src = np.ascontiguousarray(src)
        ctypes.memmove(dst, src.ctypes.data, src.nbytes)

    def memcpy_dtoh_async(self, dst: np.ndarray, src: int, stream=None) -> None:
        if not dst.flags.c_contiguous:
            raise DriverError("memcpy_dtoh_async needs a C-contiguous destination")
        ctypes.memmove(dst.ctypes.data, src, dst.nbytes)

    def memcpy_dtod_async(self, dst: int, src: int, nbytes: int, stream=None) -> None:
        if _capturing(stream):
            stream.captured.append((self.memcpy_dtod_async, (dst, src, nbytes)))
            return
        ctypes.memmove(dst, src, int(nbytes))

    def memset_async(self, dst: int, value: int, nbytes: int, stream=None) -> None:
        ctypes.memset(dst, int(value), int(nbytes))

    # -- kernels ---------------------------------------------------------------------------------
    def load(self, kernel: kir.Kernel) -> tuple[kir.Kernel, int]:
        tracker, addrs = _host_function(kernel)
        return kernel, addrs[kernel.name]

    def _buffers(self, n_threads: int, shared_bytes: int):
        """The launch's records, stacks, shared memory, exchange words and scheduler context,
        kept per block size."""
        bufs = self._scratch.get(n_threads)
        if bufs is None or bufs[2].nbytes < shared_bytes + 16:
            bufs = (np.zeros(n_threads * REC_BYTES, np.uint8), np.empty(n_threads * STACK_BYTES + 16, np.uint8),
                    np.zeros(max(shared_bytes, 48 << 10) + 16, np.uint8),
                    np.zeros(n_threads * kir.XCHG_WORDS * 4 + 64, np.uint8), np.zeros(64, np.uint8))
            self._scratch[n_threads] = bufs
        return bufs

    def launch(self, function, grid, block, args, stream=None) -> None:
        if _capturing(stream):
            stream.captured.append((self.launch, (function, grid, block, list(args))))
            return
        kernel, address = function
        slots = pack_slots(kernel.params, args)
        n_threads = int(np.prod(block))
        if tuple(block) != kernel.block:
            raise DriverError(f"{kernel.name} is built for blocks of {kernel.block}, launched with {tuple(block)}")
        if min(grid) < 1:
            raise DriverError(f"{kernel.name}: empty grid {tuple(grid)}")
        _, run = _runtime()
        with self._launch_lock:
            recs, stacks, shared, xchg, sched = self._buffers(n_threads, kernel.shared_bytes)
            status = run(address, slots.ctypes.data, recs.ctypes.data, _aligned(stacks),
                         _aligned(shared), _aligned(xchg), _aligned(sched), *map(int, grid), *map(int, block),
                         kernel.shared_bytes, int(kernel.uses_sync))
            self.n_launches += 1
        if status:
            raise DriverError(f"{kernel.name}: block {status - 1} of grid {tuple(grid)}: every live thread waits "
                              "at a barrier or warp exchange that not all of them reach (divergent barrier)")

    # -- streams and events ----------------------------------------------------------------------
    def stream_new(self) -> object:
        return _Stream()

    # -- CUDA graphs: a capture records the stream's work; a launch of the graph replays it ------
    supports_graphs = True

    def begin_capture(self, stream) -> None:
        if not isinstance(stream, _Stream):
            raise DriverError("the default stream cannot be captured")
        if stream.captured is not None:
            raise DriverError("the stream is already capturing")
        stream.captured = []

    def end_capture(self, stream) -> list:
        if not isinstance(stream, _Stream) or stream.captured is None:
            raise DriverError("end_capture on a stream that is not capturing")
        graph, stream.captured = stream.captured, None
        self.n_graphs += 1
        return graph

    def graph_launch(self, graph, stream=None) -> None:
        if _capturing(stream):
            raise DriverError("a graph launched into a capture")
        for call, args in graph:
            call(*args)
        self.n_graph_launches += 1


class _Stream:
    """An emulated stream: work runs at once, except while it is being captured."""

    def __init__(self):
        self.captured: list | None = None


def _capturing(stream) -> bool:
    return isinstance(stream, _Stream) and stream.captured is not None


def _aligned(array: np.ndarray) -> int:
    return (array.ctypes.data + 15) // 16 * 16


def pack_slots(signature: tuple[str, ...], args: list) -> np.ndarray:
    """The kernel's arguments as 8-byte slots (what a host kernel reads from its record)."""
    if len(args) != len(signature):
        raise DriverError(f"the kernel takes {len(signature)} arguments, got {len(args)}")
    slots = np.zeros(len(signature), np.uint64)
    for i, (kind, value) in enumerate(zip(signature, args, strict=True)):
        if kind == "f":
            slots[i] = int(np.array(value, np.float32).view(np.uint32))
        elif kind == "i":
            slots[i] = int(value) & 0xFFFFFFFF
        else:
            slots[i] = int(value) & 0xFFFFFFFFFFFFFFFF
    return slots
