"""Element-wise and layout kernels: binary ops with repeat, unary ops, scale, clamp, fill, glu,
cpy/cont (between f32, f16, bf16 and i32, from those float types to the block types and back,
and same-type copies of any type), concat, repeat, and set_rows (the KV-cache write)."""

from __future__ import annotations

from llamir.ir import ops
from llamir_vulkan.lowering import Params, groups_for, kernel

WG = 256
BINARY = {ops.Add: 0, ops.Sub: 1, ops.Mul: 2, ops.Div: 3}
UNARY = tuple(cls for cls in vars(ops).values() if isinstance(cls, type) and issubclass(cls, ops.Unary)
              and cls is not ops.Unary)
GLU = tuple(cls for cls in vars(ops).values() if isinstance(cls, type) and issubclass(cls, ops.Glu)
            and cls is not ops.Glu)

# a storage type -> (its GLSL buffer element, storage -> float, float -> storage): shaders/cpy_types.glsl
STORAGE = {
    "f32": ("float", "float", "float"),
    "f16": ("float16_t", "float", "float16_t"),
    "bf16": ("uint16_t", "bf16_to_f32", "f32_to_bf16"),
    "i32": ("int", "float", "int"),
}
FLOATS = ("f32", "f16", "bf16")
# the block types shaders/quantize.glsl encodes and shaders/dequant.glsl decodes
QUANTS = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k")


def storage(role: str, dtype) -> dict:
    """The defines naming tensor `role`'s storage in a shader: ROLE_TYPE, LOAD_ROLE, STORE_ROLE."""
    glsl, load, store = STORAGE[dtype.name]
    return {f"{role}_TYPE": glsl, f"LOAD_{role}": load, f"STORE_{role}": store}


def tensor(value, td, written: bool = False) -> tuple:
    """A dispatch's (type, data, written) entry for a node or input (bf16 is indexed by its 2-byte
    elements, as lowering.unit_of says)."""
    return value.type, td, written


