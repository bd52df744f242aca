"""Lowering of mul_mat with quantized weights: packed weights + shared quantized activations."""

from __future__ import annotations

from llamir.backends.llvm import expr as E
from llamir.backends.llvm.kernels.elementwise import row_part
from llamir.backends.llvm.kernels.matmul_quant import MatMulQ
from llamir.backends.llvm.kernels.quant_act import QuantAct, act_layout
from llamir.backends.llvm.kernels.repack import QFormat, weight_format
from llamir.backends.llvm.kernels.repack_k import K_FORMATS, KFormat
from llamir.backends.llvm.lowering import Lowerer
from llamir.backends.llvm.plan import Buffer, Part
from llamir.ir import Node


def _packable(node: Node, target) -> QFormat | KFormat | None:
    """The packed format of a 2-D weight (what ggml would offer CPU_REPACK) for `target`, or None."""
    a = node.inputs[0]
    if a.kind != "weight" or not a.type.is_concrete or any(d != 1 for d in a.type.shape[:-2]):
        return None
    m_rows, k = a.type.shape[-2], a.type.shape[-1]
    if a.dtype.name in K_FORMATS:
        return K_FORMATS[a.dtype.name] if k % 256 == 0 else None
    fmt = weight_format(a.dtype.name, m_rows, vnni=target.vnni)
    if fmt is None or k % 32:
        return None
    return fmt


DIRECT_TYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")


def quant_supported(node: Node, target) -> bool:
    if _packable(node, target) is not None:
        return True
    a = node.inputs[0]
    k = a.type.shape[-1]
    return a.dtype.name in DIRECT_TYPES and isinstance(k, int) and k % 32 == 0


def quantized_activation(L: Lowerer, b_node: Node, fmt: QFormat, K: int):
    key = ("qact", id(b_node), fmt.vdt, fmt.bs, fmt.corr, fmt.offset)
    hit = L.cache.get(key)
    if hit is not None:
        return hit
    b = L.ref(b_node)
    n_rows = E.prod(b.shape[:-1]) if b.rank > 1 else 1
    _, _, _, _, row_bytes = act_layout(fmt, K)
    buf = L.scratch(E.mul(n_rows, row_bytes), f"{fmt.vdt}_act")
    part = Part(buf, 0, row_bytes, n_rows)
    read = row_part(b) if b.is_contiguous else None
    read = read if read is not None and read.n_units == n_rows else None
    L.step(QuantAct((buf, 0), b, fmt, K), [(buf, 0), b], [b], [buf], part, [read])
    L.cache[key] = (buf, n_rows)
    return buf, n_rows


def quantized_activation_k(L: Lowerer, b_node: Node, K: int):
    """b's rows as Q8_K for the K-quant kernels (one buffer shared by every K-quant matmul of b)."""
    from llamir.backends.llvm.kernels.quant_act import KActLayout, QuantActK

    key = ("qact", id(b_node), "q8_k:ggml")
    hit = L.cache.get(key)
    if hit is not None:
        return hit
    b = L.ref(b_node)
    n_rows = E.prod(b.shape[:-1]) if b.rank > 1 else 1
    row_bytes = KActLayout(K).row_bytes
    buf = L.scratch(E.mul(n_rows, row_bytes), "q8_k_act")
    read = row_part(b) if b.is_contiguous else None
    read = read if read is not None and read.n_units == n_rows else None
    L.step(QuantActK((buf, 0), b, K), [(buf, 0), b], [b], [buf], Part(buf, 0, row_bytes, n_rows), [read])
    L.cache[key] = (buf, n_rows)
    return buf, n_rows


def packed_buffer(L: Lowerer, leaf: Node, fmt: QFormat | KFormat) -> Buffer:
    name = f"{leaf.name}|{fmt.name}"
    buf = L.plan.packed.get(name)
    if buf is None:
        buf = L.plan.packed[name] = Buffer("packed", name)
        buf.source = (leaf.name, fmt)
    return buf


def lower_quant_matmul(L: Lowerer, node: Node) -> None:
    fmt = _packable(node, L.target)
    if fmt is None:
        _lower_direct(L, node)
        return
    a = node.inputs[0]
    m_rows, K = a.type.shape[-2], a.type.shape[-1]
    packed = packed_buffer(L, a, fmt)
    y = L.out(node)
    if isinstance(fmt, KFormat):
        from llamir.backends.llvm.kernels.matmul_quant_k import MatMulQK
        from llamir.ir.repack_x86 import repack_type

        act, _ = quantized_activation_k(L, node.inputs[1], K)
        shape = L.ref(node.inputs[1]).shape
        planes = E.prod(shape[:-2]) if len(shape) > 2 else 1
        rows = shape[-2] if len(shape) > 1 else 1
        repacked = repack_type(a.dtype, m_rows, L.numerics) is not None
        kernel = MatMulQK(fmt, K, planes, rows, m_rows, repacked)
        ptrs, writes = [y, (packed, 0), (act, 0)], [y]
        if kernel.scratch_bytes:
            unpacked = L.scratch(kernel.scratch_bytes, "qk_unpacked", per_thread=True)
            ptrs, writes = ptrs + [(unpacked, 0)], writes + [unpacked]
        L.step(kernel, ptrs, [packed, act], writes)
        return
    act, n_rows = quantized_activation(L, node.inputs[1], fmt, K)
    L.step(MatMulQ(fmt, K, n_rows, m_rows), [y, (packed, 0), (act, 0)], [packed, act], [y])


def _lower_direct(L: Lowerer, node: Node) -> None:
    """A quantized `a` that is not a packable weight (a KV cache view, a batched tensor)."""
    from llamir.backends.llvm.kernels.matmul_lower import contiguous_rows
    from llamir.backends.llvm.kernels.matmul_quant import MatMulQDirect

    a_node = node.inputs[0]
    a = L.ref(a_node)
    if a.strides[-1] != a.dtype.type_size:
        a = contiguous_rows(L, a, "a_rows")
    K = a.shape[-1]
    fmt = weight_format(a.dtype.name, 8)          # the activation side of the exact formats
    act, n_rows = quantized_activation(L, node.inputs[1], fmt, K)
    y = L.out(node)
    L.step(MatMulQDirect(fmt, K, y, a, n_rows), [y, a, (act, 0)], [a, act], [y])
