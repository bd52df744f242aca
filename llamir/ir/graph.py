"""The graph: leaves (inputs, weights, state) and typed nodes in topological order."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence

from llamir.ir import dims, ops
from llamir.ir.ops import IRError, Op
from llamir.ir.types import TensorType

_IDENT = re.compile(r"[A-Za-z_][\w.\-]*")


class Node:
    """One value of a graph: a leaf or the result of an op applied to earlier values."""

    __slots__ = ("graph", "op", "inputs", "type", "name", "users", "__weakref__")

    def __init__(self, graph: Graph, op: Op, inputs: tuple[Node, ...], type: TensorType, name: str | None):
        self.graph = graph
        self.op = op
        self.inputs = inputs
        self.type = type
        self.name = name
        self.users: list[Node] = []

    @property
    def shape(self) -> tuple[dims.Dim, ...]:
        return self.type.shape

    @property
    def dtype(self):
        return self.type.dtype

    @property
    def is_leaf(self) -> bool:
        return self.op.is_leaf

    @property
    def kind(self) -> str:
        """"input", "weight" or "state" for leaves, "node" otherwise."""
        return self.op.kind if self.op.is_leaf else "node"

    def is_op(self, *classes: type[Op]) -> bool:
        return isinstance(self.op, classes)

    def has_one_use(self) -> bool:
        return len(self.users) == 1 and self not in self.graph.outputs.values()

    def __repr__(self) -> str:
        label = f' "{self.name}"' if self.name else ""
        return f"<{self.op.name} {self.type}{label}>"

    # Arithmetic sugar for builders: x + y, x * y, x - y, x / y.
    def __add__(self, other: Node) -> Node:
        return self.graph.add_node(ops.Add(), (self, other))

    def __sub__(self, other: Node) -> Node:
        return self.graph.add_node(ops.Sub(), (self, other))

    def __mul__(self, other: Node) -> Node:
        return self.graph.add_node(ops.Mul(), (self, other))

    def __truediv__(self, other: Node) -> Node:
        return self.graph.add_node(ops.Div(), (self, other))


class Graph:
    """Leaves and nodes (topologically ordered), the symbolic dims, and named outputs."""

    def __init__(self, name: str = "graph", dim_names: Sequence[str] = ()):
        if not _IDENT.fullmatch(name):
            raise IRError(f"graph name {name!r} must match {_IDENT.pattern}")
        self.name = name
        self.dim_names: tuple[str, ...] = tuple(dim_names)
        self.leafs: list[Node] = []
        self.nodes: list[Node] = []
        self.outputs: dict[str, Node] = {}

    # -- construction ---------------------------------------------------------------------
    def add_leaf(self, kind: str, type: TensorType, name: str) -> Node:
        self._check_dims(type)
        leaf = Node(self, ops.Leaf(kind), (), type, name)
        self.leafs.append(leaf)
        return leaf

    def add_node(self, op: Op, inputs: Sequence[Node], name: str | None = None) -> Node:
        for x in inputs:
            if x.graph is not self:
                raise IRError(f"{op.name}: input {x!r} belongs to another graph")
        node = Node(self, op, tuple(inputs), op.check_and_infer(tuple(x.type for x in inputs)), name)
        self._check_dims(node.type)
        for x in node.inputs:
            x.users.append(node)
        self.nodes.append(node)
        return node

    def set_output(self, name: str, node: Node) -> None:
        if not _IDENT.fullmatch(name):
            raise IRError(f"output name {name!r} must match {_IDENT.pattern}")
        self.outputs[name] = node

    def _check_dims(self, type: TensorType) -> None:
        for d in type.shape:
            for n in dims.names(d):
                if n not in self.dim_names:
                    raise IRError(f"dim {n!r} of {type} is not declared by graph {self.name} "
                                  f"(declared: {', '.join(self.dim_names) or 'none'})")

    # -- queries --------------------------------------------------------------------------
    def all_values(self) -> Iterator[Node]:
        yield from self.leafs
        yield from self.nodes

    def leaf(self, name: str) -> Node:
        for x in self.leafs:
            if x.name == name:
                return x
        raise KeyError(f"graph {self.name} has no leaf named {name!r}")

    def find(self, name: str) -> Node:
        for x in self.all_values():
            if x.name == name:
                return x
        raise KeyError(f"graph {self.name} has no value named {name!r}")

    def leafs_of_kind(self, kind: str) -> list[Node]:
        return [x for x in self.leafs if x.kind == kind]

    def rebuild_users(self) -> None:
        for x in self.all_values():
            x.users = []
        for n in self.nodes:
            for x in n.inputs:
                x.users.append(n)

    def to_networkx(self):
        """A networkx DiGraph view (edges input -> user), node attributes op/type/name."""
        import networkx as nx

        g = nx.DiGraph()
        index = {id(x): i for i, x in enumerate(self.all_values())}
        for x in self.all_values():
            g.add_node(index[id(x)], op=x.op.name, type=str(x.type), name=x.name or "", kind=x.kind)
        for n in self.nodes:
            for x in n.inputs:
                g.add_edge(index[id(x)], index[id(n)])
        return g

    # -- text -----------------------------------------------------------------------------
    def __str__(self) -> str:
        from llamir.ir.printer import print_graph

        return print_graph(self)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Graph) and str(self) == str(other)

    def __hash__(self) -> int:
        return hash(str(self))

    def fingerprint(self) -> str:
        from llamir.ir.printer import fingerprint

        return fingerprint(self)


def topo_check(graph: Graph) -> None:
    """Every node's inputs come earlier (leaves first); raises IRError otherwise."""
    seen = {id(x) for x in graph.leafs}
    for i, n in enumerate(graph.nodes):
        for x in n.inputs:
            if id(x) not in seen:
                raise IRError(f"node {i} ({n!r}) uses {x!r} before it is defined")
        seen.add(id(n))


def live_nodes(graph: Graph, roots: Iterable[Node]) -> set[int]:
    """ids of every value reachable backwards from `roots`."""
    live: set[int] = set()
    stack = list(roots)
    while stack:
        x = stack.pop()
        if id(x) in live:
            continue
        live.add(id(x))
        stack.extend(x.inputs)
    return live
