"""Lowering of flash_attn_ext (and of soft_max_attn, by decomposition before lowering)."""

from __future__ import annotations

from llamir.backends.llvm import expr as E
from llamir.backends.llvm.kernels.attention import FlashAttn, FlashAttnReduce, scratch_bytes, split_kv
from llamir.backends.llvm.kernels.matmul_lower import contiguous_rows
from llamir.backends.llvm.lowering import Lowerer, lowering
from llamir.ir import Node, ops
from llamir.ir.interp_nn import alibi_slopes

KV_TYPES = ("f32", "f16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")


def _fa_ok(node: Node, target) -> bool:
    k, v = node.inputs[1], node.inputs[2]
    if k.dtype.name not in KV_TYPES or v.dtype.name not in KV_TYPES:
        return False
    return all(isinstance(x.type.shape[-1], int) for x in (k, v))


@lowering(ops.FlashAttnExt, supports=_fa_ok)
def lower_flash_attn(L: Lowerer, node: Node) -> None:
    op = node.op
    q = contiguous_rows(L, L.ref(node.inputs[0]), "q_rows")
    k = contiguous_rows(L, L.ref(node.inputs[1]), "k_rows")
    v = contiguous_rows(L, L.ref(node.inputs[2]), "v_rows")
    rest = [L.ref(x) for x in node.inputs[3:]]
    mask = rest.pop(0) if op.mask else None
    sinks = rest.pop(0) if op.sinks else None
    alibi = None
    if op.max_bias > 0:
        heads = q.shape[1]
        if not isinstance(heads, int):
            raise ValueError("ALiBi needs a static head count")
        alibi = tuple(float(x) for x in alibi_slopes(heads, op.max_bias))
    y = L.out(node)
    rows_bytes, tiled_bytes = scratch_bytes(q.shape[1], q.shape[3], v.shape[3])
    scratch = L.scratch(E.max_(rows_bytes, tiled_bytes), "fa_scratch", per_thread=True)
    scores = _quantized_scores(L, node, k) if k.dtype.is_quantized else None
    split = k.dtype == v.dtype and k.dtype.name in ("f16", "f32")
    partials = None
    if split:   # one (M, S, VKQ) per thread and head for a split-KV decode
        partials = L.scratch(E.mul(E.var(E.NTH), E.mul(q.shape[1], E.mul(E.add(v.shape[3], 2), 4))), "fa_partials")
    extra = [r for r in (mask, sinks, scores) if r is not None]
    kernel = FlashAttn(y, q, k, v, mask, sinks, scores, split, op.scale, op.logit_softcap, alibi)
    ptrs = [y, q, k, v, (scratch, 0)] + extra + ([(partials, 0)] if split else [])
    L.step(kernel, ptrs, [q, k, v] + extra, [y, scratch] + ([partials] if split else []))
    if split:   # its barrier only when this batch did split (one row over 512+ cells)
        S, _, T, _ = q.shape
        L.step(FlashAttnReduce(y, q, k), [y, (partials, 0)], [partials], [y],
               barrier_if=lambda em, a: split_kv(em, {"S": a[0], "T": a[1], "n_kv": a[2]}),
               barrier_args=(S, T, k.shape[2]))


def _quantized_scores(L: Lowerer, node: Node, k) -> object:
    """[S, H, T, n] f32 raw scores of a quantized K: ggml's kq_vec_dot quantizes q to K's
    vec_dot_type and dots block by block, which is the quantized mul_mat of k and q."""
    from llamir.backends.llvm.kernels.matmul_quant import MatMulQDirect
    from llamir.backends.llvm.kernels.matmul_quant_lower import quantized_activation
    from llamir.backends.llvm.kernels.repack import weight_format
    from llamir.ir import F32

    q_node = node.inputs[0]
    S, H, T, DK = L.ref(q_node).shape
    shape = (S, H, T, k.shape[2])
    buf = L.scratch(E.mul(E.prod(shape), 4), "fa_scores")
    scores = L.plan.new_ref(buf, shape, F32)
    fmt = weight_format(k.dtype.name, 8)
    act, n_rows = quantized_activation(L, q_node, fmt, DK)
    L.step(MatMulQDirect(fmt, DK, scores, k, n_rows), [scores, k, (act, 0)], [k, act], [scores])
    return scores
