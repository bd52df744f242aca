"""Lowering of flash_attn_ext (and of soft_max_attn, by decomposition before lowering)."""

from __future__ import annotations

from llamir.backends.llvm import expr as E
from llamir.backends.llvm.kernels.attention import FlashAttn, scratch_bytes
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
    kernel = FlashAttn(y, q, k, v, mask, sinks, op.scale, op.logit_softcap, alibi)
    ptrs = [y, q, k, v, (scratch, 0)] + [r for r in (mask, sinks) if r is not None]
    L.step(kernel, ptrs, [q, k, v] + [r for r in (mask, sinks) if r is not None], [y, scratch])
