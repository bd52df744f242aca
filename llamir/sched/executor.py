"""Executing a scheduled graph: inputs written into their allocated memory, split inputs copied
between backends, splits computed in order (ggml_backend_sched_compute_splits).

Every non-view value lives at its allocator address in the backends' compute buffers, so a
wrong allocation gives wrong numbers; weights and the KV cache stay in the caller's arrays.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from llamir.ir import Graph, Node
from llamir.ir.interp import storage_dtype, storage_shape
from llamir.sched.plan import InputCopy, Split, SplitPlan, is_view_like, view_root

Observe = Callable[[Node, np.ndarray], bool] | None


class ExecError(RuntimeError):
    """A scheduled graph that cannot run with the given values; names the value."""


@dataclass
class SplitRun:
    """One split as a backend computes it: its nodes and their (possibly copied) inputs."""

    plan: SplitPlan
    split: Split

    @property
    def nodes(self) -> list[Node]:
        return self.plan.split_nodes(self.split)

    def inputs_of(self, node: Node):
        return self.plan.inputs_of(node)

    @staticmethod
    def is_copy(ref) -> bool:
        """Whether an input is a copy made for this split (in reused compute memory)."""
        return isinstance(ref, InputCopy)

    def compute_through_compile(self, backend, memory: SplitMemory, observe: Observe = None) -> bool:
        """Backend.graph_compute's default: compile this split as a graph and run it."""
        return compute_through_compile(backend, self, memory, observe)


def _typed(raw: np.ndarray, shape: tuple[int, ...], dtype: np.dtype, strides: tuple[int, ...]) -> np.ndarray:
    return np.ndarray(shape, dtype=dtype, buffer=raw, offset=0, strides=strides)


def _raw_window(value: np.ndarray, root: np.ndarray, nbytes: int) -> np.ndarray:
    """The nbytes raw bytes starting at `value`'s first element, inside its C-contiguous root."""
    flat = np.ascontiguousarray(root).reshape(-1).view(np.uint8)
    if flat.__array_interface__["data"][0] != root.__array_interface__["data"][0]:
        raise ExecError("a value's memory is not contiguous; cannot copy its bytes")
    offset = value.__array_interface__["data"][0] - root.__array_interface__["data"][0]
    return flat[offset : offset + nbytes]


class SplitMemory:
    """Values of one execution: slots in the compute buffers, views, and the caller's arrays."""

    def __init__(self, sched, scheduled, values: Mapping[str, np.ndarray]):
        self.sched, self.plan = sched, scheduled.plan
        self.ag, self.allocation = scheduled.alloc_graph, scheduled.allocation
        self.user = values
        self.values: dict[int, np.ndarray] = {}
        self.roots: dict[int, np.ndarray] = {}
        self.compiled: dict = {}

    def _slot_raw(self, ref) -> np.ndarray | None:
        t = self.ag.tensors.get(id(ref))
        where = self.allocation.addresses.get(id(t)) if t is not None else None
        if where is None:
            return None
        buffer_id, address, _ = where
        return self.sched.compute_buffers.chunk(buffer_id, address).view(address.offset, t.nbytes)

    def slot(self, ref) -> np.ndarray | None:
        """The typed array at `ref`'s allocated address (None when it is not allocated)."""
        raw = self._slot_raw(ref)
        if raw is None:
            return None
        node = ref.src if isinstance(ref, InputCopy) else ref
        dtype = storage_dtype(node.dtype)
        shape = storage_shape(tuple(int(d) for d in node.type.shape), node.dtype)
        layout = self.ag.tensors[id(ref)].layout[2]
        return _typed(raw, shape, dtype, tuple(layout[:-1]) + (dtype.itemsize,))

    def value(self, ref) -> np.ndarray:
        hit = self.values.get(id(ref))
        if hit is not None:
            return hit
        if isinstance(ref, Node) and ref.is_leaf and ref.kind != "input":
            if ref.name not in self.user:
                raise ExecError(f"no value for {ref.kind} {ref.name!r} ({ref.type})")
            value = self.user[ref.name]
            want = storage_shape(tuple(int(d) for d in ref.type.shape), ref.dtype)
            if tuple(value.shape) != want or value.dtype != storage_dtype(ref.dtype):
                raise ExecError(
                    f"{ref.kind} {ref.name!r}: expected {ref.type} (storage {want} "
                    f"{storage_dtype(ref.dtype)}), got {tuple(value.shape)} {value.dtype}"
                )
            self.set(ref, value, value)
            return value
        if isinstance(ref, Node) and not ref.is_leaf and ref.op.is_view:
            # ggml sets a view's data when it allocates the graph, so it is readable (copied into
            # another split) before its own position in the node order
            from llamir.ir import Interpreter

            src = ref.inputs[0]
            value = Interpreter()._view(ref, self.value(src), self.root(src), {})
            self.set(ref, value, self.root(src))
            return value
        raise ExecError(f"{self.plan.label(ref)} is read before it is computed")

    def root(self, ref) -> np.ndarray:
        self.value(ref)
        return self.roots[id(ref)]

    def set(self, ref, value: np.ndarray, root: np.ndarray) -> None:
        self.values[id(ref)] = value
        self.roots[id(ref)] = root

    def store(self, node: Node, result: np.ndarray) -> np.ndarray:
        """Write a computed result into the node's slot; views and in-place writes keep their root."""
        if is_view_like(node):
            self.set(node, result, self.root(self.plan.inputs_of(node)[0]))
            return result
        slot = self.slot(node)
        if slot is None:
            raise ExecError(f"{self.plan.label(node)} has no memory (not allocated)")
        np.copyto(slot, result.reshape(slot.shape) if result.shape != slot.shape else result, casting="no")
        self.set(node, slot, slot)
        return slot

    def copy_in(self, src: Node, copy: InputCopy, src_backend, dst_backend) -> None:
        """Move a split input's bytes into its copy on the split's backend."""
        value = self.value(src)
        dst_raw = self._slot_raw(copy)
        src_raw = _raw_window(value, self.root(src), copy.nbytes)
        if not dst_backend.cpy_tensor_async(src_backend, src_raw, dst_raw):
            dst_backend.set_tensor_async(dst_raw, src_backend.get_tensor_async(src_raw))
        typed = _typed(dst_raw, value.shape, value.dtype, value.strides)
        self.set(copy, typed, typed)


