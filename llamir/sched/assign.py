"""Node assignment, passes 1-4 of ggml_backend_sched_split_graph (ggml/src/ggml-backend.cpp):
every value of a bound graph gets a backend and the cause of that choice.

Backends are used through their interface (supports_op, supports_buft, offload_op, is_cpu,
label); splits and copies are cut afterwards from the assignment (llamir.sched.splits).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from llamir.ir import Graph, Node, ops
from llamir.ir.geometry import is_view_like, view_root
from llamir.sched.plan import Cause, SchedError, TensorBuffer

if TYPE_CHECKING:
    from llamir.backends.base import BufferType
    from llamir.sched.scheduler import Scheduler

Pins = Mapping[Node | str, "str | int"]


class Assignment:
    """Which backend every value of one graph runs on, and why: the state of one split_graph
    call (ggml keeps it in the scheduler's hash tables)."""

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

    def from_buffers(self) -> None:
        """Pass 1: values whose memory is already placed (weights, the KV cache, inputs) and the
        ops that read a weight go where that memory is (or to a device that offloads the batch)."""
        for value in self.graph.all_values():
            if self.get(value) == -1:
                b, cause = self.from_cur(value)
                if b != -1:
                    self._set(value, b, cause)

    # -- pass 2: expansion ------------------------------------------------------------------------
    def expand(self, forward: bool, gpu_only: bool, code: str) -> None:
        """Pass 2: unassigned nodes take the backend of the assigned node before (or after) them;
        the first two sweeps spread only non-CPU backends."""
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
    def upgrade(self) -> None:
        """Pass 3: nodes still unassigned go where most of their inputs are usable; assigned nodes
        move up to a higher-priority backend sharing their buffer type that runs them."""
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
    def assign_sources(self) -> None:
        """Pass 4: views take their root's backend, unassigned sources their user's, and anything
        left the first backend that supports it."""
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

    def run(self) -> None:
        """Passes 1-4 in ggml's order."""
        self.ids = {id(v): i for i, v in enumerate(self.graph.all_values())}
        self.from_buffers()
        self.expand(True, True, "2.gpu-down")
        self.expand(False, True, "2.gpu-up")
        self.expand(True, False, "2.rest-down")
        self.expand(False, False, "2.rest-up")
        self.upgrade()
        self.assign_sources()
