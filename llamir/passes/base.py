"""Pass infrastructure: GraphPass, the Rewriter (the one way passes change a graph), rewrite
patterns and the greedy driver that applies them to a fixed point.

    class Double(RewritePattern):
        \"\"\"add(x, x) -> scale(x, 2)\"\"\"
        root = ops.Add

        def match_and_rewrite(self, node, rw):
            if node.inputs[0] is not node.inputs[1]:
                return False
            rw.replace(node, ops.Scale(s=2.0), node.inputs[0])
            return True

    changed = apply_patterns(graph, [Double()])
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import ClassVar

from llamir.ir import Graph, Node
from llamir.ir.ops import IRError, Op

PASSES: dict[str, type[GraphPass]] = {}


def register_pass(cls: type[GraphPass]) -> type[GraphPass]:
    """Record a pass class under its pipeline name (e.g. "dce")."""
    if cls.name in PASSES and PASSES[cls.name] is not cls:
        raise RuntimeError(f"pass name {cls.name!r} registered twice")
    PASSES[cls.name] = cls
    return cls


class GraphPass(ABC):
    """A named transformation: run(graph) changes the graph in place and says whether it did."""

    name: ClassVar[str] = "?"

    @abstractmethod
    def run(self, graph: Graph) -> bool:
        """Transform `graph` in place; True if anything changed."""

    def __repr__(self) -> str:
        return f"<pass {self.name}>"


class Rewriter:
    """Graph mutations that keep nodes in topological order and users lists exact.

    New nodes are typed by their op (so a bad rewrite fails here, not later), and a replacement
    must have the type of the value it replaces."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.n_changes = 0
        self.erased: set[int] = set()  # ids of removed nodes (callers keep them alive while sweeping)

    def create(self, op: Op, inputs: Sequence[Node], *, before: Node, name: str | None = None) -> Node:
        """A new node computing `op(inputs)`, placed just before `before` in the node order."""
        for x in inputs:
            if x.graph is not self.graph:
                raise IRError(f"{op.name}: input {x!r} belongs to another graph")
        node = Node(self.graph, op, tuple(inputs), op.check_and_infer(tuple(x.type for x in inputs)), name)
        self.graph.nodes.insert(self._index(before), node)
        for x in node.inputs:
            x.users.append(node)
        self.n_changes += 1
        return node

    def replace(self, node: Node, op: Op, *inputs: Node, name: str | None = None) -> Node:
        """Replace `node` by a new `op(inputs)` (same type, same name unless given); returns it."""
        new = self.create(op, inputs, before=node, name=name if name is not None else node.name)
        if new.type != node.type:
            self._unlink(new)
            raise IRError(f"{op.name} would change {node!r} from {node.type} to {new.type}")
        self.replace_uses(node, new)
        self.erase(node)
        return new

    def replace_uses(self, old: Node, new: Node) -> None:
        """Every use of `old` (as an input or an output) now uses `new`."""
        if old is new:
            return
        if old.type != new.type:
            raise IRError(f"cannot replace {old!r} by {new!r}: types differ")
        for user in list(old.users):
            user.inputs = tuple(new if x is old else x for x in user.inputs)
            new.users.append(user)
        old.users = []
        for out_name, out in self.graph.outputs.items():
            if out is old:
                self.graph.outputs[out_name] = new
        self._fix_order(new)
        self.n_changes += 1

    def erase(self, node: Node) -> None:
        """Remove an unused node; its inputs lose a user."""
        if node.users or node in self.graph.outputs.values():
            raise IRError(f"cannot erase {node!r}: it is still used")
        if node.is_leaf:
            self.graph.leafs.remove(node)
        else:
            self._unlink(node)
        self.erased.add(id(node))
        self.n_changes += 1

    def _unlink(self, node: Node) -> None:
        self.graph.nodes.remove(node)
        for x in node.inputs:
            x.users.remove(node)

    def _index(self, node: Node) -> int:
        for i, x in enumerate(self.graph.nodes):
            if x is node:
                return i
        raise IRError(f"{node!r} is not a node of graph {self.graph.name}")

    def _fix_order(self, new: Node) -> None:
        """Users that now come before `new` (it replaced a later value) move after it."""
        if new.is_leaf or not new.users:
            return
        order = {id(x): i for i, x in enumerate(self.graph.nodes)}
        if all(order[id(u)] > order[id(new)] for u in new.users):
            return
        nodes = self.graph.nodes
        position = order[id(new)]
        moved = [x for x in nodes[:position] if _depends_on(x, new, order, position)]
        moved_ids = {id(x) for x in moved}
        kept = [x for x in nodes[:position + 1] if id(x) not in moved_ids]
        self.graph.nodes[:] = kept + moved + nodes[position + 1:]


def _depends_on(x: Node, new: Node, order: dict[int, int], limit: int) -> bool:
    """Whether node x (before `new`) reads `new` directly or through nodes before `limit`."""
    stack, seen = [x], set()
    while stack:
        y = stack.pop()
        if y is new:
            return True
        if id(y) in seen or y.is_leaf or order.get(id(y), limit + 1) > limit:
            continue
        seen.add(id(y))
        stack.extend(y.inputs)
    return False


class RewritePattern(ABC):
    """One local rewrite rooted at a node of type `root`; the docstring states its algebra."""

    root: ClassVar[type[Op] | tuple[type[Op], ...]] = Op

    @abstractmethod
    def match_and_rewrite(self, node: Node, rw: Rewriter) -> bool:
        """Rewrite at `node` through `rw` if the pattern matches; True if it did."""


def apply_patterns(graph: Graph, patterns: Iterable[RewritePattern], max_iterations: int = 20) -> bool:
    """Apply `patterns` over the graph until none matches (or `max_iterations` sweeps); returns
    whether anything changed. Each sweep visits the nodes in order; dead nodes are skipped."""
    patterns = list(patterns)
    rw = Rewriter(graph)
    changed = False
    for _ in range(max_iterations):
        swept = False
        for node in list(graph.nodes):
            if id(node) in rw.erased:
                continue
            for pattern in patterns:
                if isinstance(node.op, pattern.root) and pattern.match_and_rewrite(node, rw):
                    swept = changed = True
                    break
        if not swept:
            return changed
    return changed


class PatternPass(GraphPass):
    """A pass made of rewrite patterns applied greedily."""

    patterns: ClassVar[tuple[type[RewritePattern], ...]] = ()

    def run(self, graph: Graph) -> bool:
        return apply_patterns(graph, [p() for p in self.patterns])
