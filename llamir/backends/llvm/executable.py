"""The Python side of a compiled split: bind leaf arrays, dims and output arrays into the frame,
size the arena, run the native entry on the thread pool, raise what the kernels reported.

Per call this is a few dozen Python operations: weights and KV buffers are checked once and then
recognised by identity; only the per-batch inputs are validated each time.
"""

from __future__ import annotations

import ctypes
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from llamir.backends.base import BackendError
from llamir.backends.llvm.codegen import (
    ARENA,
    ERR_CODE,
    ERR_DETAIL,
    ERR_SITE,
    N_THREADS,
    PROFILE,
    FrameLayout,
)
from llamir.backends.llvm.kernels.repack import PACKED
from llamir.backends.llvm.plan import Plan, Ref
from llamir.backends.llvm.runtime import ThreadPool
from llamir.ir import Graph, Node, dims
from llamir.ir.interp import storage_dtype, storage_shape

ERR_INDEX = 1   # a row/expert index outside its range: detail = the index
ERROR_TEXT = {ERR_INDEX: "index {detail} is out of range"}


@dataclass
class _Leaf:
    name: str
    slot: int
    kind: str
    shape: tuple            # dims (ints or Syms), storage form
    np_dtype: np.dtype
    concrete: bool
    last: np.ndarray | None = None      # the array last passed in (recognised by identity)
    bound: np.ndarray | None = None     # the array the frame points at (a contiguous copy, maybe)


@dataclass
class _Output:
    name: str
    slot: int
    shape: tuple
    np_dtype: np.dtype
    node: Node


class _Shapes(NamedTuple):
    """Storage shapes of the per-call inputs and of the outputs at one set of dim values."""

    inputs: list[tuple[int, ...]]
    outputs: list[tuple[int, ...]]


_ARENA_SIZE = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_void_p)


