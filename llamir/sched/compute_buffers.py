"""Memory for a split plan: the scheduler's graph copy as the allocator sees it, the overlap
checker, and the compute buffers that reserve grows (ggml_backend_sched_reserve/alloc_graph).

The graph copy is ggml's: per split, a dependency node that keeps each input's source alive
and the input's copy, then the split's own nodes (reading the copies). With n_copies > 1 every
pipeline copy is a leaf allocated first and never freed.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from llamir.ir import Node
from llamir.ir.geometry import ggml_nbytes, is_view_like, value_strides, view_root
from llamir.sched.alloc import Address, Allocation, ATensor, GraphAllocator
from llamir.sched.plan import InputCopy, SplitPlan


class AllocCheckError(AssertionError):
    """Two tensors that are live at the same time share bytes."""


@dataclass
class AllocGraph:
    """The allocator's view of a plan: leaves and nodes with their buffer (backend) ids."""

    leafs: list[ATensor]
    leaf_ids: list[int]
    nodes: list[ATensor]
    node_ids: list[int]
    tensors: dict[int, ATensor]  # id(Node or InputCopy) -> ATensor


def build_alloc_graph(plan: SplitPlan) -> AllocGraph:
    strides: dict[int, tuple[int, ...]] = {}
    tensors: dict[int, ATensor] = {}
    graph = plan.graph
    outputs = {id(view_root(n)) for n in graph.outputs.values()} | {id(n) for n in graph.outputs.values()}
    pipelined = plan.n_copies > 1

    def layout(value: Node) -> tuple:
        st = value_strides(value, strides)
        return value.dtype.name, tuple(int(d) for d in value.type.shape), st

    def of_value(value: Node) -> ATensor:
        t = tensors.get(id(value))
        if t is not None:
            return t
        lay = layout(value)
        t = ATensor(plan.label(value), ggml_nbytes(value, lay[2]), lay, key=value)
        if value.is_leaf:
            t.external = value.kind != "input"
            t.is_input = value.kind == "input"
            t.is_output = pipelined and t.is_input
        else:
            t.srcs = [of_ref(x) for x in plan.inputs_of(value)]
            t.view_src = of_value(view_root(value)) if is_view_like(value) else None
            t.can_inplace = value.op.can_inplace
            t.is_output = id(value) in outputs
        tensors[id(value)] = t
        return t

    def of_ref(ref) -> ATensor:
        if not isinstance(ref, InputCopy):
            return of_value(ref)
        t = tensors.get(id(ref))
        if t is None:
            src = of_value(ref.src)
            t = tensors[id(ref)] = ATensor(
                ref.name, ref.nbytes, src.layout, is_input=pipelined, is_output=pipelined, key=ref
            )
        return t

    leafs, leaf_ids, nodes, node_ids = [], [], [], []
    if pipelined:
        for copies in plan.graph_input_copies.values():
            for ref in copies:
                leafs.append(of_ref(ref))
                leaf_ids.append(plan.backend_index(ref))
        for split in plan.splits:
            for copies in split.pipeline:
                for ref in copies:
                    leafs.append(of_ref(ref))
                    leaf_ids.append(split.backend)
    for leaf in graph.leafs:
        leafs.append(of_value(leaf))
        leaf_ids.append(plan.assignment[id(leaf)])
    for split in plan.splits:
        for inp, cpy in zip(split.inputs, split.copies, strict=True):
            src = of_value(inp)
            nodes.append(
                ATensor(
                    f"dep#{src.name}",
                    src.nbytes,
                    src.layout,
                    srcs=[src],
                    view_src=src.view_src or src,
                    dep=True,
                )
            )
            node_ids.append(plan.backend_index(inp))
            nodes.append(of_ref(cpy))
            node_ids.append(split.backend)
        for node in plan.split_nodes(split):
            nodes.append(of_value(node))
            node_ids.append(plan.assignment[id(node)])
    return AllocGraph(leafs, leaf_ids, nodes, node_ids, tensors)


