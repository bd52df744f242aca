"""Cost model of a device for split plans: a roofline per op and a link per copy.

Estimates only (tests never assert times): an op takes max(flops / throughput, bytes / bandwidth),
a copy takes latency + bytes / link bandwidth. Shapes must be concrete (a bound graph).
"""

from __future__ import annotations

import math

from llamir.backends.base import CostModel
from llamir.ir import Node, ops


def op_seconds(model: CostModel, node: Node) -> float:
    """The roofline time of one node on a device: max(flops / throughput, bytes / bandwidth)."""
    return max(op_flops(node) / (model.tflops * 1e12), op_bytes(node) / (model.mem_gbps * 1e9))


def copy_seconds(model: CostModel, nbytes: int) -> float:
    """One copy over a device's host link: latency + bytes / bandwidth."""
    return model.latency_us * 1e-6 + nbytes / (model.link_gbps * 1e9)


# The host CPU when a backend has no cost model of its own: a few cores of SIMD, DDR5.
CPU_COST = CostModel(tflops=1.0, mem_gbps=80.0, link_gbps=80.0, latency_us=1.0)


def _numel(node: Node) -> int:
    return int(math.prod(int(d) for d in node.type.shape))


def _nbytes(node: Node) -> int:
    return int(node.type.nbytes)


def op_flops(node: Node) -> float:
    """Floating-point operations of one node (2*M*N*K for products, a few per element otherwise)."""
    if node.is_leaf or node.op.is_view:
        return 0.0
    if node.is_op(ops.MulMat):
        return 2.0 * _numel(node) * int(node.inputs[0].type.shape[-1])
    if node.is_op(ops.MulMatId):
        return 2.0 * _numel(node) * int(node.inputs[0].type.shape[-1])
    if node.is_op(ops.FlashAttnExt):
        q, k = node.inputs[0].type.shape, node.inputs[1].type.shape
        return 4.0 * int(math.prod(int(d) for d in q)) * int(k[-2])
    if node.is_op(ops.SoftMaxExt, ops.RopeExt, ops.RmsNorm, ops.Norm):
        return 5.0 * _numel(node)
    return float(_numel(node))


def op_bytes(node: Node) -> int:
    """Bytes an op reads and writes (views move nothing)."""
    if node.is_leaf or node.op.is_view:
        return 0
    return _nbytes(node) + sum(_nbytes(x) for x in node.inputs)
