"""Support tables: which ops a backend runs, as data.

A table maps op classes to predicates over the node (its types, attributes, shapes). Leaves and
views are always supported. Tables combine:

    numpy = SupportTable.of(KERNELS)                           # every op with a numpy kernel
    gpu = numpy.only({"mul_mat", "add"}).where(float_types({"f32", "f16"}))
    both = llvm_table | gpu                                    # either claims it
    table.without(ops.SoftMaxExt)

`claims(node)` asks the table itself; calling the table (`table(node)`, a backend's
`supports_op`) also accepts a fused op the table lacks when it claims every op the fused one
expands into: the decomposition pass (llamir.passes.decompose) expands it before lowering.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from llamir.ir import Node, ops
from llamir.passes.decompose import parts_of

Predicate = Callable[[Node], bool]


def always(node: Node) -> bool:
    return True


def float_types(names: Iterable[str]) -> Predicate:
    """Every float value the node reads or writes has one of the dtype names (ints are free)."""
    allowed = frozenset(names)

    def check(node: Node) -> bool:
        return all(v.dtype.is_int or v.dtype.name in allowed for v in (node, *node.inputs))

    check.__doc__ = f"float types in {sorted(allowed)}"
    return check


def _both(a: Predicate, b: Predicate) -> Predicate:
    if a is always:
        return b
    if b is always:
        return a
    return lambda node: a(node) and b(node)


def _either(a: Predicate, b: Predicate) -> Predicate:
    if a is always or b is always:
        return always
    return lambda node: a(node) or b(node)


class SupportTable:
    """Op class -> predicate. Immutable; the combinators return new tables."""

    def __init__(self, entries: Mapping[type[ops.Op], Predicate]):
        self.entries: dict[type[ops.Op], Predicate] = dict(entries)

    @classmethod
    def of(cls, op_classes: Iterable[type[ops.Op]], predicate: Predicate = always) -> SupportTable:
        return cls({c: predicate for c in op_classes})

    # -- questions ------------------------------------------------------------------------------
    def claims(self, node: Node) -> bool:
        """The table runs this node as it is."""
        if node.is_leaf or node.op.is_view:
            return True
        predicate = self.entries.get(type(node.op))
        return predicate is not None and bool(predicate(node))

    def __call__(self, node: Node) -> bool:
        """The table runs this node, itself or expanded into parts it claims."""
        if self.claims(node):
            return True
        parts = parts_of(type(node.op))
        return parts is not None and all(p in self.entries for p in parts)

    def op_names(self) -> list[str]:
        return sorted(c.name for c in self.entries)

    def __contains__(self, op_class: type[ops.Op]) -> bool:
        return op_class in self.entries

    # -- combinators ----------------------------------------------------------------------------
    def only(self, names: Iterable[str]) -> SupportTable:
        """The entries whose op name is in `names` (unknown names are an error)."""
        wanted = set(names)
        known = {c.name for c in self.entries}
        unknown = wanted - known
        if unknown:
            raise ValueError(f"ops {', '.join(sorted(unknown))} are not in the table ({', '.join(sorted(known))})")
        return SupportTable({c: p for c, p in self.entries.items() if c.name in wanted})

    def without(self, *op_classes: type[ops.Op]) -> SupportTable:
        return SupportTable({c: p for c, p in self.entries.items() if c not in op_classes})

    def where(self, predicate: Predicate) -> SupportTable:
        """Every entry also needs `predicate`."""
        return SupportTable({c: _both(p, predicate) for c, p in self.entries.items()})

    def __or__(self, other: SupportTable) -> SupportTable:
        merged = dict(self.entries)
        for c, p in other.entries.items():
            merged[c] = _either(merged[c], p) if c in merged else p
        return SupportTable(merged)

    def __and__(self, other: SupportTable) -> SupportTable:
        return SupportTable({c: _both(p, other.entries[c]) for c, p in self.entries.items() if c in other.entries})

    def __repr__(self) -> str:
        return f"<support table of {len(self.entries)} ops>"


def numpy_table() -> SupportTable:
    """Every op the numpy reference has a kernel for."""
    from llamir.ir.interp_kernels import KERNELS

    return SupportTable.of(KERNELS)
