"""Where a value's bytes are, as ggml lays tensors out: byte strides (ggml's nb, in numpy
order), a view's byte offset from the tensor it views (view_offs), ggml_nbytes, and the storage
form of a value (quantized rows are bytes). The scheduler allocates by these, and a device
backend computes its views' addresses by them.
"""

from __future__ import annotations

from llamir.ir import ops
from llamir.ir.graph import Node
from llamir.ir.interp import storage_dtype, storage_shape


def value_strides(value: Node, cache: dict[int, tuple[int, ...]]) -> tuple[int, ...]:
    """Byte strides (numpy order) of a value in a concrete graph; views share their source."""
    hit = cache.get(id(value))
    if hit is not None:
        return hit
    op = value.op
    if value.is_leaf or not (op.is_view or op.has_side_effects):
        strides = tuple(int(s) for s in value.type.contiguous_strides())
    elif isinstance(op, ops.View):
        strides = tuple(int(s) for s in op.strides)
    elif isinstance(op, ops.Permute):
        src = value_strides(value.inputs[0], cache)
        strides = tuple(src[a] for a in op.axes)
    elif isinstance(op, ops.Transpose):
        src = value_strides(value.inputs[0], cache)
        strides = src[:-2] + (src[-1], src[-2])
    elif op.has_side_effects:
        strides = value_strides(value.inputs[0], cache)
    else:  # reshape of a contiguous value
        strides = tuple(int(s) for s in value.type.contiguous_strides())
    cache[id(value)] = strides
    return strides


def storage_strides(value: Node, strides: tuple[int, ...]) -> tuple[int, ...]:
    """Byte strides of a value's storage array: its strides, but a quantized row's bytes are
    read one by one (the row axis steps by a byte, not a block)."""
    return tuple(strides[:-1]) + (1,) if value.dtype.is_quantized else tuple(strides)


def view_offset(value: Node) -> int:
    """The byte offset of a view-like value's first element from its root's."""
    if value.is_leaf or not is_view_like(value):
        return 0
    own = int(value.op.offset) if isinstance(value.op, ops.View) else 0
    return own + view_offset(value.inputs[0])


def ggml_nbytes(value: Node, strides: tuple[int, ...]) -> int:
    """ggml_nbytes: the byte extent of a (possibly strided) tensor."""
    shape = [int(d) for d in value.type.shape]
    if any(n <= 0 for n in shape):
        return 0
    dtype = value.dtype
    if dtype.block_size == 1:
        return dtype.type_size + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
    inner = shape[-1] * strides[-1] // dtype.block_size
    return inner + sum((n - 1) * s for n, s in zip(shape[:-1], strides[:-1], strict=True))


def is_view_like(value: Node) -> bool:
    """ggml's view_src != NULL: view ops, and set_rows (its result is its destination)."""
    return not value.is_leaf and (value.op.is_view or value.op.has_side_effects)


def view_root(value: Node) -> Node:
    while is_view_like(value):
        value = value.inputs[0]
    return value


__all__ = ["ggml_nbytes", "is_view_like", "storage_dtype", "storage_shape", "storage_strides", "value_strides",
           "view_offset", "view_root"]
