"""The numpy backend: the reference interpreter behind the backend interface (the CPU device)."""

from __future__ import annotations

import numpy as np

from llamir.backends.base import Backend, Device, cpu_device, default_threads
from llamir.backends.support import SupportTable, numpy_table
from llamir.ir import Graph, Interpreter
from llamir.ir.interp import InterpError
from llamir.ir.interp_kernels import KERNELS
from llamir.ir.numerics import Numerics, numerics_named
from llamir.ir.ops import IRError


class NumpyBackend(Backend):
    """Runs every op through llamir.ir.interp; caches dequantized weights between runs."""

    name = "numpy"

    def __init__(self, device: Device | None = None, exact: bool = True, numerics: Numerics | str | None = None,
                 n_threads: int | None = None) -> None:
        """`exact`: reproduce ggml's CPU arithmetic bit for bit (the reference), as the build of
        `numerics` (default: the host's) computes it with `n_threads` threads; False sends matmuls
        through BLAS, within float32 rounding of it and much faster (backend name "numpy-fast")."""
        super().__init__(device if device is not None else cpu_device())
        self.support: SupportTable = numpy_table()
        self.exact = exact
        self.numerics = numerics_named(numerics)
        self.n_threads = 0
        self.set_n_threads(n_threads or default_threads())

    def set_n_threads(self, n_threads: int) -> None:
        """The thread count whose ggml work split the reference reproduces (flash attention's)."""
        super().set_n_threads(n_threads)
        if n_threads != self.n_threads:
            self.n_threads = n_threads
            opts = dict(exact=self.exact, numerics=self.numerics, n_threads=n_threads)
            self.interp = Interpreter(cache_weights=True, **opts)
            self.plain = Interpreter(cache_weights=False, **opts)  # for weights copied into reused memory

    def supports_op(self, node) -> bool:
        return self.support(node)

    def compile(self, graph: Graph):
        interp = self.interp

        def run(leaf_values, bindings, observe=None):
            return interp.run(graph, leaf_values, bindings, observe)

        return run

    def graph_compute(self, run, memory, observe=None) -> bool:
        """Node by node, each result written into its allocated slot (the scheduler's split memory)."""
        self.stats.n_graph_computes += 1
        return evaluate_split(run, memory, self.interp, self.plain, observe)


def evaluate_split(run, memory, interp: Interpreter, plain: Interpreter, observe=None) -> bool:
    """Run a split's nodes with the numpy kernels, each result written to its slot. Nodes that
    read a weight copied into reusable compute memory skip the dequantized-weight cache."""
    for node in run.nodes:
        refs = run.inputs_of(node)
        args = [memory.value(r) for r in refs]
        try:
            if node.op.is_view:
                out = interp._view(node, args[0], memory.root(refs[0]), {})
            else:
                ctx = (plain if any(run.is_copy(r) for r in refs) else interp).ctx
                out = KERNELS[type(node.op)](ctx, node, args, {})
        except (IRError, InterpError):
            raise
        except (ValueError, IndexError, KeyError, TypeError) as err:
            raise InterpError(f"{node.op.name} {node.name or ''} ({node.type}): {err}") from err
        value = memory.store(node, np.asarray(out))
        if observe is not None and node.name and observe(node, value) is False:
            return False
    return True
