"""Fusion passes: rewrite op chains into the fused ops of ir/ops/fused.py.

Each pattern fires only when the inner values have no other use (and are not outputs), so a
fusion never duplicates work; the fused op's reference kernel is the composition it replaces,
so the numpy interpreter gives identical results before and after.
"""

from __future__ import annotations

from llamir.ir import Node, ops
from llamir.ir.ops.elementwise import can_repeat
from llamir.passes.base import PatternPass, RewritePattern, Rewriter, register_pass


def _inner(node: Node, *classes: type[ops.Op]) -> bool:
    """`node` is one of `classes` and only its one user reads it."""
    return node.is_op(*classes) and node.has_one_use()


class RmsNormTimesWeight(RewritePattern):
    """mul(rms_norm(x), w) -> rms_norm_mul(x, w)  when w tiles x and the norm has one use."""

    root = ops.Mul

    def match_and_rewrite(self, node: Node, rw: Rewriter) -> bool:
        norm, w = node.inputs
        if not (_inner(norm, ops.RmsNorm) and can_repeat(w.type, norm.type)):
            return False
        rw.replace(node, ops.RmsNormMul(eps=norm.op.eps), norm.inputs[0], w)
        return True


class NormTimesWeight(RewritePattern):
    """mul(norm(x), w) -> norm_mul_add(x, w, bias=false)  when w tiles x and the norm has one use."""

    root = ops.Mul

    def match_and_rewrite(self, node: Node, rw: Rewriter) -> bool:
        norm, w = node.inputs
        if not (_inner(norm, ops.Norm) and can_repeat(w.type, norm.type)):
            return False
        rw.replace(node, ops.NormMulAdd(eps=norm.op.eps, bias=False), norm.inputs[0], w)
        return True


class NormPlusBias(RewritePattern):
    """add(norm_mul_add(x, w, bias=false), b) -> norm_mul_add(x, w, b)  when b tiles x."""

    root = ops.Add

    def match_and_rewrite(self, node: Node, rw: Rewriter) -> bool:
        inner, b = node.inputs
        if not (_inner(inner, ops.NormMulAdd) and not inner.op.bias and can_repeat(b.type, inner.type)):
            return False
        x, w = inner.inputs
        rw.replace(node, ops.NormMulAdd(eps=inner.op.eps, bias=True), x, w, b)
        return True


class SoftMaxAttention(RewritePattern):
    """mul_mat(v, soft_max_ext(mul_mat(k, q), mask..)) -> soft_max_attn(q, k, v, mask..)
    when the scores and the probabilities have no other use."""

    root = ops.MulMat

    def match_and_rewrite(self, node: Node, rw: Rewriter) -> bool:
        v, probs = node.inputs
        if not _inner(probs, ops.SoftMaxExt):
            return False
        scores = probs.inputs[0]
        if not (_inner(scores, ops.MulMat) and scores.type.rank == 4 and v.type.rank == 4):
            return False
        k, q = scores.inputs
        if q.type.rank != 4 or k.type.rank != 4:
            return False
        sm = probs.op
        fused = ops.SoftMaxAttn(scale=sm.scale, max_bias=sm.max_bias, mask=sm.mask, sinks=sm.sinks)
        rw.replace(node, fused, q, k, v, *probs.inputs[1:])
        return True


@register_pass
class FuseRmsNorm(PatternPass):
    """rms_norm followed by a weight multiply becomes rms_norm_mul."""

    name = "fuse-rms-norm"
    patterns = (RmsNormTimesWeight,)


@register_pass
class FuseNorm(PatternPass):
    """norm * w (+ b) becomes norm_mul_add (a layer norm in one op)."""

    name = "fuse-norm"
    patterns = (NormTimesWeight, NormPlusBias)


@register_pass
class FuseSoftMaxAttention(PatternPass):
    """kq = k q^T, softmax, kqv = v kq become one soft_max_attn op."""

    name = "fuse-attention"
    patterns = (SoftMaxAttention,)


@register_pass
class FuseAll(PatternPass):
    """Every fusion of this module, greedily."""

    name = "fuse"
    patterns = (RmsNormTimesWeight, NormTimesWeight, NormPlusBias, SoftMaxAttention)
