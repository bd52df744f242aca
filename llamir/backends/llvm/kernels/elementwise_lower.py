"""Lowerings of element-wise ops and layout copies (cont, cpy, repeat, concat) onto the
Elementwise kernel, with element-wise chains fused into one tree."""

from __future__ import annotations

from llamir.backends.llvm import expr as E
from llamir.backends.llvm.kernels.elementwise import Elementwise, row_part
from llamir.backends.llvm.lowering import Lowerer, lowering
from llamir.backends.llvm.plan import Ref
from llamir.ir import F32, Graph, Node, ops
from llamir.ir.dtypes import I8

_GLU_KINDS = (ops.SwiGlu, ops.GeGlu, ops.ReGlu, ops.GeGluErf, ops.GeGluQuick)
_BIN = {ops.Add: "add", ops.Sub: "sub", ops.Mul: "mul", ops.Div: "div"}
_FLOATS = ("f32", "f16", "bf16")


def _is_float(dtype) -> bool:
    return dtype.name in _FLOATS


def _fusable(node: Node) -> bool:
    """An element-wise op whose value can be computed inside its consumer's loop."""
    op = node.op
    if not _is_float(node.dtype) or not all(_is_float(x.dtype) for x in node.inputs):
        return False
    if isinstance(op, _GLU_KINDS):
        return op.split
    return isinstance(op, (ops.Binary, ops.Unary, ops.Scale, ops.Clamp, ops.Fill)) or (
        isinstance(op, ops.Cpy) and node.inputs[0].type.shape == node.type.shape)


def _reads_state(node: Node) -> bool:
    """Whether a value read by `node` may be overwritten in place later (a state leaf or a
    set_rows result, possibly through views): such reads must happen where the node is."""
    for x in node.inputs:
        while x.op.is_view:
            x = x.inputs[0]
        if x.kind == "state" or x.op.has_side_effects:
            return True
    return False


def find_inlined(graph: Graph) -> set[int]:
    """Element-wise values with a single (element-wise, same-shape) user and no other role."""
    outputs = {id(n) for n in graph.outputs.values()}
    inlined: set[int] = set()
    for node in graph.nodes:
        if not _fusable(node):
            continue
        for x in node.inputs:
            if (not x.is_leaf and _fusable(x) and len(x.users) == 1 and id(x) not in outputs
                    and x.type.shape == node.type.shape and not _reads_state(x)):
                inlined.add(id(x))
    return inlined


class _Tree:
    """Builds one fused tree and the list of input Refs its ("x", i) leaves index."""

    def __init__(self, L: Lowerer):
        self.L = L
        self.inputs: list[Ref] = []

    def leaf(self, ref: Ref) -> tuple:
        for i, r in enumerate(self.inputs):
            if r == ref:
                return ("x", i)
        self.inputs.append(ref)
        return ("x", len(self.inputs) - 1)

    def value(self, node: Node) -> tuple:
        if id(node) in self.L.inlined:
            t = self.of(node)
            return t if node.dtype == F32 else ("round", node.dtype.name, t)
        return self.leaf(self.L.ref(node))

    def of(self, node: Node) -> tuple:
        op = node.op
        ins = node.inputs
        if isinstance(op, ops.Binary):
            return ("bin", _BIN[type(op)], self.value(ins[0]), self.value(ins[1]))
        if isinstance(op, ops.Unary):
            return ("un", op.name, _lanes_flag(op.name, ins[0].dtype.name), self.value(ins[0]))
        if isinstance(op, ops.Scale):
            return ("scale", float(op.s), float(op.b), self.value(ins[0]))
        if isinstance(op, ops.Clamp):
            return ("clamp", float(op.min), float(op.max), self.value(ins[0]))
        if isinstance(op, ops.Fill):
            return ("c", float(op.c))
        if isinstance(op, ops.Cpy):
            return self.value(ins[0])
        if isinstance(op, _GLU_KINDS):
            flag = _lanes_flag("silu" if op.name == "swiglu" else "gelu", ins[0].dtype.name)
            if op.split:
                return ("glu", op.name, flag, self.value(ins[0]), self.value(ins[1]))
            a, b = _halves(self.L.ref(ins[0]))
            if op.swapped:
                a, b = b, a
            return ("glu", op.name, flag, self.leaf(a), self.leaf(b))
        raise ValueError(f"{op.name} is not element-wise")


def _lanes_flag(name: str, dtype: str) -> bool:
    """silu: ggml's 16-lane v_silu only for f32 rows; gelu: the f16 table except for bf16."""
    if name in ("silu",):
        return dtype == "f32"
    if name in ("gelu", "gelu_quick"):
        return dtype != "bf16"
    return False