def compute_through_compile(backend, run: SplitRun, memory: SplitMemory, observe: Observe = None) -> bool:
    """graph_compute for backends that only compile whole graphs: the split as a graph whose
    leaves are its inputs and whose outputs are its computed nodes."""
    key = (id(run.plan), run.split.index)
    if key not in memory.compiled:
        memory.compiled[key] = _split_graph(backend, run)
    executable, leaf_refs, out_nodes = memory.compiled[key]
    values = {
        leaf.name: memory.value(ref)
        if (isinstance(ref, Node) and ref.is_leaf)
        else np.ascontiguousarray(memory.value(ref))
        for leaf, ref in leaf_refs
    }
    stopped = []

    def watch(node, value):
        keep = observe(node, value) is not False
        if not keep:
            stopped.append(node)
        return keep

    results = executable(values, {}, watch if observe is not None else None)
    for name, node in out_nodes:
        if name in results:
            if node.op.has_side_effects:
                memory.set(node, results[name], memory.root(run.inputs_of(node)[0]))
            else:
                memory.store(node, results[name])
    for node in run.nodes:  # views of this split, recomputed over the stored values
        if node.op.is_view and id(node) not in memory.values:
            ref = run.inputs_of(node)[0]
            from llamir.ir import Interpreter

            memory.store(node, Interpreter()._view(node, memory.value(ref), memory.root(ref), {}))
    return not stopped


def _split_graph(backend, run: SplitRun):
    plan = run.plan
    g = Graph(f"{plan.graph.name}.split{run.split.index}")
    mapping: dict[int, Node] = {}
    leaf_refs, out_nodes = [], []
    for node in run.nodes:
        inputs = []
        for ref in run.inputs_of(node):
            if id(ref) not in mapping:
                if isinstance(ref, Node) and ref.is_leaf:
                    leaf = g.add_leaf(ref.kind, ref.type, ref.name)
                else:
                    src = ref.src if isinstance(ref, InputCopy) else ref
                    leaf = g.add_leaf("input", src.type, f"in{len(leaf_refs)}:{plan.label(ref)}")
                mapping[id(ref)] = leaf
                leaf_refs.append((leaf, ref))
            inputs.append(mapping[id(ref)])
        mapping[id(node)] = g.add_node(node.op, inputs, node.name)
        if not node.op.is_view:
            name = f"n{plan.ids[id(node)]}"
            g.set_output(name, mapping[id(node)])
            out_nodes.append((name, node))
    return backend.compile(g), leaf_refs, out_nodes


def execute(
    sched, scheduled, values: Mapping[str, np.ndarray], observe: Observe = None
) -> dict[str, np.ndarray]:
    """ggml_backend_sched_graph_compute: inputs, then per split its copies and its compute."""
    plan = scheduled.plan
    memory = SplitMemory(sched, scheduled, values)
    for leaf in plan.graph.leafs_of_kind("input"):
        if leaf.name not in values:
            raise ExecError(f"no value for input {leaf.name!r} ({leaf.type})")
        slot = memory.slot(leaf)
        if slot is None:
            continue
        value = values[leaf.name]
        if tuple(value.shape) != slot.shape or value.dtype != slot.dtype:
            raise ExecError(
                f"input {leaf.name!r}: expected {leaf.type} (storage {slot.shape} {slot.dtype}), "
                f"got {tuple(value.shape)} {value.dtype}"
            )
        np.copyto(slot, value)
        memory.set(leaf, slot, slot)
    prev = -1
    for split in plan.splits:
        backend = plan.backends[split.backend]
        event = _event(sched, split.backend, plan.cur_copy)
        if not split.inputs and prev >= 0 and prev != split.backend:
            prev_event = _event(sched, prev, plan.cur_copy)
            prev_event.synchronize() if prev_event is not None else plan.backends[prev].synchronize()
        for inp, cpy in zip(split.inputs, split.copies, strict=True):
            if inp.is_leaf and inp.kind == "input" or event is None:
                event.synchronize() if event is not None else backend.synchronize()
            else:
                event.wait(backend)
            memory.copy_in(inp, cpy, plan.backend_of(inp), backend)
        ok = backend.graph_compute(SplitRun(plan, split), memory, observe)
        if event is not None:
            event.record()
        prev = split.backend
        if not ok:
            break
    outputs = {}
    for name, node in plan.graph.outputs.items():
        # a backend that runs nothing (null), or a stopped compute, leaves what memory holds
        value = memory.values.get(id(node))
        value = value if value is not None else memory.slot(node)
        if value is not None:
            outputs[name] = plan.backend_of(node).get_tensor_async(value)
    return outputs


def _event(sched, backend_index: int, copy: int):
    key = (backend_index, copy)
    if key not in sched._events:
        sched._events[key] = sched.backends[backend_index].event_new()
    return sched._events[key]


__all__ = [
    "ExecError",
    "SplitMemory",
    "SplitRun",
    "compute_through_compile",
    "execute",
    "view_root",
]
