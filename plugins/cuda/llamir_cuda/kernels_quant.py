"""mul_mat and mul_mat_id with block-quantized weights. This placeholder claims no node: the
module with the quantized kernels, written in parallel, replaces it at merge."""

from __future__ import annotations

from llamir.backends import BackendError


def supports(node) -> bool:
    """Whether a MulMat or MulMatId with a quantized src0 runs on CUDA: none yet."""
    return False


def lower(k, node, srcs, dst) -> None:
    """Unreachable while supports() claims nothing."""
    raise BackendError(f"cuda: no kernel for {node.op.name} with {node.inputs[0].dtype} weights")