def _halves(ref: Ref) -> tuple[Ref, Ref]:
    n = ref.shape[-1] // 2
    shape = ref.shape[:-1] + (n,)
    second = E.add(ref.offset, E.mul(n, ref.strides[-1]))
    return Ref(ref.buf, ref.offset, shape, ref.strides, ref.dtype), Ref(ref.buf, second, shape, ref.strides, ref.dtype)


def _emit(L: Lowerer, node: Node, tree: tuple, inputs: list[Ref], out: Ref) -> None:
    kernel = Elementwise(tree, out, inputs)
    part = row_part(out)
    read_parts = [row_part(r) if _same_rows(r, out) else None for r in inputs]
    L.step(kernel, [out] + inputs, inputs, [out], part, read_parts, node)


def _same_rows(r: Ref, out: Ref) -> bool:
    return r.shape == out.shape and r.is_contiguous


@lowering(*_BIN, *[c for c in ops.OPS.values() if isinstance(c, type) and issubclass(c, ops.Unary)],
          ops.Scale, ops.Clamp, ops.Fill, *_GLU_KINDS)
def lower_elementwise(L: Lowerer, node: Node) -> None:
    t = _Tree(L)
    tree = t.of(node)
    _emit(L, node, tree, t.inputs, L.out(node))


def _cpy_supported(node: Node, target) -> bool:
    from llamir.backends.llvm.kernels.quant import DEQUANT_TYPES, QUANTIZE_TYPES

    src, dst = node.inputs[0].dtype, node.dtype
    if src == dst:
        return True
    if src.is_quantized and src.name not in DEQUANT_TYPES:
        return False
    return not dst.is_quantized or dst.name in QUANTIZE_TYPES


@lowering(ops.Cpy, supports=_cpy_supported)
def lower_cpy(L: Lowerer, node: Node) -> None:
    src, out = L.ref(node.inputs[0]), L.out(node)
    if src.dtype != out.dtype and (src.dtype.is_quantized or out.dtype.is_quantized):
        from llamir.backends.llvm.kernels.gather import ConvertRows

        L.step(ConvertRows(out, src), [out, src], [src], [out], row_part(out), [])
        return
    copy_step(L, out, src, node)


@lowering(ops.Cont)
def lower_cont(L: Lowerer, node: Node) -> None:
    src = L.ref(node.inputs[0])
    out = L.out(node)
    if out.shape != src.shape:  # cont with a new shape: copy in the source's shape, then view
        out = L.plan.new_ref(out.buf, src.shape, src.dtype)
    copy_step(L, out, src, node)


def copy_step(L: Lowerer, dst: Ref, src: Ref, node: Node | None = None) -> None:
    """dst = src converted to dst's dtype (any strides on both sides)."""
    if src.dtype == dst.dtype and src.dtype.is_quantized:
        src, dst = _bytes(src), _bytes(dst)
    raw = src.dtype == dst.dtype
    kernel = Elementwise(("x", 0), dst, [src], raw=raw)
    part = row_part(dst)
    L.step(kernel, [dst, src], [src], [dst], part, [row_part(src) if _same_rows(src, dst) else None], node)


def _bytes(ref: Ref) -> Ref:
    """A quantized tensor as its bytes (rows of row_bytes uint8)."""
    if ref.strides[-1] != ref.dtype.type_size:
        raise ValueError(f"quantized rows must be contiguous, got strides {ref.strides}")
    row = ref.row_bytes()
    return Ref(ref.buf, ref.offset, ref.shape[:-1] + (row,), ref.strides[:-1] + (1,), I8)


@lowering(ops.Repeat)
def lower_repeat(L: Lowerer, node: Node) -> None:
    copy_step(L, L.out(node), L.ref(node.inputs[0]), node)


@lowering(ops.Concat)
def lower_concat(L: Lowerer, node: Node) -> None:
    out = L.out(node)
    a, b = (L.ref(x) for x in node.inputs)
    axis = node.op.axis % out.rank
    first = Ref(out.buf, out.offset, a.shape, out.strides, out.dtype)
    second_off = E.add(out.offset, E.mul(a.shape[axis], out.strides[axis]))
    if out.dtype.is_quantized and axis == out.rank - 1:
        raise ValueError("concat of quantized rows along the row axis is not supported")
    second = Ref(out.buf, second_off, b.shape, out.strides, out.dtype)
    copy_step(L, first, a, node)
    copy_step(L, second, b, node)
