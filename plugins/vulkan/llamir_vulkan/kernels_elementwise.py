"""Element-wise kernels: binary ops with repeat, unary ops, scale, clamp, fill, glu, cpy/cont."""

from __future__ import annotations

from llamir.ir import ops
from llamir_vulkan.lowering import Params, float_type, groups_for, is_float, kernel

WG = 256
BINARY = {ops.Add: 0, ops.Sub: 1, ops.Mul: 2, ops.Div: 3}
UNARY = tuple(cls for cls in vars(ops).values() if isinstance(cls, type) and issubclass(cls, ops.Unary)
              and cls is not ops.Unary)
GLU = tuple(cls for cls in vars(ops).values() if isinstance(cls, type) and issubclass(cls, ops.Glu)
            and cls is not ops.Glu)


def _threads(n: int) -> tuple[int, int, int]:
    return groups_for(-(-n // WG))


def _rank4(*types) -> bool:
    return all(t.rank <= 4 for t in types)


def _float_io(node) -> bool:
    types = [i.type for i in node.inputs] + [node.type]
    return is_float(*types) and _rank4(*types)


@kernel(*BINARY, supports=_float_io)
def binary(k, node, srcs, dst) -> None:
    a, b = node.inputs
    k.dispatch("binary", {"OP": BINARY[type(node.op)], "A_TYPE": float_type(a.dtype), "B_TYPE": float_type(b.dtype),
                          "D_TYPE": float_type(node.dtype), "WG": WG},
               [(a.type, srcs[0], False), (b.type, srcs[1], False), (node.type, dst, True)],
               None, _threads(node.type.numel), node.name)


def _unary(k, node, srcs, dst, op_name: str, p0: float = 0.0, p1: float = 0.0) -> None:
    (a,) = node.inputs
    k.dispatch("unary", {f"OP_{op_name.upper()}": 1, "A_TYPE": float_type(a.dtype), "D_TYPE": float_type(node.dtype),
                         "WG": WG},
               [(a.type, srcs[0], False), (node.type, dst, True)], Params().f32(p0, p1),
               _threads(node.type.numel), node.name)


@kernel(*UNARY, supports=_float_io)
def unary(k, node, srcs, dst) -> None:
    _unary(k, node, srcs, dst, node.op.name)


@kernel(ops.Scale, supports=_float_io)
def scale(k, node, srcs, dst) -> None:
    _unary(k, node, srcs, dst, "scale", node.op.s, node.op.b)


@kernel(ops.Clamp, supports=_float_io)
def clamp(k, node, srcs, dst) -> None:
    _unary(k, node, srcs, dst, "clamp", node.op.min, node.op.max)


@kernel(ops.Fill, supports=_float_io)
def fill(k, node, srcs, dst) -> None:
    _unary(k, node, srcs, dst, "fill", node.op.c)


@kernel(ops.Cont, ops.Cpy, supports=_float_io)
def copy(k, node, srcs, dst) -> None:
    """cont and cpy between float types: a strided read in dst's element order, converted."""
    _unary(k, node, srcs, dst, "copy")


@kernel(*GLU, supports=_float_io)
def glu(k, node, srcs, dst) -> None:
    a = node.inputs[0]
    defines = {f"OP_{node.op.name.upper()}": 1, "A_TYPE": float_type(a.dtype), "D_TYPE": float_type(node.dtype),
               "WG": WG}
    if node.op.split:
        if node.inputs[1].dtype != a.dtype:
            raise ValueError("glu halves of different types")
        tensors = [(a.type, srcs[0], False), (node.inputs[1].type, srcs[1], False)]
    else:
        defines["FUSED"] = 1
        tensors = [(a.type, srcs[0], False), (a.type, srcs[0], False)]
    k.dispatch("glu", defines, tensors + [(node.type, dst, True)], Params().u32(int(node.op.swapped)),
               _threads(node.type.numel), node.name)
