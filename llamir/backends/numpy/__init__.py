"""The numpy backend: the reference interpreter behind the backend interface."""

from __future__ import annotations

from llamir.backends.base import Backend
from llamir.ir import Graph, Interpreter
from llamir.ir.interp_kernels import KERNELS


class NumpyBackend(Backend):
    """Runs every op through llamir.ir.interp; caches dequantized weights between runs."""

    name = "numpy"

    def __init__(self) -> None:
        self.interp = Interpreter(cache_weights=True)

    def supports_op(self, node) -> bool:
        return node.op.is_view or type(node.op) in KERNELS

    def compile(self, graph: Graph):
        interp = self.interp

        def run(leaf_values, bindings, observe=None):
            return interp.run(graph, leaf_values, bindings, observe)

        return run
