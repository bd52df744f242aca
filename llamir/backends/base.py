"""The backend interface (after ggml-backend): support queries and compiled executables."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import ClassVar, Protocol

import numpy as np

from llamir.ir import Graph, Node
from llamir.ir.dims import Bindings


class BackendError(RuntimeError):
    """A backend that cannot run what it was asked to; the message names the op or value."""


class Executable(Protocol):
    """A compiled graph: run(leaf values by name, dim bindings) -> outputs by name."""

    def __call__(self, leaf_values: Mapping[str, np.ndarray], bindings: Bindings,
                 observe: Callable[[Node, np.ndarray], bool] | None = None) -> dict[str, np.ndarray]: ...


class Backend:
    """A device that can run graphs. Subclasses set `name` and implement compile."""

    name: ClassVar[str] = "?"

    def supports_op(self, node: Node) -> bool:
        return True

    def offload_op(self, node: Node) -> bool:
        return False

    def compile(self, graph: Graph) -> Executable:
        raise NotImplementedError

    def unsupported(self, graph: Graph) -> list[Node]:
        return [n for n in graph.nodes if not n.op.is_view and not self.supports_op(n)]

    def __repr__(self) -> str:
        return f"<backend {self.name}>"
