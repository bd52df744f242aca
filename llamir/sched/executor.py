"""Executing a scheduled graph: inputs written into their allocated memory, split inputs copied
between backends, splits computed in order (ggml_backend_sched_compute_splits).

Every non-view value lives at its allocator address in the backends' compute buffers, so a
wrong allocation gives wrong numbers. Weights and the KV cache are the caller's: host arrays,
or tensors in the buffers of the device they are placed on (TensorData), which stay there.
Copies between splits go through the backends' tensor get/set/copy and the buffer interface.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from llamir.backends.base import TensorData, host_array
from llamir.ir import Graph, Node
from llamir.ir.geometry import (
    ggml_nbytes,
    is_view_like,
    storage_dtype,
    storage_shape,
    storage_strides,
    value_strides,
    view_offset,
    view_root,
)
from llamir.sched.plan import InputCopy, Split, SplitPlan

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


class SplitMemory:
    """Values of one execution: tensors in the compute buffers (at their allocator addresses),
    views of them, and the caller's leaves (host arrays, or TensorData in a device's buffers).

    `tensor(ref)` says where any value's bytes are; `value(ref)` gives a value as a host array,
    which is how host backends (numpy, llvm, sim) read and write their splits. A device whose
    memory the host cannot address reads `tensor(ref)` in its own buffers."""

    def __init__(self, sched, scheduled, values: Mapping[str, np.ndarray | TensorData]):
        self.sched, self.plan = sched, scheduled.plan
        self.ag, self.allocation = scheduled.alloc_graph, scheduled.allocation
        self.user = values
        self.values: dict[int, np.ndarray] = {}
        self.roots: dict[int, np.ndarray] = {}
        self.tensors: dict[int, TensorData] = {}
        self.compiled: dict = {}
        self.strides: dict[int, tuple[int, ...]] = {}

    def slot_tensor(self, ref) -> TensorData | None:
        """The tensor at `ref`'s allocated address (None when it is not allocated)."""
        t = self.ag.tensors.get(id(ref))
        where = self.allocation.addresses.get(id(t)) if t is not None else None
        if where is None:
            return None
        buffer_id, address, _ = where
        buffer = self.sched.compute_buffers.chunk(buffer_id, address)
        node = ref.src if isinstance(ref, InputCopy) else ref
        dtype = storage_dtype(node.dtype)
        shape = storage_shape(tuple(int(d) for d in node.type.shape), node.dtype)
        # the tensor's own layout: a copy of a strided view keeps the view's strides (ggml_dup_tensor_layout)
        return TensorData(buffer, address.offset, shape, dtype, storage_strides(node, tuple(t.layout[2])), t.nbytes)

    def slot(self, ref) -> np.ndarray | None:
        """The typed host array at `ref`'s allocated address (None when it is not allocated)."""
        td = self.slot_tensor(ref)
        return td.array() if td is not None else None

    def _leaf(self, ref: Node) -> np.ndarray | TensorData:
        if ref.name not in self.user:
            raise ExecError(f"no value for {ref.kind} {ref.name!r} ({ref.type})")
        value = self.user[ref.name]
        want = storage_shape(tuple(int(d) for d in ref.type.shape), ref.dtype)
        if tuple(value.shape) != want or value.dtype != storage_dtype(ref.dtype):
            raise ExecError(
                f"{ref.kind} {ref.name!r}: expected {ref.type} (storage {want} "
                f"{storage_dtype(ref.dtype)}), got {tuple(value.shape)} {value.dtype}"
            )
        return value

    def tensor(self, ref) -> TensorData:
        """Where `ref`'s bytes are: its slot, the caller's leaf, or the memory it views."""
        hit = self.tensors.get(id(ref))
        if hit is not None:
            return hit
        td = self.slot_tensor(ref)
        if td is None and isinstance(ref, Node) and ref.is_leaf:
            value = self._leaf(ref)
            host = self.sched.bufts[self.sched.cpu]
            td = value if isinstance(value, TensorData) else TensorData.of_array(host, value)
        elif td is None and isinstance(ref, Node) and is_view_like(ref):
            root = self.tensor(view_root(ref))
            dtype = storage_dtype(ref.dtype)
            strides = value_strides(ref, self.strides)
            td = TensorData(
                root.buffer, root.offset + view_offset(ref),
                storage_shape(tuple(int(d) for d in ref.type.shape), ref.dtype), dtype,
                storage_strides(ref, strides), ggml_nbytes(ref, strides),
            )
        elif td is None:
            raise ExecError(f"{self.plan.label(ref)} has no memory (not allocated)")
        self.tensors[id(ref)] = td
        return td

    def value(self, ref) -> np.ndarray:
        """`ref` as a host array (in place); BackendError when it lives in device memory."""
        hit = self.values.get(id(ref))
        if hit is not None:
            return hit
        if isinstance(ref, Node) and ref.is_leaf and ref.kind != "input":
            value = self._leaf(ref)
            if isinstance(value, TensorData):
                value = value.array()
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
        if isinstance(ref, InputCopy) and id(ref) in self.tensors:  # copied into host memory
            value = self.tensors[id(ref)].array()
            self.set(ref, value, value)
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
        """Move a split input's bytes into its copy on the split's backend (ggml_backend_tensor_copy:
        directly when the destination can, else through the host)."""
        src_td = self.tensor(src)
        dst_td = self.slot_tensor(copy)
        if not dst_backend.cpy_tensor_async(src_backend, src_td, dst_td):
            dst_backend.set_tensor_async(dst_td, src_backend.get_tensor_async(src_td))
        self.tensors[id(copy)] = dst_td
        self.values.pop(id(copy), None)

    def read(self, backend, ref) -> np.ndarray:
        """A host copy of a value, read through its backend (ggml_backend_tensor_get)."""
        td = self.tensor(ref)
        return host_array(backend.get_tensor_async(td), td)


