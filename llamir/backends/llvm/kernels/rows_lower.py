"""Lowerings of norms, softmax, reductions, scans and sorts onto the row kernels."""

from __future__ import annotations

from llamir.backends.llvm import expr as E
from llamir.backends.llvm.kernels.elementwise import row_part
from llamir.backends.llvm.kernels.rows import (
    GroupNorm,
    RowArgmax,
    RowCumsum,
    RowNorm,
    RowSum,
    SoftMax,
    Sort,
    TotalSum,
)
from llamir.backends.llvm.lowering import Lowerer, lowering
from llamir.backends.llvm.plan import Part, Ref
from llamir.ir import Node, ops
from llamir.ir.interp_nn import alibi_slopes


def _rows_part(ref: Ref, n_rows) -> Part | None:
    p = row_part(ref)
    return p if p is not None and p.n_units == n_rows else None


def _row_step(L: Lowerer, kernel, out: Ref, ins: list[Ref], extra_ptrs=(), node=None) -> None:
    n_rows = E.prod(out.shape[:-1]) if out.rank > 1 else 1
    part = _rows_part(out, n_rows)
    read_parts = [_rows_part(ins[0], n_rows)]
    L.step(kernel, [out, *ins, *extra_ptrs], ins, [out], part, read_parts, node)


def _float_in(node: Node, target) -> bool:
    return all(x.dtype.name in ("f32", "f16", "bf16") for x in node.inputs)


@lowering(ops.RmsNorm, ops.Norm, ops.L2Norm, ops.RmsNormMul, ops.NormMulAdd, supports=_float_in)
def lower_norm(L: Lowerer, node: Node) -> None:
    op = node.op
    kind = {ops.RmsNorm: "rms", ops.RmsNormMul: "rms", ops.Norm: "norm", ops.NormMulAdd: "norm",
            ops.L2Norm: "l2"}[type(op)]
    x = L.ref(node.inputs[0])
    w = L.ref(node.inputs[1]) if len(node.inputs) > 1 else None
    b = L.ref(node.inputs[2]) if len(node.inputs) > 2 else None
    out = L.out(node)
    mid = node.dtype.name if w is not None else "f32"
    kernel = RowNorm(kind, op.eps, out, x, w, b, mid)
    _row_step(L, kernel, out, [x] + [r for r in (w, b) if r is not None])


@lowering(ops.SoftMaxExt, supports=lambda n, t: n.inputs[0].dtype.name == "f32" and n.dtype.name == "f32")
def lower_soft_max(L: Lowerer, node: Node) -> None:
    op = node.op
    x = L.ref(node.inputs[0])
    rest = [L.ref(i) for i in node.inputs[1:]]
    mask = rest.pop(0) if op.mask else None
    sinks = rest.pop(0) if op.sinks else None
    alibi = None
    if op.max_bias > 0:
        heads = x.padded().shape[1]
        if not isinstance(heads, int):
            raise ValueError("ALiBi needs a static head count")
        alibi = tuple(float(v) for v in alibi_slopes(heads, op.max_bias))
    out = L.out(node)
    kernel = SoftMax(out, x, mask, sinks, op.scale, op.max_bias, alibi)
    ins = [x] + [r for r in (mask, sinks) if r is not None]
    _row_step(L, kernel, out, ins)


@lowering(ops.SumRows, ops.Mean, supports=_float_in)
def lower_row_sum(L: Lowerer, node: Node) -> None:
    x = L.ref(node.inputs[0])
    out = L.out(node)
    L.step(RowSum(out, x, isinstance(node.op, ops.Mean)), [out, x], [x], [out])


@lowering(ops.Sum, supports=_float_in)
def lower_sum(L: Lowerer, node: Node) -> None:
    x = L.ref(node.inputs[0])
    out = L.out(node)
    L.step(TotalSum(out, x), [out, x], [x], [out])


@lowering(ops.Argmax)
def lower_argmax(L: Lowerer, node: Node) -> None:
    """Each thread takes whole rows, as for the other row ops (ggml runs argmax on one thread;
    every row's index is the same either way)."""
    x = L.ref(node.inputs[0])
    out = L.out(node)
    n_rows = E.prod(x.shape[:-1]) if x.rank > 1 else 1
    part = Part(out.buf, out.offset, node.dtype.type_size, n_rows)
    L.step(RowArgmax(out, x), [out, x], [x], [out], part, [_rows_part(x, n_rows)])


@lowering(ops.Cumsum)
def lower_cumsum(L: Lowerer, node: Node) -> None:
    x = L.ref(node.inputs[0])
    out = L.out(node)
    _row_step(L, RowCumsum(out, x), out, [x])


@lowering(ops.Argsort, ops.TopK)
def lower_sort(L: Lowerer, node: Node) -> None:
    x = L.ref(node.inputs[0])
    out = L.out(node)
    n = x.shape[-1]
    scratch = L.scratch(E.mul(n, 8), "sort", per_thread=True)
    if isinstance(node.op, ops.Argsort):
        kernel = Sort(out, x, node.op.descending, None)
    else:
        kernel = Sort(out, x, True, node.op.k)
    L.step(kernel, [out, x, (scratch, 0)], [x], [out, scratch])


@lowering(ops.GroupNorm, supports=_float_in)
def lower_group_norm(L: Lowerer, node: Node) -> None:
    x = L.ref(node.inputs[0])
    out = L.out(node)
    L.step(GroupNorm(out, x, node.op.n_groups, node.op.eps), [out, x], [x], [out])
