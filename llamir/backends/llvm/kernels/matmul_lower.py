"""Lowering of mul_mat: activation preparation (rounding to the weight's vec_dot_type, shared by
every matmul that reads the same activations) then the matmul kernel for the weight's format."""

from __future__ import annotations

from llamir.backends.llvm import expr as E
from llamir.backends.llvm.kernels.elementwise import row_part
from llamir.backends.llvm.kernels.matmul_float import ACC_BYTES, RM, MatMulFloat, MatPrep
from llamir.backends.llvm.lowering import Lowerer, lowering
from llamir.backends.llvm.plan import Ref
from llamir.ir import Node, ops

FLOAT_WEIGHTS = ("f32", "f16", "bf16")


def contiguous_rows(L: Lowerer, ref: Ref, label: str) -> Ref:
    """`ref`, or a contiguous copy when its last axis is strided (kernels read rows as vectors)."""
    if ref.strides[-1] == ref.dtype.type_size:
        return ref
    from llamir.backends.llvm.kernels.elementwise_lower import copy_step

    buf = L.scratch(ref.nbytes(), label)
    out = L.plan.new_ref(buf, ref.shape, ref.dtype)
    copy_step(L, out, ref)
    return out


def prepared_b(L: Lowerer, node: Node, to: str, storage: str = "f32") -> Ref:
    """b rounded to `to`, contiguous, stored as f32 values (or bf16 bits: storage "bf16"); one per
    (activation, type, storage) in the split."""
    b_node = node.inputs[1]
    key = ("matprep", id(b_node), to, storage)
    hit = L.cache.get(key)
    if hit is not None:
        return hit
    b = L.ref(b_node)
    shape = b.shape
    from llamir.ir import BF16, F32

    size = E.mul(E.prod(shape), 2 if storage == "bf16" else 4)
    buf = L.scratch(size, f"{to}_act")
    out = L.plan.new_ref(buf, shape, BF16 if storage == "bf16" else F32)
    part = row_part(out)
    read = row_part(b) if b.is_contiguous and b.dtype.name == "f32" else None
    L.step(MatPrep(out, b, to), [out, b], [b], [out], part, [read])
    L.cache[key] = out
    return out


def lower_float_matmul(L: Lowerer, node: Node) -> None:
    a = contiguous_rows(L, L.ref(node.inputs[0]), "a_rows")
    b = L.ref(node.inputs[1])
    a_dtype = a.dtype.name
    b_dtype = "f32"
    if a_dtype == "f32" and b.dtype.name == "f32" and b.strides[-1] == 4:
        sgemm = b.is_contiguous
    else:   # with vdpbf16ps (the avx512 profile) b is kept as bf16 bits, as ggml's vec_dot_type
        b_dtype = "bf16" if a_dtype == "bf16" and L.numerics.bf16_dot else "f32"
        b = prepared_b(L, node, a_dtype, b_dtype)
        sgemm = True
    y = L.out(node)
    K = a.shape[-1]
    scratch = L.scratch(E.add(E.mul(K, RM * 4), ACC_BYTES), "a_tile", per_thread=True)   # widened rows, accumulators
    kernel = MatMulFloat(y, a, b, b_dtype, sgemm, a_is_weight=node.inputs[0].kind == "weight")
    L.step(kernel, [y, a, b, (scratch, 0)], [a, b], [y, scratch])


def _supported(node: Node, target) -> bool:
    a, b = node.inputs[0].dtype.name, node.inputs[1].dtype.name
    if b not in FLOAT_WEIGHTS:
        return False
    if a in FLOAT_WEIGHTS:
        return True
    from llamir.backends.llvm.kernels.matmul_quant_lower import quant_supported

    return quant_supported(node, target)


@lowering(ops.MulMat, supports=_supported)
def lower_mul_mat(L: Lowerer, node: Node) -> None:
    if node.inputs[0].dtype.name in FLOAT_WEIGHTS:
        lower_float_matmul(L, node)
        return
    from llamir.backends.llvm.kernels.matmul_quant_lower import lower_quant_matmul

    lower_quant_matmul(L, node)


def _mul_mat_id_ok(node: Node, target) -> bool:
    from llamir.backends.llvm.kernels.matmul_quant_lower import DIRECT_TYPES

    w, b = node.inputs[0], node.inputs[1]
    k = w.type.shape[-1]
    if b.dtype.name not in FLOAT_WEIGHTS or not isinstance(k, int):
        return False
    return w.dtype.name in ("f32", "f16") or (w.dtype.name in DIRECT_TYPES and k % 32 == 0)


@lowering(ops.MulMatId, supports=_mul_mat_id_ok)
def lower_mul_mat_id(L: Lowerer, node: Node) -> None:
    from llamir.backends.llvm.kernels.matmul_id import MatMulId
    from llamir.backends.llvm.kernels.matmul_quant_lower import quantized_activation
    from llamir.backends.llvm.kernels.quant_act import act_layout
    from llamir.backends.llvm.kernels.repack import weight_format
    from llamir.ir.repack_x86 import repack_type

    w = contiguous_rows(L, L.ref(node.inputs[0]), "experts")
    ids = L.ref(node.inputs[2])
    K = w.shape[-1]
    y = L.out(node)
    if w.dtype.name in FLOAT_WEIGHTS:
        b = prepared_b(L, node, w.dtype.name) if w.dtype.name != "f32" else _f32_rows(L, node)
        fmt, act, row = None, (b.buf, b.offset), E.mul(K, 4)
        b_ref = b
    else:
        fmt = weight_format(w.dtype.name, 8)
        buf, _ = quantized_activation(L, node.inputs[1], fmt, K)
        act, row, b_ref = (buf, 0), act_layout(fmt, K)[4], L.ref(node.inputs[1])
    experts = node.inputs[0]     # ggml repacks a 3-D expert weight (q4_0 here) for mul_mat_id
    n_expert, m_rows = experts.type.shape[0], experts.type.shape[-2]
    repacked = fmt is not None and experts.kind == "weight" and n_expert != 1 and isinstance(m_rows, int) \
        and repack_type(experts.dtype, m_rows, L.numerics) is not None
    kernel = MatMulId(y, w, b_ref, ids, L.site("mul_mat_id expert id"), fmt, row, K, repacked)
    L.step(kernel, [y, w, act, ids], [w, act[0], ids], [y])


def _f32_rows(L: Lowerer, node: Node) -> Ref:
    b = L.ref(node.inputs[1])
    return b if b.is_contiguous else prepared_b(L, node, "f32")
