"""Clean-up passes: dead-code elimination and common-subexpression elimination."""

from __future__ import annotations

from llamir.ir import Graph
from llamir.ir.graph import live_nodes
from llamir.passes.base import GraphPass, Rewriter, register_pass


@register_pass
class DeadCodeElimination(GraphPass):
    """Remove nodes that no output needs. Side-effecting nodes (set_rows into the KV cache)
    are roots too, so their writes stay; leaves are kept (they are the graph's interface)."""

    name = "dce"

    def run(self, graph: Graph) -> bool:
        roots = list(graph.outputs.values()) + [n for n in graph.nodes if n.op.has_side_effects]
        live = live_nodes(graph, roots)
        dead = [n for n in graph.nodes if id(n) not in live]
        if not dead:
            return False
        rw = Rewriter(graph)
        for node in reversed(dead):  # users before their inputs
            rw.erase(node)
        return True


@register_pass
class CommonSubexpressionElimination(GraphPass):
    """Merge nodes that apply an equal op to the same inputs: the later one's uses move to the
    earlier. Side-effecting ops are never merged (two writes are two writes)."""

    name = "cse"

    def run(self, graph: Graph) -> bool:
        seen: dict[tuple, object] = {}
        canon: dict[int, object] = {}  # a duplicate's id -> the node that replaces it
        duplicates = []
        for node in graph.nodes:
            if node.op.has_side_effects:
                continue
            key = (node.op, tuple(id(canon.get(id(x), x)) for x in node.inputs))
            try:
                first = seen.setdefault(key, node)
            except TypeError:  # an op with an unhashable attribute: leave it alone
                continue
            if first is node or first.type != node.type:
                continue
            if first.name is not None and node.name is not None and first.name != node.name:
                continue  # both are observable under their own names
            canon[id(node)] = first
            duplicates.append((node, first))
        rw = Rewriter(graph)
        for node, first in duplicates:
            if first.name is None:
                first.name = node.name
            rw.replace_uses(node, first)
            rw.erase(node)
        return bool(duplicates)
