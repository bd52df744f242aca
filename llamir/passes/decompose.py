"""Decomposition: fused ops a backend does not run, rewritten into the ops they fuse.

One pass driven by the backend's support table (llamir.backends.support): each fused node the
table does not claim is expanded into its parts, which the table must claim. The fused op's
reference kernel is the composition it stands for, so results are unchanged.

    DecomposeUnsupported(table.claims).run(graph)   # before lowering a split
    run_pipeline(graph, "decompose")                # every fused op expanded
"""

from __future__ import annotations

from collections.abc import Callable

from llamir.ir import Node, ops
from llamir.passes.base import GraphPass, RewritePattern, Rewriter, apply_patterns, register_pass


class ExpandRmsNormMul(RewritePattern):
    """rms_norm_mul(x, w) -> mul(rms_norm(x), w)."""

    root = ops.RmsNormMul

    def match_and_rewrite(self, node: Node, rw: Rewriter) -> bool:
        x, w = node.inputs
        norm = rw.create(ops.RmsNorm(eps=node.op.eps), (x,), before=node)
        rw.replace(node, ops.Mul(), norm, w)
        return True


class ExpandNormMulAdd(RewritePattern):
    """norm_mul_add(x, w[, b]) -> add(mul(norm(x), w), b)."""

    root = ops.NormMulAdd

    def match_and_rewrite(self, node: Node, rw: Rewriter) -> bool:
        x, w = node.inputs[:2]
        norm = rw.create(ops.Norm(eps=node.op.eps), (x,), before=node)
        if not node.op.bias:
            rw.replace(node, ops.Mul(), norm, w)
            return True
        scaled = rw.create(ops.Mul(), (norm, w), before=node)
        rw.replace(node, ops.Add(), scaled, node.inputs[2])
        return True


class ExpandSoftMaxAttention(RewritePattern):
    """soft_max_attn(q, k, v, mask..) -> mul_mat(v, soft_max_ext(mul_mat(k, q), mask..))."""

    root = ops.SoftMaxAttn

    def match_and_rewrite(self, node: Node, rw: Rewriter) -> bool:
        q, k, v = node.inputs[:3]
        kq = rw.create(ops.MulMat(), (k, q), before=node)
        probs = rw.create(node.op.softmax_op(), (kq, *node.inputs[3:]), before=node)
        rw.replace(node, ops.MulMat(), v, probs)
        return True


# Each fused op: the pattern that expands it and the op classes it expands into.
DECOMPOSITIONS: dict[type[ops.Op], tuple[type[RewritePattern], tuple[type[ops.Op], ...]]] = {
    ops.RmsNormMul: (ExpandRmsNormMul, (ops.RmsNorm, ops.Mul)),
    ops.NormMulAdd: (ExpandNormMulAdd, (ops.Norm, ops.Mul, ops.Add)),
    ops.SoftMaxAttn: (ExpandSoftMaxAttention, (ops.MulMat, ops.SoftMaxExt)),
}


def parts_of(op_class: type[ops.Op]) -> tuple[type[ops.Op], ...] | None:
    """The op classes a fused op expands into, or None for an op that is not fused."""
    entry = DECOMPOSITIONS.get(op_class)
    return entry[1] if entry is not None else None


class _Unclaimed(RewritePattern):
    """Wraps an expansion so that it fires only on nodes the backend does not claim."""

    def __init__(self, pattern: RewritePattern, claims: Callable[[Node], bool]):
        self.pattern, self.claims = pattern, claims
        self.root = pattern.root

    def match_and_rewrite(self, node: Node, rw: Rewriter) -> bool:
        return not self.claims(node) and self.pattern.match_and_rewrite(node, rw)


@register_pass
class DecomposeUnsupported(GraphPass):
    """Fused ops that `claims` (a backend's support table) does not claim become their parts;
    with no table, every fused op is expanded."""

    name = "decompose"

    def __init__(self, claims: Callable[[Node], bool] | None = None):
        self.claims = claims if claims is not None else (lambda node: False)

    def run(self, graph) -> bool:
        return apply_patterns(graph, [_Unclaimed(pattern(), self.claims) for pattern, _ in DECOMPOSITIONS.values()])


def decompose(graph, claims: Callable[[Node], bool]) -> bool:
    """Run the pass on `graph` in place; True if any node was expanded."""
    return DecomposeUnsupported(claims).run(graph)


__all__ = ["DECOMPOSITIONS", "DecomposeUnsupported", "decompose", "parts_of"]
