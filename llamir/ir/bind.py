"""bind_dims: a copy of a graph with some symbolic dims made concrete."""

from __future__ import annotations

import dataclasses

from llamir.ir import dims
from llamir.ir.dims import Bindings
from llamir.ir.graph import Graph, Node
from llamir.ir.ops import Op


def _bind_value(value, bindings: Bindings):
    if isinstance(value, dims.Sym):
        return dims.substitute(value, bindings)
    if isinstance(value, tuple):
        return tuple(_bind_value(v, bindings) for v in value)
    return value


def bind_op(op: Op, bindings: Bindings) -> Op:
    """`op` with the bound names replaced in its dim-valued attributes."""
    changes = {}
    for field in dataclasses.fields(op):
        value = getattr(op, field.name)
        bound = _bind_value(value, bindings)
        if bound != value:
            changes[field.name] = bound
    return dataclasses.replace(op, **changes) if changes else op


def bind_dims(graph: Graph, bindings: Bindings) -> Graph:
    """A new graph in which the names of `bindings` are replaced by their values."""
    unknown = set(bindings) - set(graph.dim_names)
    if unknown:
        raise KeyError(f"graph {graph.name} has no dims {sorted(unknown)} (dims: {list(graph.dim_names)})")
    out = Graph(graph.name, [d for d in graph.dim_names if d not in bindings])
    mapping: dict[int, Node] = {}
    for leaf in graph.leafs:
        mapping[id(leaf)] = out.add_leaf(leaf.kind, leaf.type.substitute(bindings), leaf.name)
    for node in graph.nodes:
        inputs = [mapping[id(x)] for x in node.inputs]
        mapping[id(node)] = out.add_node(bind_op(node.op, bindings), inputs, node.name)
    for name, node in graph.outputs.items():
        out.set_output(name, mapping[id(node)])
    return out