class CompiledSplit:
    """One compiled graph: __call__(leaf_values, bindings, observe=None) -> outputs by name."""

    def __init__(self, graph: Graph, plan: Plan, layout: FrameLayout, addrs: dict[str, int], tracker,
                 pool: ThreadPool, debug: Callable[[], CompiledSplit] | None = None):
        self.graph = graph
        self.plan = plan
        self.layout = layout
        self._tracker = tracker           # keeps the code loaded
        self._entry = addrs["llamir_split"]
        self._arena_size = _ARENA_SIZE(addrs["llamir_arena_size"])
        self._debug_factory = debug
        self._debug: CompiledSplit | None = None
        self.frame = np.zeros(layout.size, dtype=np.int64)
        self._frame_ptr = self.frame.ctypes.data
        self._counters = layout.counter_slots      # the work-sharing steps' chunk counters
        self.arena = np.zeros(0, dtype=np.uint8)
        self._arena_cap = 0
        self._dims = [(name, layout.dims[name]) for name in plan.dim_names]
        self._leaves = []
        for leaf in graph.leafs:
            if leaf.name not in layout.leaves:
                continue
            shape = _storage_dims(leaf)
            self._leaves.append(_Leaf(leaf.name, layout.leaves[leaf.name], leaf.kind, shape,
                                      storage_dtype(leaf.dtype), all(isinstance(d, int) for d in shape)))
        # leaves bound once and then recognised by identity (weights, the KV cache), and the
        # per-call inputs (validated every time)
        self._fixed = [x for x in self._leaves if x.concrete and x.kind != "input"]
        self._fixed_names = [x.name for x in self._fixed]
        self._fixed_last: list = [None] * len(self._fixed)
        self._inputs = [x for x in self._leaves if not (x.concrete and x.kind != "input")]
        self._input_names = [x.name for x in self._inputs]
        self._inputs_bound: list = [_UNBOUND] * len(self._inputs)   # each input's array as bound last call
        self._keep: dict = {}
        self._arena_sizes: dict[tuple, int] = {}
        self._shapes: dict[tuple, _Shapes] = {}   # by dims key, like the arena sizes
        self._dims_key: tuple = ()
        self._bindings: Mapping[str, int] = {}
        # changes whenever a call binds other arrays or dims into the frame (see call_bound)
        self.binding = 0
        self._in_place = False
        self.pool = pool
        self._packed = {}    # leaf name -> [(slot, format)]
        for name, buf in plan.packed.items():
            leaf_name, fmt = buf.source
            self._packed.setdefault(leaf_name, []).append((layout.leaves[name], fmt))
        self._outputs = []
        for name, node in graph.outputs.items():
            if name in plan.leaf_views:
                continue
            self._outputs.append(_Output(name, layout.outputs[name], _storage_dims(node),
                                         storage_dtype(node.dtype), node))

    @property
    def pool(self) -> ThreadPool:
        return self._pool

    @pool.setter
    def pool(self, pool: ThreadPool) -> None:
        """Run on `pool` from now on (per-thread scratch follows its thread count)."""
        self._pool = pool
        self.frame[N_THREADS] = pool.n_threads
        self._arena_sizes = {}

    def __call__(self, leaf_values: Mapping[str, np.ndarray], bindings: Mapping[str, int],
                 observe: Callable[[Node, np.ndarray], bool] | None = None) -> dict[str, np.ndarray]:
        if observe is not None and self._debug_factory is not None:
            if self._debug is None:
                self._debug = self._debug_factory()
            return self._debug.run_observed(leaf_values, bindings, observe)
        with self.pool.lock:
            keep = self._bind(leaf_values, bindings)
            self._bindings = bindings
            outputs = self._bind_outputs()
            self._run()
        return self._with_leaf_views(outputs, keep, bindings)

    def call_bound(self, binding: int) -> dict[str, np.ndarray] | None:
        """Run again on what the last call bound: the same arrays, refilled in place, at the same
        dims, without checking them again. `binding` is the `binding` read after that call; if
        anything was bound since, nothing runs and None says to make a full call."""
        with self.pool.lock:
            if binding != self.binding or not self._in_place:
                return None
            outputs = self._bind_outputs()
            self._run()
        return self._with_leaf_views(outputs, self._keep, self._bindings)

    def _with_leaf_views(self, outputs: dict, keep: dict, bindings) -> dict[str, np.ndarray]:
        """The outputs plus those that live in a leaf's memory, as views of the arrays bound."""
        for name, ref in self.plan.leaf_views.items():
            outputs[name] = self._view_of(ref, self._bound(ref.buf.name, keep), bindings)
        return outputs

    def _view_of(self, ref: Ref, owner: np.ndarray, bindings) -> np.ndarray:
        """A numpy view (not a copy) of `ref` inside a leaf's array."""
        from llamir.ir.interp import strided_view

        shape = storage_shape(tuple(_ev(d, bindings, 0) for d in ref.shape), ref.dtype)
        strides = tuple(_ev(s, bindings, 0) for s in ref.strides[:-1]) + (owner.itemsize,)
        return strided_view(owner, owner, shape, strides, _ev(ref.offset, bindings, 0), "output")

    # -- binding ---------------------------------------------------------------------------------
    def _bind(self, leaf_values, bindings) -> list:
        frame = self.frame
        try:
            key = tuple([int(bindings[name]) for name, _ in self._dims])
        except KeyError as err:
            raise BackendError(f"dim {err.args[0]!r} has no value (bound: {dict(bindings)})") from None
        if key != self._dims_key:   # the frame holds the last call's dims otherwise
            self.binding += 1
            for (name, slot), value in zip(self._dims, key):
                if value < 0:
                    raise BackendError(f"dim {name} = {value} is negative")
                frame[slot] = value
            self._dims_key = key
        shapes = self._shapes.get(key)
        if shapes is None:   # the storage shapes of the inputs and outputs at these dims
            shapes = self._shapes[key] = _Shapes(
                [tuple(dims.evaluate(d, bindings) for d in spec.shape) for spec in self._inputs],
                [tuple(dims.evaluate(d, bindings) for d in spec.shape) for spec in self._outputs])
        # weights and state: one C-level identity pass over the arrays bound last time
        try:
            fixed = list(map(leaf_values.__getitem__, self._fixed_names))
        except KeyError as err:
            raise BackendError(f"no value for leaf {err.args[0]!r}") from None
        if not all(map(operator.is_, fixed, self._fixed_last)):
            self.binding += 1
            changed = [(spec, arr) for spec, arr in zip(self._fixed, fixed, strict=True) if arr is not spec.last]
            for spec, arr in changed:
                spec.bound = self._check_leaf(spec, arr, spec.shape)   # kept: it may be a copy
            PACKED.prepare([(spec.bound, fmt) for spec, _ in changed for _, fmt in self._packed.get(spec.name, ())])
            for spec, arr in changed:
                self._bind_leaf(spec, spec.bound)
                spec.last = arr
            self._fixed_last = [spec.last for spec in self._fixed]
        # per-batch inputs: refilled in place since the last call (a generated token's), all of
        # them are bound already; one identity and shape pass says so
        inputs = [leaf_values.get(name) for name in self._input_names]
        if (all(map(operator.is_, inputs, self._inputs_bound))
                and list(map(_shape_of, inputs)) == shapes.inputs):
            return self._keep
        self.binding += 1
        keep = {}
        for spec, want in zip(self._inputs, shapes.inputs):
            try:
                arr = leaf_values[spec.name]
            except KeyError:
                raise BackendError(f"no value for {spec.kind} {spec.name!r}") from None
            if arr is not spec.bound or arr.shape != want:
                arr = spec.bound = self._check_leaf(spec, arr, want)
                self._bind_leaf(spec, arr)
            keep[spec.name] = arr
        self._inputs_bound = [spec.bound for spec in self._inputs]
        self._keep = keep
        # an input bound as a contiguous copy does not see its array refilled in place
        self._in_place = all(keep[spec.name] is leaf_values[spec.name] for spec in self._inputs)
        return keep

    def _bound(self, name: str, keep: dict) -> np.ndarray:
        """The array a leaf was bound to in this call (inputs may be contiguous copies)."""
        if name in keep:
            return keep[name]
        return next(spec.bound for spec in self._fixed if spec.name == name)

    def _bind_leaf(self, spec: _Leaf, arr: np.ndarray) -> None:
        self.frame[spec.slot] = arr.__array_interface__["data"][0]
        for slot, fmt in self._packed.get(spec.name, ()):
            self.frame[slot] = PACKED.get(arr, fmt).__array_interface__["data"][0]

    def _check_leaf(self, spec: _Leaf, arr, want: tuple[int, ...]) -> np.ndarray:
        if not isinstance(arr, np.ndarray):
            raise BackendError(f"{spec.kind} {spec.name!r}: expected a numpy array, got {type(arr).__name__}")
        if arr.shape != want or arr.dtype != spec.np_dtype:
            raise BackendError(f"{spec.kind} {spec.name!r}: expected storage {want} {spec.np_dtype}, "
                               f"got {arr.shape} {arr.dtype}")
        if not arr.flags.c_contiguous:
            if spec.kind == "state":
                raise BackendError(f"state {spec.name!r} must be C-contiguous (it is written in place)")
            arr = np.ascontiguousarray(arr)
        if spec.kind == "state" and not arr.flags.writeable:
            raise BackendError(f"state {spec.name!r} is read-only but the graph writes it")
        return arr

    def _bind_outputs(self) -> dict[str, np.ndarray]:
        if len(self._outputs) == 1:   # the usual graph: logits (or embeddings) only
            spec, = self._outputs
            arr = np.empty(self._shapes[self._dims_key].outputs[0], dtype=spec.np_dtype)
            self.frame[spec.slot] = arr.__array_interface__["data"][0] if arr.size else 0
            return {spec.name: arr}
        outputs: dict[str, np.ndarray] = {}
        by_node: dict[int, np.ndarray] = {}
        for spec, shape in zip(self._outputs, self._shapes[self._dims_key].outputs):
            arr = by_node.get(id(spec.node))
            if arr is None:
                arr = by_node[id(spec.node)] = np.empty(shape, dtype=spec.np_dtype)
            self.frame[spec.slot] = arr.__array_interface__["data"][0] if arr.size else 0
            outputs[spec.name] = arr
        return outputs

    def _run(self) -> None:
        frame = self.frame
        need = self._arena_sizes.get(self._dims_key)
        if need is None:
            need = self._arena_sizes[self._dims_key] = self._arena_size(self._frame_ptr)
        if need > self._arena_cap:
            self._arena_cap = max(need, self._arena_cap * 5 // 4)
            self.arena = np.empty(self._arena_cap + 64, dtype=np.uint8)
            base = self.arena.__array_interface__["data"][0]
            frame[ARENA] = base + (-base % 64)
        frame[ERR_CODE] = 0
        frame[self._counters] = 0
        self.pool.run(self._entry, self._frame_ptr)
        if frame[ERR_CODE]:
            code, detail, site = int(frame[ERR_CODE]), int(frame[ERR_DETAIL]), int(frame[ERR_SITE])
            where = self.plan.sites[site] if 0 <= site < len(self.plan.sites) else "?"
            raise BackendError(ERROR_TEXT.get(code, "error {detail}").format(detail=detail) + f" ({where})")

    # -- profiling ---------------------------------------------------------------------------------
    def profile(self, leaf_values, bindings, runs: int = 10) -> StepProfile:
        """Run `runs` times with thread 0 stamping the cycle counter around every step and barrier;
        returns the median seconds per step and per barrier (see StepProfile)."""
        n_steps = len(self.plan.steps)
        buf = np.zeros((self.pool.n_threads, 2 + n_steps + self.plan.n_stages), dtype=np.int64)
        samples = []
        try:
            for _ in range(runs):
                buf[:] = 0
                self.frame[PROFILE] = buf.ctypes.data
                self(leaf_values, bindings)
                samples.append(buf.copy())
        finally:
            self.frame[PROFILE] = 0
        stamps = np.median(np.stack(samples).astype(np.float64), axis=0)
        return StepProfile.of(self.plan, stamps[0], [StepProfile.of(self.plan, row) for row in stamps[1:]])

    # -- observation -----------------------------------------------------------------------------
    def run_observed(self, leaf_values, bindings, observe) -> dict[str, np.ndarray]:
        """Run everything (this variant keeps every value), then show the named values in order."""
        with self.pool.lock:
            keep = self._bind(leaf_values, bindings)
            outputs = self._bind_outputs()
            self._run()
            arrays = {}
            for spec in self._leaves:
                arrays[spec.name] = self._bound(spec.name, keep)
            for spec in self._outputs:
                arrays[spec.name] = outputs[spec.name]
            for name, ref in self.plan.leaf_views.items():
                outputs[name] = self._view_of(ref, self._bound(ref.buf.name, keep), bindings)
            for node in self.graph.nodes:
                if not node.name:
                    continue
                value = self._value(node, arrays, bindings)
                if value is not None and observe(node, value) is False:
                    break
        return outputs

    def _value(self, node: Node, arrays, bindings) -> np.ndarray | None:
        ref: Ref | None = self.plan.refs.get(id(node))
        if ref is None:
            return None
        buf = ref.buf
        if buf.kind == "temp":
            base = int(self.frame[ARENA]) + _ev(buf.offset, bindings, self.pool.n_threads)
            owner = self.arena
        else:
            owner = arrays[buf.name]
            base = owner.__array_interface__["data"][0]
        shape = storage_shape(tuple(_ev(d, bindings, 0) for d in ref.shape), ref.dtype)
        strides = tuple(_ev(s, bindings, 0) for s in ref.strides[:-1]) + (storage_dtype(ref.dtype).itemsize,)
        start = base + _ev(ref.offset, bindings, 0)
        iface = {"data": (start, False), "shape": shape, "strides": strides,
                 "typestr": storage_dtype(ref.dtype).str, "version": 3}
        holder = type("_View", (), {"__array_interface__": iface, "keep": owner})()
        return np.array(np.asarray(holder), copy=True)


@dataclass
class StepProfile:
    """Where one run's time goes, seen from thread 0: seconds per step (its kernel and share of
    the work) and per barrier (waiting for the other threads)."""

    steps: list[tuple[str, float]]     # (kernel class, seconds) in step order
    barriers: float
    total: float
    others: list[StepProfile] = field(default_factory=list)   # the other threads' views

    @classmethod
    def of(cls, plan: Plan, stamps: np.ndarray, others: list | None = None) -> StepProfile:
        hz = tsc_hz()
        n = len(plan.steps)
        steps, barriers = [], 0.0
        prev = stamps[0]
        for i, step in enumerate(plan.steps):
            if i and step.stage != plan.steps[i - 1].stage:
                after = stamps[1 + n + step.stage]
                barriers += (after - prev) / hz
                prev = after
            steps.append((type(step.kernel).__name__, (stamps[1 + i] - prev) / hz))
            prev = stamps[1 + i]
        return cls(steps, barriers, (prev - stamps[0]) / hz, others or [])

    def by_kernel(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, secs in self.steps:
            out[name] = out.get(name, 0.0) + secs
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


_TSC_HZ: float | None = None


def tsc_hz() -> float:
    """The cycle counter's rate, measured once against perf_counter."""
    global _TSC_HZ
    if _TSC_HZ is None:
        import time

        from llamir.backends.llvm.runtime import read_cycles

        c0, t0 = read_cycles(), time.perf_counter()
        time.sleep(0.02)
        c1, t1 = read_cycles(), time.perf_counter()
        _TSC_HZ = (c1 - c0) / (t1 - t0)
    return _TSC_HZ


def _ev(e, bindings, n_threads: int) -> int:
    from llamir.backends.llvm import expr as E

    env = dict(bindings)
    env[E.NTH] = n_threads
    return E.evaluate(e, env)


_shape_of = operator.attrgetter("shape")
_UNBOUND = object()   # matches no value: the first call binds every input


def _storage_dims(node: Node) -> tuple:
    shape = node.type.shape
    if node.dtype.is_quantized:
        return tuple(shape[:-1]) + (node.dtype.row_bytes(shape[-1]),)
    return tuple(shape)
