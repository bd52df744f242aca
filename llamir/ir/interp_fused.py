"""Reference kernels of the fused ops (ir/ops/fused.py): each runs the composition it replaces
through the unfused reference kernels, so a fusion never changes a result."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llamir.ir import ops
from llamir.ir.interp_kernels import KERNELS, kernel
from llamir.ir.types import TensorType


@dataclass
class _Value:
    """The parts of a Node a reference kernel reads: op, input dtypes/kinds, type."""

    op: object
    inputs: tuple
    type: TensorType
    kind: str = "node"

    @property
    def dtype(self):
        return self.type.dtype


def _run(ctx, op, inputs: tuple, args: list, bindings) -> tuple[np.ndarray, _Value]:
    value = _Value(op, inputs, op.check_and_infer(tuple(x.type for x in inputs)))
    out = np.ascontiguousarray(KERNELS[type(op)](ctx, value, args, bindings))
    return out, value


@kernel(ops.RmsNormMul)
def _rms_norm_mul(ctx, node, args, bindings):
    x, w = node.inputs
    normed, v = _run(ctx, ops.RmsNorm(eps=node.op.eps), (x,), [args[0]], bindings)
    return _run(ctx, ops.Mul(), (v, w), [normed, args[1]], bindings)[0]


@kernel(ops.NormMulAdd)
def _norm_mul_add(ctx, node, args, bindings):
    x, w = node.inputs[:2]
    y, v = _run(ctx, ops.Norm(eps=node.op.eps), (x,), [args[0]], bindings)
    y, v = _run(ctx, ops.Mul(), (v, w), [y, args[1]], bindings)
    if node.op.bias:
        y, v = _run(ctx, ops.Add(), (v, node.inputs[2]), [y, args[2]], bindings)
    return y


@kernel(ops.SoftMaxAttn)
def _soft_max_attn(ctx, node, args, bindings):
    q, k, v = node.inputs[:3]
    kq, kq_v = _run(ctx, ops.MulMat(), (k, q), [args[1], args[0]], bindings)
    probs, probs_v = _run(ctx, node.op.softmax_op(), (kq_v, *node.inputs[3:]), [kq, *args[3:]], bindings)
    return _run(ctx, ops.MulMat(), (v, probs_v), [args[2], probs], bindings)[0]
