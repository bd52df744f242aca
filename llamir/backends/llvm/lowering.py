"""Graph -> Plan: where each value lives and the kernel steps that compute it.

`LOWER` maps op classes to lowering functions (registered by the kernel modules with
`@lowering(ops.X)`); `support_table(target)` is the backend's support table, built from the same
functions' `supports` predicates, so the backend never claims an op it cannot lower.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from llamir.backends.base import BackendError
from llamir.backends.llvm import expr as E
from llamir.backends.llvm.expr import Expr
from llamir.backends.llvm.plan import Buffer, Kernel, Part, Plan, Ref, Step, contiguous_strides, node_shape
from llamir.backends.llvm.target import Target
from llamir.backends.support import SupportTable
from llamir.ir import Graph, Node, ops
from llamir.ir.numerics import AVX512, Numerics

Lower = Callable[["Lowerer", Node], None]
Supports = Callable[[Node, Target], bool]

LOWER: dict[type, tuple[Lower, Supports]] = {}


def _always(node: Node, target: Target) -> bool:
    return True


def lowering(*classes: type, supports: Supports = _always):
    """Register a lowering for op classes, with the predicate saying which nodes it handles."""
    def wrap(fn: Lower) -> Lower:
        for cls in classes:
            LOWER[cls] = (fn, supports)
        return fn
    return wrap


def support_table(target: Target) -> SupportTable:
    """The backend's support table: every op with a lowering, under its predicate for `target`."""
    return SupportTable({cls: partial(_supports_on, supports, target) for cls, (_, supports) in LOWER.items()})


def _supports_on(supports: Supports, target: Target, node: Node) -> bool:
    return supports(node, target)


class Lowerer:
    """Builds the Plan of one graph (nodes in order; views resolved as they come)."""

    def __init__(self, graph: Graph, target: Target, n_threads: int = 1, numerics: Numerics = AVX512):
        self.graph = graph
        self.target = target
        self.numerics = numerics                 # kernels that depend on it carry it in their config()
        self.n_threads = n_threads
        self.plan = Plan(graph.dim_names)
        self.outputs = {id(n): name for name, n in reversed(list(graph.outputs.items()))}
        self.inlined: set[int] = set()           # element-wise nodes computed inside their user
        self.cache: dict[tuple, object] = {}     # shared helper results (quantized activations, ...)
        self.current: Node | None = None
        self.keep_values = False                 # set for observation: values stay readable

    def run(self) -> Plan:
        from llamir.backends.llvm.kernels.elementwise_lower import find_inlined

        for leaf in self.graph.leafs:
            buf = self.plan.leaf(leaf.name)
            self.plan.refs[id(leaf)] = self.plan.new_ref(buf, node_shape(leaf), leaf.dtype)
        self.inlined = set() if self.keep_values else find_inlined(self.graph)
        for node in self.graph.nodes:
            self.current = node
            if node.op.is_view:
                self.plan.refs[id(node)] = self.view(node)
                continue
            if id(node) in self.inlined:
                continue
            entry = LOWER.get(type(node.op))
            if entry is None or not entry[1](node, self.target):
                raise BackendError(f"llvm backend cannot lower {node.op.name} ({node.type}) {node.name or ''}")
            entry[0](self, node)
        self._outputs()
        self.plan.keep_values = self.keep_values
        self.plan.assign_stages()
        self.plan.plan_memory()
        return self.plan

    # -- values ------------------------------------------------------------------------------
    def ref(self, node: Node) -> Ref:
        return self.plan.refs[id(node)]

    def out(self, node: Node, shape: tuple[Expr, ...] | None = None) -> Ref:
        """A fresh contiguous buffer for `node`'s value (the caller's output array when the node
        is a graph output)."""
        if id(node) in self.plan.refs:
            return self.plan.refs[id(node)]
        shape = shape or node_shape(node)
        name = self.outputs.get(id(node))
        if name is not None:
            buf = Buffer("output", name)
            for out_name, n in self.graph.outputs.items():
                if n is node:
                    self.plan.outputs[out_name] = buf
        else:
            size = E.mul(E.prod(shape[:-1]), Ref(None, 0, shape, (), node.dtype).row_bytes())
            buf = self.plan.temp(size, node.name or node.op.name)
        ref = self.plan.new_ref(buf, shape, node.dtype)
        self.plan.refs[id(node)] = ref
        return ref

    def scratch(self, nbytes: Expr, label: str, per_thread: bool = False) -> Buffer:
        return self.plan.temp(nbytes, label, per_thread)

    def step(self, kernel: Kernel, ptrs: Sequence, reads: Sequence[Ref | Buffer], writes: Sequence[Ref | Buffer],
             part: Part | None = None, read_parts: Sequence[Part | None] = (), node: Node | None = None,
             barrier_if=None, barrier_args: Sequence = ()) -> Step:
        def buf(x):
            return x.buf if isinstance(x, Ref) else x

        kernel.numerics = self.numerics
        s = Step(kernel, list(ptrs), [buf(r) for r in reads], [buf(w) for w in writes], part,
                 [p for p in read_parts if p is not None], node if node is not None else self.current,
                 barrier_if=barrier_if, barrier_args=tuple(barrier_args))
        self.plan.steps.append(s)
        return s

    def site(self, what: str) -> Expr:
        node = self.current
        label = f"{what} in {node.op.name} {node.name or ''}".strip() if node is not None else what
        return self.plan.site(label)

    # -- views -----------------------------------------------------------------------------------
    def view(self, node: Node) -> Ref:
        src = self.ref(node.inputs[0])
        op = node.op
        shape = node_shape(node)
        if isinstance(op, ops.Reshape):
            if not src.is_contiguous:
                raise BackendError(f"reshape {node.name or ''}: input is not contiguous")
            return Ref(src.buf, src.offset, shape, contiguous_strides(shape, node.dtype), node.dtype)
        if isinstance(op, ops.Permute):
            return Ref(src.buf, src.offset, shape, tuple(src.strides[a] for a in op.axes), node.dtype)
        if isinstance(op, ops.Transpose):
            st = src.strides
            return Ref(src.buf, src.offset, shape, st[:-2] + (st[-1], st[-2]), node.dtype)
        if isinstance(op, ops.View):
            strides = tuple(E.from_dim(s) for s in op.strides)
            return Ref(src.buf, E.add(src.offset, E.from_dim(op.offset)), shape, strides, node.dtype)
        raise BackendError(f"unknown view op {op.name}")

    # -- outputs ---------------------------------------------------------------------------------
    def _outputs(self) -> None:
        """Outputs that are views of temporaries get a copy in an output buffer; outputs that live
        in a leaf's memory (a set_rows result, a view of the KV cache) are returned as views of
        that leaf's array, as the reference interpreter returns them."""
        from llamir.backends.llvm.kernels.elementwise_lower import copy_step

        for name, node in self.graph.outputs.items():
            if name in self.plan.outputs:
                continue
            src = self.ref(node)
            if src.buf.kind == "leaf":
                self.plan.leaf_views[name] = src
                continue
            buf = Buffer("output", name)
            self.plan.outputs[name] = buf
            dst = self.plan.new_ref(buf, node_shape(node), node.dtype)
            self.current = node
            copy_step(self, dst, src)


# Kernel modules register their lowerings on import.
from llamir.backends.llvm.kernels import (  # noqa: E402,F401
    attention_lower,
    elementwise_lower,
    gather_lower,
    matmul_lower,
    rope_lower,
    rows_lower,
    ssm_lower,
)
