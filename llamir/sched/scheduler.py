"""The scheduler: assign every value of a concrete graph to a backend and cut contiguous splits,
emulating ggml_backend_sched_split_graph (ggml/src/ggml-backend.cpp) pass by pass.

    sched = Scheduler([gpu, cpu], buffers=placement.buffers)       # priority order, CPU last
    plan = sched.split_graph(bind_dims(graph, {"T": 512, ...}))
    print(plan.to_text())

The steps live in their own modules: node assignment (assign.py, passes 1-4), splits and copies
(splits.py, passes 5-6), the plan (plan.py), ggml-alloc (alloc.py), compute buffers
(compute_buffers.py), the split executor (executor.py), the cost model (cost.py) and the split
picture (draw.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llamir.ir import Graph
from llamir.sched.assign import Assignment, Pins
from llamir.sched.plan import SchedError, SplitPlan, TensorBuffer
from llamir.sched.splits import build_plan

if TYPE_CHECKING:
    from llamir.backends.base import Backend

MAX_BACKENDS = 16  # GGML_SCHED_MAX_BACKENDS
MAX_COPIES = 4  # GGML_SCHED_MAX_COPIES


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
            from llamir.sched.compute_buffers import ComputeBuffers

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
        from llamir.sched.executor import execute

        return execute(self, scheduled, values, observe)

    def split_graph(self, graph: Graph, pins: Pins | None = None) -> SplitPlan:
        """Assign backends and cut splits (passes 1-6 of ggml_backend_sched_split_graph)."""
        if graph.dim_names:
            raise SchedError(
                f"graph {graph.name} still has symbolic dims {list(graph.dim_names)}; "
                f"bind them first (llamir.ir.bind.bind_dims)"
            )
        assignment = Assignment(self, graph, pins or {})
        assignment.run()
        return build_plan(assignment)


__all__ = ["Pins", "SchedError", "ScheduledGraph", "Scheduler", "TensorBuffer"]
