"""The verifier: every invariant a well-formed graph keeps, checked after each pass in tests."""

from __future__ import annotations

from llamir.ir import dims
from llamir.ir.graph import Graph, topo_check
from llamir.ir.ops import IRError
from llamir.ir.types import TensorType

INT64_MAX = 2**63 - 1


class VerifyError(IRError):
    """A graph that breaks an invariant; the message names the value."""


def verify(graph: Graph) -> None:
    """Raise VerifyError unless: leaves are leaf ops and nodes are not; nodes are in topological
    order; every type equals what its op infers; users lists match the edges; dims are
    declared (in types and in attributes); types are ones a tensor can have (whole quantized
    blocks, a byte size int64 counts); leaves are named, uniquely; outputs belong to the graph;
    concrete views stay inside their source."""
    members = {id(x) for x in graph.all_values()}
    leaf_names: set[str] = set()
    for leaf in graph.leafs:
        if not leaf.is_leaf:
            raise VerifyError(f"{leaf!r} is in the leaf list but is an op node")
        if not isinstance(leaf.name, str):
            raise VerifyError(f"leaf {leaf!r} has no name; leaves are bound by name")
        if leaf.name in leaf_names:
            raise VerifyError(f"two leaves are named {leaf.name!r}; leaves are bound by name")
        leaf_names.add(leaf.name)
    for node in graph.nodes:
        if node.is_leaf:
            raise VerifyError(f"leaf {node!r} is in the node list")
    try:
        topo_check(graph)
    except IRError as err:
        raise VerifyError(str(err)) from None
    expected_users: dict[int, int] = {}
    for i, node in enumerate(graph.nodes):
        for x in node.inputs:
            if id(x) not in members:
                raise VerifyError(f"node {i} ({node!r}) uses {x!r}, which is not in the graph")
            expected_users[id(x)] = expected_users.get(id(x), 0) + 1
        try:
            inferred = node.op.check_and_infer(tuple(x.type for x in node.inputs))
        except IRError as err:
            raise VerifyError(f"node {i} ({node!r}): {err}") from None
        if inferred != node.type:
            raise VerifyError(f"node {i} ({node!r}) is typed {node.type} but its op infers {inferred}")
        check_attr_dims(graph, node)
        check_view_bounds(node)
    for x in graph.all_values():
        problem = type_problem(x.type)
        if problem:
            raise VerifyError(f"{x!r}: {problem}")
        if len(x.users) != expected_users.get(id(x), 0):
            raise VerifyError(f"{x!r} lists {len(x.users)} users but {expected_users.get(id(x), 0)} "
                              "nodes use it")
        for d in x.type.shape:
            for name in dims.names(d):
                if name not in graph.dim_names:
                    raise VerifyError(f"{x!r} uses undeclared dim {name!r}")
    for name, node in graph.outputs.items():
        if id(node) not in members:
            raise VerifyError(f"output {name!r} is not a value of the graph")


def type_problem(t: TensorType) -> str | None:
    """What makes `t` a type no tensor can have (None if nothing): a quantized row that is not whole
    blocks (ggml_new_tensor asserts ne[0] % blck_size == 0), or more bytes than int64 counts."""
    if t.dtype.block_size != 1:
        row = t.shape[-1]
        if not isinstance(row, int):
            return f"a {t.dtype} row needs a concrete length, got {row}"
        if row % t.dtype.block_size:
            return f"a {t.dtype} row of {row} elements is not a whole number of {t.dtype.block_size}-element blocks"
    nbytes = t.nbytes
    coef = dims.evaluate(nbytes, dict.fromkeys(dims.names(nbytes), 1))   # the bytes with every dim at 1
    if coef > INT64_MAX:
        return f"{t} takes {coef} bytes, more than int64 counts"
    return None


def check_attr_dims(graph: Graph, node) -> None:
    """Every symbolic dim in the node's attributes (view strides and offset, target shapes) is
    one the graph declares."""
    for field, value in node.op.attrs().items():
        for d in value if isinstance(value, tuple) else (value,):
            if isinstance(d, dims.Sym):
                for name in dims.names(d):
                    if name not in graph.dim_names:
                        raise VerifyError(f"{node!r}: attribute {field}={d} uses undeclared dim {name!r}")


def check_view_bounds(node) -> None:
    """For concrete views, the last byte read must lie within the viewed tensor."""
    from llamir.ir import ops

    if not node.is_op(ops.View) or node.inputs[0].op.is_view:
        return  # a view of a view has absolute strides over a buffer this node cannot see
    src = node.inputs[0].type
    op = node.op
    if not (node.type.is_concrete and src.is_concrete and all(isinstance(s, int) for s in op.strides)
            and isinstance(op.offset, int)):
        return
    shape = node.type.shape
    if any(n == 0 for n in shape):
        return
    row = node.type.row_bytes
    last = op.offset + sum((n - 1) * s for n, s in zip(shape[:-1], op.strides[:-1])) + row
    if op.offset < 0 or last > src.nbytes:
        raise VerifyError(f"{node!r} reads bytes [{op.offset}, {last}) of a {src.nbytes}-byte {src}")
