"""Lowerings of ssm_conv and ssm_scan: the inputs the kernels read as packed rows are copied to
contiguous memory first when they are not (ggml asserts they are; the copies only make other
layouts work, with the same bits)."""

from __future__ import annotations

from llamir.backends.llvm.kernels.elementwise_lower import copy_step
from llamir.backends.llvm.kernels.matmul_lower import contiguous_rows
from llamir.backends.llvm.kernels.ssm import SsmConv, SsmScan
from llamir.backends.llvm.lowering import Lowerer, lowering
from llamir.backends.llvm.plan import Ref
from llamir.ir import Node, ops


def _conv_ok(node: Node, target) -> bool:
    return isinstance(node.inputs[1].type.shape[1], int)     # the taps are unrolled


def contiguous(L: Lowerer, ref: Ref, label: str) -> Ref:
    """`ref`, or a contiguous copy of it."""
    if ref.is_contiguous:
        return ref
    out = L.plan.new_ref(L.scratch(ref.nbytes(), label), ref.shape, ref.dtype)
    copy_step(L, out, ref)
    return out


@lowering(ops.SsmConv, supports=_conv_ok)
def lower_ssm_conv(L: Lowerer, node: Node) -> None:
    sx = L.ref(node.inputs[0])
    c = contiguous(L, L.ref(node.inputs[1]), "ssm_conv_taps")
    y = L.out(node)
    L.step(SsmConv(y, sx, c), [y, sx, c], [sx, c], [y])


@lowering(ops.SsmScan)
def lower_ssm_scan(L: Lowerer, node: Node) -> None:
    s = contiguous(L, L.ref(node.inputs[0]), "ssm_states")
    x, dt, ids = (L.ref(node.inputs[i]) for i in (1, 2, 6))
    A, B, C = (contiguous_rows(L, L.ref(node.inputs[i]), f"ssm_{what}_rows") for i, what in ((3, "A"), (4, "B"),
                                                                                             (5, "C")))
    out = L.out(node)
    kernel = SsmScan(out, s, x, dt, A, B, C, ids, node.op.K, L.site("ssm_scan state id"))
    inputs = [s, x, dt, A, B, C, ids]
    L.step(kernel, [out, *inputs], inputs, [out])
