"""Lowerings of get_rows and set_rows."""

from __future__ import annotations

from llamir.backends.llvm.kernels.gather import GetRows, SetRows
from llamir.backends.llvm.kernels.quant import DEQUANT_TYPES, QUANTIZE_TYPES
from llamir.backends.llvm.lowering import Lowerer, lowering
from llamir.ir import Node, ops

_PLAIN = ("f32", "f16", "bf16")


def _get_rows_ok(node: Node, target) -> bool:
    a = node.inputs[0].dtype.name
    return a in _PLAIN or a == "i32" or a in DEQUANT_TYPES


@lowering(ops.GetRows, supports=_get_rows_ok)
def lower_get_rows(L: Lowerer, node: Node) -> None:
    a, idx = (L.ref(x) for x in node.inputs)
    out = L.out(node)
    kernel = GetRows(out, a, idx, L.site("get_rows index"))
    L.step(kernel, [out, a, idx], [a, idx], [out])


def _set_rows_ok(node: Node, target) -> bool:
    dst, src = node.dtype.name, node.inputs[1].dtype.name
    return src in _PLAIN and (dst in _PLAIN or dst in QUANTIZE_TYPES)


@lowering(ops.SetRows, supports=_set_rows_ok)
def lower_set_rows(L: Lowerer, node: Node) -> None:
    dst, src, idx = (L.ref(x) for x in node.inputs)
    L.plan.refs[id(node)] = dst
    kernel = SetRows(dst, src, idx, L.site("set_rows index"))
    L.step(kernel, [dst, src, idx], [src, idx], [dst])
