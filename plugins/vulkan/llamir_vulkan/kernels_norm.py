"""Norm and reduction kernels: rms_norm, norm, l2_norm, group_norm, the fused rms_norm_mul and
norm_mul_add, sum_rows, mean, sum, argsort and top_k. Each reduces one row (or channel group)
per workgroup in shared memory."""

from __future__ import annotations

from llamir.ir import ops
from llamir_vulkan.kernels_elementwise import FLOATS, storage, tensor
from llamir_vulkan.lowering import Params, groups_for, kernel

WG = 256
NORM_OP = {ops.RmsNorm: 0, ops.Norm: 1, ops.L2Norm: 2, ops.GroupNorm: 1, ops.RmsNormMul: 0, ops.NormMulAdd: 1}
# argsort's shared memory: a float value and a uint index per slot, in 32 KiB
MAX_SORT = 4096


def _floats(node) -> bool:
    return all(v.dtype.name in FLOATS for v in (*node.inputs, node))


def _norm(k, node, srcs, dst, weights: int = 0, group: int = 0) -> None:
    """One workgroup per row of x (or channel group, `group` channels each): shaders/norm.comp."""
    x = node.inputs[0]
    defines = {"OP": NORM_OP[type(node.op)], **storage("A", x.dtype), **storage("D", node.dtype), "WG": WG}
    tensors = [tensor(x, srcs[0]), tensor(node, dst, True)]
    if weights:
        w = node.inputs[1]
        defines.update(storage("W", w.dtype), MUL=1)
        tensors += [tensor(w, srcs[1])]
    if weights > 1:
        defines["ADD"] = 1
        tensors += [tensor(node.inputs[2], srcs[2])]
    shape = [int(d) for d in x.type.shape]
    if group:
        defines["GROUP"] = 1
        channels = shape[-3]
        n = -(-channels // group) * (shape[-4] if len(shape) == 4 else 1)
    else:
        n = x.type.numel // max(shape[-1], 1)
    k.dispatch("norm", defines, tensors, Params().f32(node.op.eps).u32(group), groups_for(n), node.name)


@kernel(ops.RmsNorm, ops.Norm, ops.L2Norm, supports=_floats)
def row_norm(k, node, srcs, dst) -> None:
    """ggml's rms_norm (x / sqrt(mean(x^2) + eps)), norm ((x - mean) / sqrt(var + eps)) and
    l2_norm (x / max(|x|, eps)) over each row."""
    _norm(k, node, srcs, dst)


@kernel(ops.GroupNorm, supports=_floats)
def group_norm(k, node, srcs, dst) -> None:
    """ggml_group_norm: x [N, C, L, W] normalised over each group of ceil(C / n_groups) channels
    (their L * W values together), one workgroup per group and batch."""
    channels = int(node.inputs[0].type.shape[-3])
    _norm(k, node, srcs, dst, group=-(-channels // node.op.n_groups))


@kernel(ops.RmsNormMul, supports=_floats)
def rms_norm_mul(k, node, srcs, dst) -> None:
    """The fused rms_norm(x) * w (w tiled to x's shape), as ggml-vulkan fuses rms_norm and mul."""
    _norm(k, node, srcs, dst, weights=1)


@kernel(ops.NormMulAdd, supports=lambda node: _floats(node) and len({i.dtype for i in node.inputs[1:]}) == 1)
def norm_mul_add(k, node, srcs, dst) -> None:
    """The fused layer norm: norm(x) * w (+ b), w and b tiled to x's shape."""
    _norm(k, node, srcs, dst, weights=1 + int(node.op.bias))


@kernel(ops.SumRows, ops.Mean, ops.Sum, supports=_floats)
def sum_rows(k, node, srcs, dst) -> None:
    """ggml's sum_rows and mean (one workgroup per row) and sum (one workgroup over all of x)."""
    (x,) = node.inputs
    defines = {**storage("A", x.dtype), **storage("D", node.dtype), "WG": WG}
    if node.is_op(ops.Mean):
        defines["MEAN"] = 1
    if node.is_op(ops.Sum):
        defines["ALL"] = 1
        n = 1
    else:
        n = x.type.numel // max(int(x.type.shape[-1]), 1)
    k.dispatch("sum_rows", defines, [tensor(x, srcs[0]), tensor(node, dst, True)], None, groups_for(n),
               node.name)


def _sortable(node) -> bool:
    n = node.inputs[0].type.shape[-1]
    return isinstance(n, int) and 1 <= n <= MAX_SORT


@kernel(ops.Argsort, ops.TopK, supports=_sortable)
def argsort(k, node, srcs, dst) -> None:
    """ggml's argsort (ascending or descending, stable) and top_k (the indices of the k largest,
    largest first, ties by index): a bitonic sort of each row in shared memory, padded to a power
    of two, one workgroup per row; top_k writes the first k."""
    (x,) = node.inputs
    n = int(x.type.shape[-1])
    npad = 1 << max(n - 1, 1).bit_length()
    defines = {"NPAD": npad, "WG": min(npad, 512)}
    if node.is_op(ops.TopK) or node.op.descending:
        defines["DESCENDING"] = 1
    k.dispatch("argsort", defines, [tensor(x, srcs[0]), tensor(node, dst, True)], None,
               groups_for(x.type.numel // n), node.name)