def threads(n: int) -> tuple[int, int, int]:
    """Workgroups for one thread per item of n."""
    return groups_for(-(-n // WG))


def _floats(node) -> bool:
    return all(v.dtype.name in FLOATS for v in (*node.inputs, node))


@kernel(*BINARY, supports=_floats)
def binary(k, node, srcs, dst) -> None:
    """ggml's add, sub, mul, div: dst = a (op) b with b tiled to a's shape, in f32."""
    a, b = node.inputs
    k.dispatch("binary", {"OP": BINARY[type(node.op)], **storage("A", a.dtype), **storage("B", b.dtype),
                          **storage("D", node.dtype), "WG": WG},
               [tensor(a, srcs[0]), tensor(b, srcs[1]), tensor(node, dst, True)],
               None, threads(node.type.numel), node.name)


def _unary(k, node, srcs, dst, op_name: str, p0: float = 0.0, p1: float = 0.0) -> None:
    (a,) = node.inputs
    k.dispatch("unary", {f"OP_{op_name.upper()}": 1, **storage("A", a.dtype), **storage("D", node.dtype), "WG": WG},
               [tensor(a, srcs[0]), tensor(node, dst, True)], Params().f32(p0, p1),
               threads(node.type.numel), node.name)


@kernel(*UNARY, supports=_floats)
def unary(k, node, srcs, dst) -> None:
    """ggml's unary ops (neg, abs, ..., softplus), element-wise in f32."""
    _unary(k, node, srcs, dst, node.op.name)


@kernel(ops.Scale, supports=_floats)
def scale(k, node, srcs, dst) -> None:
    """ggml_scale_bias: dst = x * s + b."""
    _unary(k, node, srcs, dst, "scale", node.op.s, node.op.b)


@kernel(ops.Clamp, supports=_floats)
def clamp(k, node, srcs, dst) -> None:
    """ggml_clamp: dst = min(max(x, min), max)."""
    _unary(k, node, srcs, dst, "clamp", node.op.min, node.op.max)


@kernel(ops.Fill, supports=_floats)
def fill(k, node, srcs, dst) -> None:
    """ggml_fill: dst = c."""
    _unary(k, node, srcs, dst, "fill", node.op.c)


@kernel(*GLU, supports=lambda node: _floats(node) and len({i.dtype for i in node.inputs}) == 1)
def glu(k, node, srcs, dst) -> None:
    """ggml's swiglu, geglu, reglu, geglu_erf, geglu_quick: dst = act(a) * b, a and b two tensors
    or the halves of one row (`swapped`: b first)."""
    a = node.inputs[0]
    defines = {f"OP_{node.op.name.upper()}": 1, **storage("A", a.dtype), **storage("D", node.dtype), "WG": WG}
    if node.op.split:
        tensors = [tensor(a, srcs[0]), tensor(node.inputs[1], srcs[1])]
    else:
        defines["FUSED"] = 1
        tensors = [tensor(a, srcs[0]), tensor(a, srcs[0])]
    k.dispatch("glu", defines, tensors + [tensor(node, dst, True)], Params().u32(int(node.op.swapped)),
               threads(node.type.numel), node.name)


# -- copies and layout -----------------------------------------------------------------------------
def _contiguous(td) -> bool:
    step = td.dtype.itemsize
    for n, s in zip(reversed(td.shape), reversed(td.strides), strict=True):
        if n != 1 and s != step:
            return False
        step *= n
    return True


def _copies(node) -> bool:
    src, dst = node.inputs[0].dtype, node.dtype
    if src == dst:
        return True
    if src.is_quantized:
        return src.name in QUANTS and dst.name in FLOATS
    return src.name in STORAGE and (dst.name in STORAGE or dst.name in QUANTS)


@kernel(ops.Cont, ops.Cpy, supports=_copies)
def copy(k, node, srcs, dst) -> None:
    """ggml's cont and cpy: dst = src (reshaped, for cont) converted to dst's type, src read from
    any strides. A contiguous copy of one type is a buffer copy, a strided one of quantized rows
    copies their blocks byte by byte. Otherwise a float or i32 dst takes one thread per element,
    a dequantized one a thread per four elements (shaders/dequant.glsl), a quantized one a
    thread per block, quantized as ggml's reference quantizer does (shaders/quantize.glsl)."""
    (a,) = node.inputs
    if a.dtype == node.dtype and _contiguous(srcs[0]) and _contiguous(dst):
        if dst.nbytes:
            k.copy(srcs[0], dst, dst.nbytes)
        return
    if a.dtype == node.dtype and a.dtype.is_quantized:
        n_bytes = node.type.numel // a.dtype.block_size * a.dtype.type_size
        k.dispatch("cpy", {"A_TYPE": "uint8_t", "D_TYPE": "uint8_t", "QK": a.dtype.block_size,
                           "BLOCK": a.dtype.type_size, "WG": WG},
                   [tensor(a, srcs[0]), tensor(node, dst, True)], None, threads(n_bytes), node.name)
        return
    if a.dtype.is_quantized:
        k.dispatch("cpy_from_quant", {f"A_{a.dtype.name.upper()}": 1, **storage("D", node.dtype), "WG": WG},
                   [tensor(a, srcs[0]), tensor(node, dst, True)], None, threads(node.type.numel // 4), node.name)
        return
    if node.dtype.is_quantized:
        k.dispatch("cpy_to_quant", {f"QUANT_{node.dtype.name.upper()}": 1, **storage("A", a.dtype), "WG": WG},
                   [tensor(a, srcs[0]), tensor(node, dst, True)], None,
                   threads(node.type.numel // node.dtype.block_size), node.name)
        return
    defines = {**storage("A", a.dtype), **storage("D", node.dtype), "WG": WG}
    if a.dtype == node.dtype:
        defines["RAW"] = 1
    k.dispatch("cpy", defines, [tensor(a, srcs[0]), tensor(node, dst, True)], None,
               threads(node.type.numel), node.name)


def _same_storage(node) -> bool:
    return all(v.dtype.name in STORAGE for v in (*node.inputs, node))


@kernel(ops.Concat, supports=_same_storage)
def concat(k, node, srcs, dst) -> None:
    """ggml_concat: dst = a and b joined along the op's (numpy) axis."""
    a, b = node.inputs
    dim = a.type.rank - 1 - node.op.axis % a.type.rank  # the ggml axis
    k.dispatch("concat", {"A_TYPE": STORAGE[a.dtype.name][0], "WG": WG},
               [tensor(a, srcs[0]), tensor(b, srcs[1]), tensor(node, dst, True)], Params().u32(dim),
               threads(node.type.numel), node.name)


@kernel(ops.Repeat, supports=_same_storage)
def repeat(k, node, srcs, dst) -> None:
    """ggml_repeat: dst = a tiled to the op's shape."""
    (a,) = node.inputs
    k.dispatch("repeat", {"A_TYPE": STORAGE[a.dtype.name][0], "WG": WG},
               [tensor(a, srcs[0]), tensor(node, dst, True)], None, threads(node.type.numel), node.name)


def _set_rows_ok(node) -> bool:
    dst, src, idx = node.inputs
    return src.dtype.name in FLOATS and (dst.dtype.name in FLOATS or dst.dtype.name in QUANTS) and \
        idx.dtype.name in ("i32", "i64") and idx.type.rank <= 3


@kernel(ops.SetRows, supports=_set_rows_ok)
def set_rows(k, node, srcs, dst) -> None:
    """ggml_set_rows: dst[..., idx[..., i], :] = src[..., i, :] converted to dst's type, in place
    (dst is the destination tensor itself), i32 or i64 indices tiled over the batch axes; one
    thread per element, or per block of a quantized dst (quantized as ggml's reference
    quantizer does)."""
    d, src, idx = node.inputs
    defines = {**storage("S", src.dtype), "WG": WG}
    if idx.dtype.name == "i64":
        defines["IDX64"] = 1
    if d.dtype.is_quantized:
        defines[f"QUANT_{d.dtype.name.upper()}"] = 1
        n = src.type.numel // d.dtype.block_size
    else:
        defines.update(storage("D", d.dtype))
        n = src.type.numel
    k.dispatch("set_rows", defines, [tensor(src, srcs[1]), tensor(idx, srcs[2]), tensor(d, dst, True)],
               None, threads(n), node.name)
