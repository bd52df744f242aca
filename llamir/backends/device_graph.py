"""A whole graph run on a device backend with memory of its own (test-backend-ops, `compile`):
leaves copied into device buffers, every node computed there, outputs read back.

A device plugin gives its `run(work, observe, read)`: `work` lists (node, input tensors, output
tensor) in order, `observe(node, value)` (optional) watches each result and may stop the run,
`read(node)` reads a node's value back. Buffers are allocated per binding of the graph's dims on
the first call and kept, so later calls run over the same memory (and may replay what the
backend recorded for it).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from llamir.backends.base import Backend, BackendError, TensorData
from llamir.ir import Graph, Node, bind_dims, geometry

Work = list[tuple[Node, list[TensorData], TensorData]]
Run = Callable[[Work, Callable | None, Callable[[Node], np.ndarray]], bool]


def split_work(run, memory) -> Work:
    """The work list of one scheduled split (`graph_compute`'s run and memory): each node that
    computes (views only alias), with its input tensors and its own."""
    return [(node, [memory.tensor(ref) for ref in run.inputs_of(node)], memory.tensor(node))
            for node in run.nodes if not node.op.is_view]


class DeviceGraph:
    """`graph` on `backend`'s device; call it with the leaves' values (by name) and dim bindings."""

    def __init__(self, backend: Backend, graph: Graph, run: Run):
        unsupported = backend.unsupported(graph)
        if unsupported:
            raise BackendError(f"backend {backend.name} cannot run: "
                               f"{', '.join(sorted({n.op.name for n in unsupported}))}")
        self.backend, self.graph, self.run = backend, graph, run
        self.buft = backend.device.buffer_type()
        self.bound: dict[tuple, tuple] = {}

    def _alloc(self, node: Node) -> TensorData:
        shape = geometry.storage_shape(tuple(int(d) for d in node.type.shape), node.dtype)
        dtype = geometry.storage_dtype(node.dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        buf = self.buft.alloc_buffer(max(nbytes, 4))
        strides = geometry.storage_strides(node, tuple(int(s) for s in node.type.contiguous_strides()))
        return TensorData(buf, 0, shape, dtype, strides, nbytes)

    def _layout(self, graph: Graph) -> dict[int, TensorData]:
        tensors: dict[int, TensorData] = {}
        cache: dict[int, tuple[int, ...]] = {}
        for node in [*graph.leafs, *graph.nodes]:
            if node.is_leaf or not geometry.is_view_like(node):
                tensors[id(node)] = self._alloc(node)
                continue
            root = tensors[id(geometry.view_root(node))]
            dtype = geometry.storage_dtype(node.dtype)
            strides = geometry.value_strides(node, cache)
            tensors[id(node)] = TensorData(
                root.buffer, root.offset + geometry.view_offset(node),
                geometry.storage_shape(tuple(int(d) for d in node.type.shape), node.dtype), dtype,
                geometry.storage_strides(node, strides), geometry.ggml_nbytes(node, strides))
        return tensors

    def _bound(self, bindings) -> tuple[Graph, dict[int, TensorData]]:
        key = tuple(sorted(bindings.items()))
        if key not in self.bound:
            graph = bind_dims(self.graph, dict(bindings)) if bindings else self.graph
            self.bound[key] = (graph, self._layout(graph))
        return self.bound[key]

    def work(self, bindings=()) -> Work:
        """The work list the graph runs as under `bindings` (dim name -> value), over the device
        memory of that binding: what a backend's precompile lowers to learn the code it needs."""
        return self._work(*self._bound(dict(bindings)))

    @staticmethod
    def _work(graph: Graph, t: dict[int, TensorData]) -> Work:
        return [(node, [t[id(i)] for i in node.inputs], t[id(node)]) for node in graph.nodes if not node.op.is_view]

    def __call__(self, leaf_values, bindings, observe=None):
        graph, t = self._bound(bindings)
        for leaf in graph.leafs:
            t[id(leaf)].write(np.ascontiguousarray(leaf_values[leaf.name]))
        self.run(self._work(graph, t), observe, lambda node: t[id(node)].read())
        for leaf in graph.leafs_of_kind("state"):  # written in place (set_rows): back to the caller
            np.copyto(leaf_values[leaf.name], t[id(leaf)].read())
        return {name: t[id(node)].read() for name, node in graph.outputs.items()}