def check_allocation(ag: AllocGraph, allocation: Allocation, allocators: list) -> int:
    """Prove that no two simultaneously live tensors overlap; returns the number checked.

    Liveness comes from the graph alone: a tensor lives from its node (leaves and inputs from
    the start) to the last node reading it directly or through a view; outputs live forever.
    The only sharing allowed is ggml's in-place reuse: a child taking its parent's memory at
    the step where the parent dies."""
    start: dict[int, int] = {}
    end: dict[int, float] = defaultdict(lambda: -math.inf)
    for t in ag.leafs:
        start[id(t)] = -1
    for k, t in enumerate(ag.nodes):
        start.setdefault(id(t), -1 if t.is_input else k)
        for src in t.srcs:
            for owner in (src, src.view_src):
                if owner is not None:
                    end[id(owner)] = max(end[id(owner)], k)
    every = {id(t): t for t in ag.leafs + ag.nodes}
    for t in ag.nodes:
        for src in t.srcs:
            every.setdefault(id(src), src)
    spans = []
    for tid, (buffer_id, addr, size) in allocation.addresses.items():
        t = every[tid]
        life_end = math.inf if t.is_output else max(end[tid], start[tid])
        spans.append(
            (id(allocators[buffer_id]), addr.chunk, addr.offset, addr.offset + size, start[tid], life_end, t)
        )
    spans.sort(key=lambda s: (s[0], s[1], s[2]))
    for i, a in enumerate(spans):
        for b in spans[i + 1 :]:
            if (b[0], b[1]) != (a[0], a[1]) or b[2] >= a[3]:
                break
            if a[4] <= b[5] and b[4] <= a[5] and not _inplace_pair(a, b, allocation):
                ta, tb = a[6], b[6]
                raise AllocCheckError(
                    f"{ta.name} [{a[2]}, {a[3]}) live {a[4]}..{a[5]} overlaps {tb.name} "
                    f"[{b[2]}, {b[3]}) live {b[4]}..{b[5]} in chunk {a[1]}"
                )
    return len(spans)


def _inplace_pair(a, b, allocation: Allocation) -> bool:
    for parent, child in ((a, b), (b, a)):
        p = allocation.inplace.get(id(child[6]))
        if p is parent[6] and child[4] == parent[5]:
            return True
    return False


class ComputeBuffers:
    """The scheduler's compute buffers: one allocator per distinct buffer type, sizes that only
    grow (reserve), and, for execution, real byte buffers."""

    def __init__(self, bufts: list):
        self.bufts = bufts
        self.galloc = GraphAllocator(bufts)
        self.sizes: dict[int, list[int]] = {}  # id(allocator) -> reserved chunk sizes
        self.n_reallocs = 0
        self._buffers: dict[tuple[int, int], object] = {}

    def measure(self, plan: SplitPlan) -> tuple[AllocGraph, Allocation]:
        ag = build_alloc_graph(plan)
        allocation = self.galloc.reserve(ag.leafs, ag.leaf_ids, ag.nodes, ag.node_ids)
        return ag, allocation

    def grow(self, allocation: Allocation) -> bool:
        """Grow the reserved chunks to this allocation's peaks; True when any grew."""
        grew = False
        for b, alloc in enumerate(self.galloc.allocs):
            want = allocation.chunk_sizes[b]
            have = self.sizes.setdefault(id(alloc), [])
            for c, size in enumerate(want):
                if c >= len(have):
                    have.append(0)
                if size > have[c]:
                    have[c] = size
                    grew = True
                    self._buffers.pop((id(alloc), c), None)
        return grew

    def size_of(self, backend_index: int) -> int:
        return sum(self.sizes.get(id(self.galloc.allocs[backend_index]), []))

    def sizes_by_backend(self, labels: list[str]) -> dict[str, int]:
        """Compute buffer bytes per backend; a buffer shared by backends is counted once (first)."""
        out, seen = {}, set()
        for b, label in enumerate(labels):
            alloc = self.galloc.allocs[b]
            out[label] = 0 if id(alloc) in seen else self.size_of(b)
            seen.add(id(alloc))
        return out

    def chunk(self, backend_index: int, address: Address):
        """The materialized buffer holding `address` (allocated on first use)."""
        alloc = self.galloc.allocs[backend_index]
        key = (id(alloc), address.chunk)
        buf = self._buffers.get(key)
        if buf is None:
            size = self.sizes[id(alloc)][address.chunk]
            buf = self._buffers[key] = self.bufts[backend_index].alloc_buffer(size)
        return buf