def compute_through_compile(backend, run: SplitRun, memory: SplitMemory, observe: Observe = None) -> bool:
    """graph_compute for backends that only compile whole graphs: the split as a graph whose
    leaves are its inputs and whose outputs are its computed nodes."""
    key = (id(run.plan), run.split.index)
    if key not in memory.compiled:
        memory.compiled[key] = _split_graph(backend, run)
    executable, leaf_refs, out_nodes, needed = memory.compiled[key]
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
        if node.op.is_view and id(node) in needed and id(node) not in memory.values:
            ref = run.inputs_of(node)[0]
            from llamir.ir import Interpreter

            memory.store(node, Interpreter()._view(node, memory.value(ref), memory.root(ref), {}))
    return not stopped


def _needed_views(run: SplitRun) -> set[int]:
    """The views among a split's nodes that its computed nodes read (directly or through other
    views). A split's node range also holds views of other backends' values, which ggml leaves
    alone: reading them here would pull device memory into the host."""
    needed: set[int] = set()
    for node in reversed(run.nodes):
        if not node.op.is_view or id(node) in needed:
            needed.update(id(ref) for ref in run.inputs_of(node))
    return {id(n) for n in run.nodes if n.op.is_view and id(n) in needed}


def _split_graph(backend, run: SplitRun):
    plan = run.plan
    g = Graph(f"{plan.graph.name}.split{run.split.index}")
    mapping: dict[int, Node] = {}
    leaf_refs, out_nodes = [], []
    needed = _needed_views(run)
    for node in run.nodes:
        if node.op.is_view and id(node) not in needed:
            continue
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
    return backend.compile(g), leaf_refs, out_nodes, needed


def execute(
    sched, scheduled, values: Mapping[str, np.ndarray], observe: Observe = None
) -> dict[str, np.ndarray]:
    """ggml_backend_sched_graph_compute: inputs, then per split its copies and its compute."""
    plan = scheduled.plan
    memory = SplitMemory(sched, scheduled, values)
    for leaf in plan.graph.leafs_of_kind("input"):
        if leaf.name not in values:
            raise ExecError(f"no value for input {leaf.name!r} ({leaf.type})")
        slot = memory.slot_tensor(leaf)
        if slot is None:
            continue
        value = values[leaf.name]
        if tuple(value.shape) != slot.shape or value.dtype != slot.dtype:
            raise ExecError(
                f"input {leaf.name!r}: expected {leaf.type} (storage {slot.shape} {slot.dtype}), "
                f"got {tuple(value.shape)} {value.dtype}"
            )
        slot.write(value)
        if slot.buffer.mapped() is not None:
            memory.set(leaf, slot.array(), slot.array())
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
        # a backend that runs nothing (null), or a stopped compute, leaves what memory holds; an
        # output may be a view of another value
        if (id(node) in memory.values or id(node) in memory.tensors or memory.slot_tensor(node) is not None
                or (is_view_like(node) and _has_memory(memory, view_root(node)))):
            outputs[name] = memory.read(plan.backend_of(node), node)
    return outputs


def _has_memory(memory: SplitMemory, ref) -> bool:
    return id(ref) in memory.values or id(ref) in memory.tensors or memory.slot_tensor(ref) is not None or (
        isinstance(ref, Node) and ref.is_leaf)


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
