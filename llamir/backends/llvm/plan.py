"""The lowering plan of one split: where every value lives, the kernel steps that compute them,
the barriers between dependent steps, and the arena layout of the temporaries.

Values live in buffers: a leaf's array (weights, inputs, the KV cache), an output array that
the caller receives, or a temporary in the arena. Views are only new (offset, shape, strides)
over their source's buffer; set_rows writes into its destination's buffer. Offsets, shapes and
strides are expressions over the run-time dims (expr.py).

Steps run in order on every thread. A barrier separates a step from an earlier one of the same
stage when it reads what another thread may have written, or overwrites what another thread may
still read, except when both split the same rows the same way (a row-wise chain needs none).
Temporaries then share arena memory when their stage intervals do not overlap.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from llamir.backends.llvm import expr as E
from llamir.backends.llvm.expr import Expr
from llamir.ir import Node, ops
from llamir.ir.dtypes import DType
from llamir.ir.numerics import AVX512, Numerics

ALIGN = 64


class Buffer:
    """A block of memory the split uses. kind: "leaf" (by name), "output" (by name), "temp"."""

    def __init__(self, kind: str, name: str, size: Expr = 0, per_thread: bool = False):
        self.kind = kind
        self.name = name
        self.size = size                 # bytes (temps; per thread when per_thread)
        self.per_thread = per_thread
        self.offset: Expr = 0            # arena offset, set by the memory plan
        self.first = self.last = -1      # stages that use it

    def __repr__(self) -> str:
        return f"<{self.kind} {self.name}>"


@dataclass(frozen=True)
class Ref:
    """A tensor in memory: numpy-order shape (elements) and byte strides (the last one is the
    element or block size), starting `offset` bytes into `buf`."""

    buf: Buffer
    offset: Expr
    shape: tuple[Expr, ...]
    strides: tuple[Expr, ...]
    dtype: DType

    @property
    def rank(self) -> int:
        return len(self.shape)

    def row_bytes(self) -> Expr:
        n = self.shape[-1]
        if self.dtype.block_size == 1:
            return E.mul(n, self.dtype.type_size)
        if not isinstance(n, int):
            raise ValueError(f"quantized rows must have a static length, got {n}")
        return self.dtype.row_bytes(n)

    def contiguous_strides(self) -> tuple[Expr, ...]:
        return contiguous_strides(self.shape, self.dtype)

    @property
    def is_contiguous(self) -> bool:
        want = self.contiguous_strides()
        return all(s == w for s, w, n in zip(self.strides, want, self.shape, strict=True) if n != 1)

    def padded(self, rank: int = 4) -> Ref:
        """The same tensor with leading size-1 axes up to `rank`."""
        k = rank - self.rank
        return Ref(self.buf, self.offset, (1,) * k + self.shape, (0,) * k + self.strides, self.dtype)

    def nbytes(self) -> Expr:
        if not self.shape:
            return 0
        return E.mul(E.prod(self.shape[:-1]), self.row_bytes())


def contiguous_strides(shape: Sequence[Expr], dtype: DType) -> tuple[Expr, ...]:
    strides: list[Expr] = [dtype.type_size]
    n = shape[-1]
    acc = E.mul(n, dtype.type_size) if dtype.block_size == 1 else dtype.row_bytes(n)
    for d in reversed(shape[:-1]):
        strides.append(acc)
        acc = E.mul(acc, d)
    return tuple(reversed(strides))


def node_shape(node: Node) -> tuple[Expr, ...]:
    return tuple(E.from_dim(d) for d in node.type.shape)


@dataclass(frozen=True)
class Part:
    """How a step splits its writes between threads: thread ith owns units
    [ith*n/nth, (ith+1)*n/nth) of `unit_bytes` each, from `offset` in `buf`. A reader declaring
    the same Part reads only what its own thread wrote, so it needs no barrier."""

    buf: Buffer
    offset: Expr
    unit_bytes: Expr
    n_units: Expr


class Kernel(ABC):
    """A generated function `void k(i32 ith, i32 nth, ptr..., i64..., ptr frame[, ptr counter])`.

    `ints` are the kernel's integer parameters: ints are compiled in (they are part of the key,
    so kernels that differ only in run-time values share one function); expressions become
    run-time arguments. The positions in `runtime_ints` are run-time arguments even when known:
    a kernel lists there the sizes its code does not need as constants (a matmul's row count),
    so that the layers and models that differ only in them share one compiled function."""

    n_ptrs: int = 0
    numerics: Numerics = AVX512     # the profile the code reproduces (set by the lowering, part of the key)
    runtime_ints: ClassVar[tuple[int, ...]] = ()
    # whether the threads claim chunks of the work (Emitter.claims) rather than split it evenly:
    # the function then takes one more pointer after the frame, its step's chunk counter
    shares_work: ClassVar[bool] = False

    def __init__(self, ints: Sequence[Expr] = ()):
        self.ints = tuple(ints)

    def config(self) -> tuple:
        """Everything static the emitted code depends on besides `ints`."""
        return ()

    @property
    def pattern(self) -> tuple:
        """Each of `ints` compiled in (its value) or passed at run time (None)."""
        shared = self.runtime_ints
        return tuple(v if isinstance(v, int) and i not in shared else None for i, v in enumerate(self.ints))

    def key(self) -> tuple:
        return (type(self).__name__, self.config(), self.n_ptrs, self.pattern, self.numerics.name)

    @abstractmethod
    def emit(self, em, args) -> None:
        """Emit the body on Emitter `em`; `args` are the function's arguments after ith, nth."""


@dataclass
class Step:
    kernel: Kernel
    ptrs: list                      # Ref | (Buffer, offset Expr): the kernel's pointer arguments
    reads: list[Buffer]
    writes: list[Buffer]
    part: Part | None = None        # the write split, when row-wise
    read_parts: list[Part] = field(default_factory=list)
    node: Node | None = None
    stage: int = -1
    # when this step starts a stage, the barrier before it runs only if barrier_if(em, values of
    # barrier_args) holds at run time (the same for every thread): for work that only some batches do
    barrier_if: Callable | None = None
    barrier_args: tuple = ()


class Plan:
    """Buffers, refs and steps of one split; built by `lower.lower_graph`."""

    def __init__(self, dim_names: Sequence[str]):
        self.dim_names = tuple(dim_names)
        self.refs: dict[int, Ref] = {}
        self.steps: list[Step] = []
        self.leaves: dict[str, Buffer] = {}
        self.outputs: dict[str, Buffer] = {}
        self.temps: list[Buffer] = []
        self.packed: dict[str, Buffer] = {}   # repacked weights, by "leaf|format"
        self.leaf_views: dict[str, Ref] = {}  # outputs that are views of a leaf's memory
        self.n_stages = 0
        self.conditional: dict[int, Step] = {}   # stage -> the step whose condition guards its barrier
        self.arena_size: Expr = 0
        self.sites: list[str] = []      # error sites: what a kernel reports in the frame
        self.keep_values = False         # observation: no temporary shares memory with another

    # -- buffers --------------------------------------------------------------------------------
    def leaf(self, name: str) -> Buffer:
        if name not in self.leaves:
            self.leaves[name] = Buffer("leaf", name)
        return self.leaves[name]

    def temp(self, size: Expr, name: str, per_thread: bool = False) -> Buffer:
        buf = Buffer("temp", name, E.align(size, ALIGN), per_thread)
        self.temps.append(buf)
        return buf

    def new_ref(self, buf: Buffer, shape: tuple[Expr, ...], dtype: DType) -> Ref:
        return Ref(buf, 0, shape, contiguous_strides(shape, dtype), dtype)

    def site(self, label: str) -> Expr:
        """A run-time constant naming where an error was found (see runtime errors)."""
        self.sites.append(label)
        return E.lit(len(self.sites) - 1)

    # -- stages and barriers -----------------------------------------------------------------
    def assign_stages(self) -> None:
        """Give each step a stage; a barrier runs between consecutive stages."""
        stage = 0
        self.conditional = {}
        written: dict[int, list[Part | None]] = {}   # buffer id -> the parts written this stage
        read: set[int] = set()
        for step in self.steps:
            if self._needs_barrier(step, written, read):
                stage += 1
                if step.barrier_if is not None:
                    # the barrier may be skipped: what follows still sees the last stage's writes
                    self.conditional[stage] = step
                else:
                    written, read = {}, set()
            step.stage = stage
            for buf in step.writes:
                written.setdefault(id(buf), []).append(step.part)
            read.update(id(b) for b in step.reads)
        self.n_stages = stage + 1 if self.steps else 0

    @staticmethod
    def _needs_barrier(step: Step, written: dict, read: set) -> bool:
        aligned = {id(p.buf): p for p in step.read_parts}
        for buf in step.reads:
            parts = written.get(id(buf))
            if parts is None:
                continue
            mine = aligned.get(id(buf))
            if mine is None or any(p != mine for p in parts):
                return True
        for buf in step.writes:
            if id(buf) in read:          # another thread may still read what this one overwrites
                return True
            parts = written.get(id(buf))
            if parts is not None and (step.part is None or any(p != step.part for p in parts)):
                return True
        return False

    # -- memory ----------------------------------------------------------------------------------
    def plan_memory(self) -> None:
        """Place the temporaries in one arena: buffers whose stage intervals overlap get disjoint
        bytes; the others may share. Offsets and the arena size are expressions."""
        for buf in self.temps:
            buf.first, buf.last = -1, -1
        for step in self.steps:
            for buf in step.reads + step.writes:
                if buf.kind == "temp":
                    buf.first = step.stage if buf.first < 0 else min(buf.first, step.stage)
                    buf.last = max(buf.last, step.stage)
        used = [b for b in self.temps if b.first >= 0]
        # greedy slots: a slot holds buffers with disjoint intervals; its size is their max
        slots: list[tuple[list[Buffer], int]] = []   # (members, last stage used)
        for buf in sorted(used, key=lambda b: (b.first, b.last)):
            for i, (members, last) in enumerate(slots):
                if last < buf.first and _same_family(members[0], buf) and not self.keep_values:
                    members.append(buf)
                    slots[i] = (members, buf.last)
                    break
            else:
                slots.append(([buf], buf.last))
        offset: Expr = 0
        for members, _ in slots:
            size: Expr = 0
            for buf in members:
                size = E.max_(size, _footprint(buf))
            for buf in members:
                buf.offset = offset
            offset = E.add(offset, E.align(size, ALIGN))
        self.arena_size = offset


def _footprint(buf: Buffer) -> Expr:
    return E.mul(buf.size, E.var(E.NTH)) if buf.per_thread else buf.size


def _same_family(a: Buffer, b: Buffer) -> bool:
    """Share a slot only between buffers whose sizes grow alike (both per-thread or neither), so
    the slot's max stays a small expression."""
    return a.per_thread == b.per_thread


VIEW_OPS = (ops.View, ops.Reshape, ops.Permute, ops.Transpose)
