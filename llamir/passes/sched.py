"""The scheduler: assign every value of a concrete graph to a backend and cut contiguous splits,
emulating ggml_backend_sched_split_graph (ggml/src/ggml-backend.cpp) pass by pass.

    sched = Scheduler([gpu, cpu], buffers=placement.buffers)       # priority order, CPU last
    plan = sched.split_graph(bind_dims(graph, {"T": 512, ...}))
    print(plan.to_text())

Backends are used by duck typing (supports_op, supports_buft, offload_op, is_cpu, label,
device.buffer_type()), so this module does not import llamir.backends.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llamir.ir import Graph, Node, ops
from llamir.passes.sched_plan import (
    Cause,
    InputCopy,
    Split,
    SplitPlan,
    ggml_nbytes,
    is_view_like,
    value_strides,
    view_root,
)

if TYPE_CHECKING:
    from llamir.backends.base import Backend, BufferType

MAX_BACKENDS = 16  # GGML_SCHED_MAX_BACKENDS
MAX_COPIES = 4  # GGML_SCHED_MAX_COPIES


class SchedError(ValueError):
    """A graph the scheduler cannot place; the message names the value, op and backends."""


@dataclass(frozen=True)
class TensorBuffer:
    """Where a pre-allocated leaf (weight, KV cache) lives: a buffer type and whether the buffer
    holds weights (ggml's GGML_BACKEND_BUFFER_USAGE_WEIGHTS; the KV cache does not)."""

    buft: BufferType
    weights: bool = True


Pins = Mapping[Node | str, "str | int"]


@dataclass
class ScheduledGraph:
    """A plan with its memory: the allocator's graph copy and every tensor's address."""

    plan: SplitPlan
    alloc_graph: object
    allocation: object


class Scheduler:
    """ggml_backend_sched: backends in priority order (CPU last), one buffer type each."""

    def __init__(
        self,
        backends: Sequence[Backend],
        buffers: Mapping[str, TensorBuffer] | None = None,
        *,
        op_offload: bool = True,
        n_copies: int = 1,
    ):
        if not 1 <= len(backends) <= MAX_BACKENDS:
            raise SchedError(f"the scheduler takes 1..{MAX_BACKENDS} backends, got {len(backends)}")
        if not backends[-1].is_cpu:
            raise SchedError(
                f"the last backend must be the CPU, got {backends[-1].label} "
                f"(order: {', '.join(b.label for b in backends)})"
            )
        labels = [b.label for b in backends]
        if len(set(labels)) != len(labels):
            raise SchedError(f"backend names must be unique, got {', '.join(labels)}")
        if not 1 <= n_copies <= MAX_COPIES:
            raise SchedError(f"n_copies must be in 1..{MAX_COPIES}, got {n_copies}")
        self.backends = list(backends)
        self.bufts = [b.device.buffer_type() for b in backends]
        for b, buft in zip(backends, self.bufts, strict=True):
            if not b.supports_buft(buft):
                raise SchedError(f"backend {b.label} does not support its own buffer type {buft.name}")
        self.buffers = dict(buffers or {})
        self.op_offload = op_offload
        self.n_copies = n_copies
        self.cur_copy = 0
        self.next_copy = 0
        self._compute_buffers = None
        self._events: dict[tuple[int, int], object] = {}

    @property
    def cpu(self) -> int:
        return len(self.backends) - 1

    def backend_id(self, key: str | int) -> int:
        if isinstance(key, int):
            if not 0 <= key < len(self.backends):
                raise SchedError(f"backend index {key} is outside 0..{len(self.backends) - 1}")
            return key
        for i, b in enumerate(self.backends):
            if b.label == key:
                return i
        raise SchedError(f"no backend named {key!r} (backends: {', '.join(b.label for b in self.backends)})")

    def advance_copy(self) -> None:
        """ggml_backend_sched_alloc_graph: the next graph uses the next pipeline copy."""
        self.cur_copy = self.next_copy
        self.next_copy = (self.next_copy + 1) % self.n_copies

    def synchronize(self) -> None:
        """With nothing in flight the next graph starts again at copy 0 (stable CUDA graphs)."""
        for b in self.backends:
            b.synchronize()
        self.next_copy = 0

    # -- memory (ggml_backend_sched_reserve / alloc_graph) ----------------------------------------
    @property
    def compute_buffers(self):
        if self._compute_buffers is None:
            from llamir.passes.sched_alloc import ComputeBuffers

            self._compute_buffers = ComputeBuffers(self.bufts)
        return self._compute_buffers

    def reserve(self, graph: Graph, pins: Pins | None = None) -> dict[str, int]:
        """Measure `graph` (a worst case) and grow the compute buffers to its peak (they never
        shrink); returns the compute-buffer bytes per backend so far."""
        plan = self.split_graph(graph, pins)
        _, allocation = self.compute_buffers.measure(plan)
        self.compute_buffers.grow(allocation)
        return self.buffer_sizes()

    def alloc_graph(self, graph: Graph, pins: Pins | None = None) -> ScheduledGraph:
        """Next pipeline copy, split, allocate; a graph needing more than was reserved grows the
        buffers (counted in compute_buffers.n_reallocs, as ggml's reallocation)."""
        self.advance_copy()
        plan = self.split_graph(graph, pins)
        ag, allocation = self.compute_buffers.measure(plan)
        if self.compute_buffers.grow(allocation):
            self.compute_buffers.n_reallocs += 1
        return ScheduledGraph(plan, ag, allocation)

    def buffer_sizes(self) -> dict[str, int]:
        """Compute-buffer bytes per backend (ggml_backend_sched_get_buffer_size)."""
        return self.compute_buffers.sizes_by_backend([b.label for b in self.backends])

    def graph_compute(self, scheduled: ScheduledGraph, values: Mapping, observe=None) -> dict:
        """Copy inputs and run the splits in order; returns the graph outputs by name."""
        from llamir.passes.sched_exec import execute

        return execute(self, scheduled, values, observe)

    def split_graph(self, graph: Graph, pins: Pins | None = None) -> SplitPlan:
        """Assign backends and cut splits (passes 1-6 of ggml_backend_sched_split_graph)."""
        if graph.dim_names:
            raise SchedError(
                f"graph {graph.name} still has symbolic dims {list(graph.dim_names)}; "
                f"bind them first (llamir.ir.bind.bind_dims)"
            )
        return _SplitRun(self, graph, pins or {}).run()


class _SplitRun:
    """The state of one split_graph call (ggml keeps it in the scheduler's hash tables)."""

    def __init__(self, sched: Scheduler, graph: Graph, pins: Pins):
        self.s, self.graph = sched, graph
        self.backends = sched.backends
        self.assign: dict[int, int] = {}
        self.causes: dict[int, Cause] = {}
        self.strides: dict[int, tuple[int, ...]] = {}
        self._pin(pins)

    # -- helpers ------------------------------------------------------------------------------
    def _pin(self, pins: Pins) -> None:
        for key, backend in pins.items():
            value = key if isinstance(key, Node) else self._find(key)
            b = self.s.backend_id(backend)
            if not value.is_leaf and not self.backends[b].supports_op(value):
                raise SchedError(
                    f"{value.op.name} {value.name or ''} is pinned to {self.backends[b].label}, "
                    f"which does not support it"
                )
            self._set(value, b, Cause("usr", f"pinned to {self.backends[b].label}"))

    def _find(self, name: str) -> Node:
        try:
            return self.graph.find(name)
        except KeyError:
            raise SchedError(
                f"cannot pin {name!r}: graph {self.graph.name} has no value of that name"
            ) from None

    def _set(self, value: Node, b: int, cause: Cause) -> None:
        self.assign[id(value)] = b
        self.causes[id(value)] = cause

    def get(self, value: Node) -> int:
        return self.assign.get(id(value), -1)

    def buffer(self, value: Node) -> TensorBuffer | None:
        """The pre-allocated buffer of a value (its root's), or None for computed memory."""
        root = view_root(value)
        if not root.is_leaf or root.kind == "input":
            return None
        tb = self.s.buffers.get(root.name)
        if tb is None:  # weights and state default to the CPU's (host) memory
            return TensorBuffer(self.s.bufts[self.s.cpu], weights=root.kind == "weight")
        return tb

    def from_buffer(self, buft: BufferType, op_node: Node) -> int:
        """The highest-priority backend that uses `buft` and runs `op_node`, or -1."""
        for i, b in enumerate(self.backends):
            if b.supports_buft(buft) and (op_node.is_leaf or b.supports_op(op_node)):
                return i
        return -1

    def buffer_supported(self, value: Node, b: int) -> bool:
        tb = self.buffer(value)
        if tb is not None:
            buft = tb.buft
        else:
            owner = self.get(value)
            if owner == -1 and is_view_like(value):
                owner = self.get(view_root(value))
            if owner == -1:
                return False
            buft = self.s.bufts[owner]
        return self.backends[b].supports_buft(buft)

    def label(self, value: Node) -> str:
        return value.name or f"{value.op.name} node"

    # -- pass 1: pre-allocated tensors, inputs and weights -----------------------------------------
    def from_cur(self, value: Node) -> tuple[int, Cause | None]:
        tb = self.buffer(value)
        if tb is not None:
            b = self.from_buffer(tb.buft, value)
            if b != -1:
                code = "1.dst" if value.is_leaf else "1.vsrc"
                return b, Cause(code, f"{self.label(view_root(value))} is in {tb.buft.name} memory")
            raise SchedError(
                f"pre-allocated tensor {self.label(view_root(value))} in a {tb.buft.name} buffer "
                f"cannot run {value.op.name} ({self.label(value)}): no backend that uses "
                f"{tb.buft.name} memory supports it"
            )
        if value.is_leaf:
            if value.kind == "input":
                return self.s.cpu, Cause("1.inp", "a graph input")
            return -1, None
        if value.is_op(ops.RopeExt, ops.FlashAttnExt):  # their small weights should not decide
            return -1, None
        for src in value.inputs:
            src_tb = self.buffer(src) if src.is_leaf else None
            if src_tb is None or not src_tb.weights:
                continue
            wb = self.from_buffer(src_tb.buft, value)
            if wb == -1:
                raise SchedError(
                    f"weight {src.name} is in {src_tb.buft.name} memory, but no backend using that "
                    f"memory runs {value.op.name} ({self.label(value)}); backends: "
                    f"{', '.join(b.label for b in self.backends)}"
                )
            if self.s.op_offload and wb == self.s.cpu and src_tb.buft.is_host:
                for b in range(wb):
                    if self.backends[b].supports_op(value) and self.backends[b].offload_op(value):
                        return b, Cause(
                            "1.off",
                            f"weight {src.name} is in host memory; "
                            f"{self.backends[b].label} offloads this batch",
                        )
            return wb, Cause("1.wgt", f"weight {src.name} is in {src_tb.buft.name} memory")
        return -1, None

    def pass1(self) -> None:
        for value in self.graph.all_values():
            if self.get(value) == -1:
                b, cause = self.from_cur(value)
                if b != -1:
                    self._set(value, b, cause)

    # -- pass 2: expansion ------------------------------------------------------------------------
    def expand(self, forward: bool, gpu_only: bool, code: str) -> None:
        cur, via = -1, None
        nodes = self.graph.nodes if forward else reversed(self.graph.nodes)
        for node in nodes:
            if node.op.is_view:
                continue
            b = self.get(node)
            if b != -1:
                cur, via = (-1, None) if gpu_only and b == self.s.cpu else (b, node)
            elif cur != -1 and self.backends[cur].supports_op(node):
                self._set(
                    node, cur, Cause(code, f"next to {self.label(via)} on {self.backends[cur].label}", via)
                )

    # -- pass 3: upgrades and the remaining nodes -------------------------------------------------
    def pass3(self) -> None:
        for node in self.graph.nodes:
            if node.op.is_view:
                continue
            cur = self.get(node)
            if cur == -1:
                best, best_n = -1, -1
                for b, backend in enumerate(self.backends):
                    if not backend.supports_op(node):
                        continue
                    n = sum(
                        1
                        for src in node.inputs
                        if (self.get(src) != -1 or self.get(view_root(src)) != -1)
                        and self.buffer_supported(src, b)
                    )
                    if n > best_n:
                        best, best_n = b, n
                if best != -1:
                    self._set(
                        node, best, Cause("3.best", f"{best_n} of {len(node.inputs)} inputs usable there")
                    )
                continue
            for b in range(cur):
                if (
                    self.s.bufts[b] is self.s.bufts[cur]
                    and self.backends[b].supports_op(node)
                    and all(self.buffer_supported(src, b) for src in node.inputs)
                ):
                    self._set(node, b, Cause("3.upg", f"from {self.backends[cur].label}"))
                    break

    # -- pass 4: sources and views ----------------------------------------------------------------
    def pass4(self) -> None:
        for node in self.graph.nodes:
            if is_view_like(node) and self.get(node) == -1:
                root = view_root(node)
                self._set(node, self.get(root), Cause("4.vsrc", f"views {self.label(root)}", root))
            for src in node.inputs:
                if self.get(src) != -1:
                    continue
                if is_view_like(src):
                    root = view_root(src)
                    self._set(src, self.get(root), Cause("4.vsrc", f"views {self.label(root)}", root))
                elif self.get(node) != -1:
                    self._set(src, self.get(node), Cause("4.cur", f"used by {self.label(node)}", node))
            if self.get(node) == -1:
                for b, backend in enumerate(self.backends):
                    if backend.supports_op(node):
                        self._set(node, b, Cause("4.first"))
                        break
            if self.get(node) == -1:
                raise SchedError(
                    f"no backend supports {node.op.name} ({self.label(node)}, {node.type}); "
                    f"backends: {', '.join(b.label for b in self.backends)}"
                )
        for leaf in self.graph.leafs:  # unused leaves: where their memory is, or the CPU
            if self.get(leaf) == -1:
                self._set(leaf, self.s.cpu, Cause("4.first", "an unused leaf"))

    # -- pass 5: splits and copies ----------------------------------------------------------------
    def nbytes(self, value: Node) -> int:
        return ggml_nbytes(value, value_strides(value, self.strides))

    def copy_of(self, src: Node, b: int, copies: dict, split: Split) -> InputCopy:
        key = (id(src), b)
        if key not in copies:
            name = f"{self.backends[b].label}#{src.name or f'%{self.ids[id(src)]}'}"
            copies[key] = [
                InputCopy(src, b, c, f"{name}#{c}", self.nbytes(src)) for c in range(self.s.n_copies)
            ]
            split.inputs.append(src)
            split.copies.append(copies[key][self.s.cur_copy])
            split.pipeline.append(copies[key])
        return copies[key][self.s.cur_copy]

    def pass5(self) -> tuple[list[Split], dict[int, tuple]]:
        nodes = self.graph.nodes
        first = next((n for n in nodes if not n.op.is_view), None)
        splits = [Split(0, self.get(first) if first is not None else self.s.cpu, 0, len(nodes))]
        copies: dict[tuple[int, int], list[InputCopy]] = {}
        sources: dict[int, tuple] = {}
        for i, node in enumerate(nodes):
            if node.op.is_view:
                continue
            split, nb = splits[-1], self.get(node)
            need_new = (
                nb == split.backend
                and split.inputs
                and any(
                    src.is_leaf
                    and (tb := self.buffer(src)) is not None
                    and tb.weights
                    and self.get(src) != split.backend
                    and not self.buffer_supported(src, split.backend)
                    for src in node.inputs
                )
            )
            if nb != split.backend or need_new:
                split.i_end = i
                split = Split(len(splits), nb, i, len(nodes))
                splits.append(split)
            new_inputs = list(node.inputs)
            for j, src in enumerate(node.inputs):
                if self.get(src) != split.backend and not self.buffer_supported(src, split.backend):
                    new_inputs[j] = self.copy_of(src, split.backend, copies, split)
            if any(a is not b for a, b in zip(new_inputs, node.inputs, strict=True)):
                sources[id(node)] = tuple(new_inputs)
        return splits, sources

    def graph_input_copies(self) -> dict[int, list]:
        """Pass 6 (n_copies > 1): each graph input gets a copy per pipeline slot on its backend;
        the current slot's copy is the input itself."""
        if self.s.n_copies == 1:
            return {}
        out = {}
        for leaf in self.graph.leafs_of_kind("input"):
            b = self.get(leaf)
            name = f"{self.backends[b].label}#{leaf.name}"
            out[id(leaf)] = [
                leaf if c == self.s.cur_copy else InputCopy(leaf, b, c, f"{name}#{c}", self.nbytes(leaf))
                for c in range(self.s.n_copies)
            ]
        return out

    def run(self) -> SplitPlan:
        self.ids = {id(v): i for i, v in enumerate(self.graph.all_values())}
        self.pass1()
        self.expand(True, True, "2.gpu-down")
        self.expand(False, True, "2.gpu-up")
        self.expand(True, False, "2.rest-down")
        self.expand(False, False, "2.rest-up")
        self.pass3()
        self.pass4()
        splits, sources = self.pass5()
        return SplitPlan(
            self.graph,
            self.backends,
            self.s.n_copies,
            self.s.cur_copy,
            self.s.op_offload,
            self.assign,
            self.causes,
            splits,
            sources,
            self.graph_input_copies(),
        )
