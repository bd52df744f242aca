"""Element-wise and layout kernels: binary ops with ggml's broadcast (src1 repeated along every
axis), the unary ops, scale, clamp, fill and the GLUs (in f32, between f32 / f16 / bf16
storage); cpy / cont (conversions between f32, f16, bf16 and i32, from those floats to the
block types and back, same-type copies of any type), concat and repeat; set_rows (the KV-cache
write) and get_rows.

Sources are read at any strides, in the destination's element order: one thread per element
(consecutive threads on consecutive elements of a row), one per block where a block type is
written (quants.py encodes as the reference does).
"""

from __future__ import annotations

from collections.abc import Callable

from llvmlite import ir

from llamir.ir import ops
from llamir_cuda import kir, quants
from llamir_cuda.kir import I32, I64, scalar, tensor
from llamir_cuda.lowering import ceil_div, f32_bits, grid_for, is_float, kernel, tensor_args
from llamir_cuda.scalar import Val, erf, exp, f32, fabs, fmax, fmin, log, select, tanh

BLOCK = 256
QUANTIZE_BLOCK = 64  # threads of a block-encoding kernel (a thread per block of 32 or 256 values)
BINARY = {ops.Add: "fadd", ops.Sub: "fsub", ops.Mul: "fmul", ops.Div: "fdiv"}
UNARY = tuple(cls for cls in vars(ops).values() if isinstance(cls, type) and issubclass(cls, ops.Unary)
              and cls is not ops.Unary)
GLU = tuple(cls for cls in vars(ops).values() if isinstance(cls, type) and issubclass(cls, ops.Glu)
            and cls is not ops.Glu)
FLOATS = ("f32", "f16", "bf16")
CONVERTIBLE = (*FLOATS, "i32")  # the types kir.load_f32 / store_f32 convert


def _elements(node) -> int:
    return int(node.type.numel)


def _threads(n: int, block: int = BLOCK) -> tuple[int, int, int]:
    return grid_for(ceil_div(n, block))


def _int_type(nbytes: int) -> ir.IntType:
    """The integer type a raw copy moves an element of `nbytes` bytes as."""
    return ir.IntType(8 * nbytes)


# -- binary ----------------------------------------------------------------------------------------
def _binary_kernel(op: str, ta: str, tb: str, td: str) -> kir.Kernel:
    def body(k: kir.KernelBuilder) -> None:
        b, a, c, d = k.b, k.args["a"], k.args["b"], k.args["d"]
        i = k.global_id()
        with k.if_then(b.icmp_signed("<", i, k.count(d))):
            idx = k.unravel(i, d.ne)
            x = k.load_f32(a.ptr, k.offset(a, *idx), ta)
            y = k.load_f32(c.ptr, k.offset(c, *(b.srem(v, n) for v, n in zip(idx, c.ne, strict=True))), tb)
            k.store_f32(getattr(b, op)(x, y), d.ptr, k.offset(d, *idx), td)

    return kir.define(f"binary_{op}", (ta, tb, td), (tensor("a"), tensor("b"), tensor("d")), BLOCK, body)


@kernel(*BINARY, supports=lambda node: is_float(*(v.type for v in (*node.inputs, node))))
def binary(k, node, srcs, dst) -> None:
    a, c = node.inputs
    kern = _binary_kernel(BINARY[type(node.op)], a.dtype.name, c.dtype.name, node.dtype.name)
    k.launch(kern, _threads(_elements(node)), [(a.type, srcs[0]), (c.type, srcs[1]), (node.type, dst)])


# -- unary, scale, clamp, fill -----------------------------------------------------------------------
SQRT_2_OVER_PI = 0.79788456080286535587989211986876
GELU_COEF_A = 0.044715
SQRT_2_INV = 0.70710678118654752440084436210484
GELU_QUICK_COEF = -1.702


def _one(x: Val, value: float) -> Val:
    return f32(x.k, value)


def _silu(x: Val) -> Val:
    return x / (1.0 + exp(-x))


def _gelu(x: Val) -> Val:
    return 0.5 * x * (1.0 + tanh(SQRT_2_OVER_PI * x * (1.0 + GELU_COEF_A * x * x)))


def _gelu_erf(x: Val) -> Val:
    return 0.5 * x * (1.0 + erf(x * SQRT_2_INV))


def _gelu_quick(x: Val) -> Val:
    return x * (1.0 / (1.0 + exp(GELU_QUICK_COEF * x)))


def _hardsigmoid(x: Val) -> Val:
    return fmin(fmax((x + 3.0) / 6.0, 0.0), 1.0)


def _sin_cos(x: Val, which: int) -> Val:
    return Val(x.k, x.k.sincos(x.v)[which])


# y = f(x); ggml-cuda's formulas (unary.cu), in f32
UNARY_FN: dict[str, Callable[[Val], Val]] = {
    "neg": lambda x: -x,
    "abs": fabs,
    "sgn": lambda x: select(x > 0.0, _one(x, 1.0), select(x < 0.0, _one(x, -1.0), 0.0)),
    "step": lambda x: select(x > 0.0, _one(x, 1.0), 0.0),
    "tanh": tanh,
    "elu": lambda x: select(x > 0.0, x, exp(x) - 1.0),
    "relu": lambda x: fmax(x, 0.0),
    "sigmoid": lambda x: 1.0 / (1.0 + exp(-x)),
    "gelu": _gelu,
    "gelu_erf": _gelu_erf,
    "gelu_quick": _gelu_quick,
    "silu": _silu,
    "hardsigmoid": _hardsigmoid,
    "hardswish": lambda x: x * _hardsigmoid(x),
    "exp": exp,
    "log": log,
    "sqr": lambda x: x * x,
    "sqrt": lambda x: Val(x.k, x.k.sqrt(x.v)),
    "sin": lambda x: _sin_cos(x, 0),
    "cos": lambda x: _sin_cos(x, 1),
    "softplus": lambda x: select(x > 20.0, x, log(1.0 + exp(x))),
}
# y = f(x, p0, p1) for the ops with parameters
SCALAR_FN: dict[str, Callable[[Val, Val, Val], Val]] = {
    "scale": lambda x, s, _: x * s,
    "scale_bias": lambda x, s, bias: x * s + bias,
    "clamp": lambda x, lo, hi: fmin(fmax(x, lo), hi),
    "fill": lambda x, c, _: c,
}


def _map_kernel(op: str, ta: str, td: str) -> kir.Kernel:
    """d = f(a) element-wise (a of d's shape, any strides); p0 and p1 are the op's scalars."""
    fn = SCALAR_FN.get(op) or (lambda x, p0, p1: UNARY_FN[op](x))

    def body(k: kir.KernelBuilder) -> None:
        b, a, d = k.b, k.args["a"], k.args["d"]
        i = k.global_id()
        with k.if_then(b.icmp_signed("<", i, k.count(d))):
            idx = k.unravel(i, d.ne)
            x = Val(k, k.load_f32(a.ptr, k.offset(a, *idx), ta))
            y = fn(x, Val(k, k.args["p0"]), Val(k, k.args["p1"]))
            k.store_f32(y.v, d.ptr, k.offset(d, *idx), td)

    params = (tensor("a"), tensor("d"), scalar("p0", "f"), scalar("p1", "f"))
    return kir.define(f"map_{op}", (ta, td), params, BLOCK, body)


def _floats(node) -> bool:
    return all(v.dtype.name in FLOATS for v in (*node.inputs, node))


def _map(k, node, srcs, dst, op: str, p0: float = 0.0, p1: float = 0.0) -> None:
    (a,) = node.inputs
    kern = _map_kernel(op, a.dtype.name, node.dtype.name)
    k.launch(kern, _threads(_elements(node)), [(a.type, srcs[0]), (node.type, dst), f32_bits(p0), f32_bits(p1)])


@kernel(*UNARY, supports=_floats)
def unary(k, node, srcs, dst) -> None:
    """ggml's unary ops (neg, abs, ..., softplus)."""
    _map(k, node, srcs, dst, node.op.name)


@kernel(ops.Scale, supports=_floats)
def scale(k, node, srcs, dst) -> None:
    """ggml_scale / ggml_scale_bias: x * s (+ b)."""
    _map(k, node, srcs, dst, "scale_bias" if node.op.b else "scale", node.op.s, node.op.b)


@kernel(ops.Clamp, supports=_floats)
def clamp(k, node, srcs, dst) -> None:
    _map(k, node, srcs, dst, "clamp", node.op.min, node.op.max)


@kernel(ops.Fill, supports=_floats)
def fill(k, node, srcs, dst) -> None:
    _map(k, node, srcs, dst, "fill", node.op.c)


# -- gated units --------------------------------------------------------------------------------------
GLU_ACT = {"swiglu": "silu", "geglu": "gelu", "reglu": "relu", "geglu_erf": "gelu_erf", "geglu_quick": "gelu_quick"}


def _glu_kernel(op: str, ta: str, td: str) -> kir.Kernel:
    """d = act(a) * g, a and g of d's shape (any strides)."""
    act = UNARY_FN[GLU_ACT[op]]

    def body(k: kir.KernelBuilder) -> None:
        b, a, g, d = k.b, k.args["a"], k.args["g"], k.args["d"]
        i = k.global_id()
        with k.if_then(b.icmp_signed("<", i, k.count(d))):
            idx = k.unravel(i, d.ne)
            x = Val(k, k.load_f32(a.ptr, k.offset(a, *idx), ta))
            gate = Val(k, k.load_f32(g.ptr, k.offset(g, *idx), ta))
            k.store_f32((act(x) * gate).v, d.ptr, k.offset(d, *idx), td)

    return kir.define(f"glu_{op}", (ta, td), (tensor("a"), tensor("g"), tensor("d")), BLOCK, body)


def _half(args: list[int], second: bool) -> list[int]:
    """A tensor's flat arguments narrowed to the first or second half of its rows."""
    ptr, ne0, *rest = args
    half = ne0 // 2
    return [ptr + (half * rest[3] if second else 0), half, *rest]


@kernel(*GLU, supports=lambda node: _floats(node) and len({i.dtype for i in node.inputs}) == 1)
def glu(k, node, srcs, dst) -> None:
    """ggml's swiglu, geglu, reglu, geglu_erf, geglu_quick: act(a) * b, a and b two tensors or
    the halves of one row (`swapped`: b first)."""
    a = node.inputs[0]
    if node.op.split:
        pair = [*tensor_args(a.type, srcs[0]), *tensor_args(node.inputs[1].type, srcs[1])]
    else:
        whole = tensor_args(a.type, srcs[0])
        pair = [*_half(whole, node.op.swapped), *_half(whole, not node.op.swapped)]
    kern = _glu_kernel(node.op.name, a.dtype.name, node.dtype.name)
    k.launch(kern, _threads(_elements(node)), [*pair, (node.type, dst)])


# -- copies --------------------------------------------------------------------------------------------
def _convert_kernel(ta: str, td: str) -> kir.Kernel:
    """d = a converted through f32 (f32, f16, bf16, i32; a of d's shape, any strides)."""
    def body(k: kir.KernelBuilder) -> None:
        b, a, d = k.b, k.args["a"], k.args["d"]
        i = k.global_id()
        with k.if_then(b.icmp_signed("<", i, k.count(d))):
            idx = k.unravel(i, d.ne)
            k.store_f32(k.load_f32(a.ptr, k.offset(a, *idx), ta), d.ptr, k.offset(d, *idx), td)

    return kir.define("convert", (ta, td), (tensor("a"), tensor("d")), BLOCK, body)


def _raw_kernel(nbytes: int, reshaped: bool) -> kir.Kernel:
    """d = a, elements of `nbytes` bytes moved unconverted; `reshaped` (a cont to a new shape):
    the element at the same flat position, else at the same index."""
    def body(k: kir.KernelBuilder) -> None:
        b, a, d = k.b, k.args["a"], k.args["d"]
        i = k.global_id()
        with k.if_then(b.icmp_signed("<", i, k.count(d))):
            idx = k.unravel(i, d.ne)
            src = k.unravel(i, a.ne) if reshaped else idx
            k.store(k.load(a.ptr, _int_type(nbytes), k.offset(a, *src)), d.ptr, k.offset(d, *idx))

    return kir.define("copy_raw", (nbytes, reshaped), (tensor("a"), tensor("d")), BLOCK, body)


def _block_at(k: kir.KernelBuilder, t: kir.Tensor, index: ir.Value, qk: int) -> ir.Value:
    """The byte offset of block `index` (flat, in row order) of a block-typed tensor."""
    blocks = [k.b.sdiv(t.ne[0], k.i32(qk)), *t.ne[1:]]
    return k.offset(t, *k.unravel(index, blocks))


def _block_copy_kernel(qk: int, nbytes: int) -> kir.Kernel:
    """d = a for a block type (`nbytes` bytes a block of qk elements): a thread per byte, blocks
    taken in flat order on both sides."""
    def body(k: kir.KernelBuilder) -> None:
        b, a, d = k.b, k.args["a"], k.args["d"]
        i = k.global_id()
        total = b.mul(b.sdiv(k.count(d), k.i32(qk)), k.i32(nbytes))
        with k.if_then(b.icmp_signed("<", i, total)):
            block, byte = b.sdiv(i, k.i32(nbytes)), b.srem(i, k.i32(nbytes))
            src = b.add(_block_at(k, a, block, qk), b.sext(byte, I64))
            k.store(k.load(a.ptr, kir.I8, src), d.ptr, b.add(_block_at(k, d, block, qk), b.sext(byte, I64)))

    return kir.define("copy_blocks", (qk, nbytes), (tensor("a"), tensor("d")), BLOCK, body)


def _dequant_kernel(tq: str, td: str) -> kir.Kernel:
    """d = a dequantized (a of d's shape, rows of whole blocks at any strides)."""
    qk = quants.block_size(tq)

    def body(k: kir.KernelBuilder) -> None:
        b, a, d = k.b, k.args["a"], k.args["d"]
        i = k.global_id()
        with k.if_then(b.icmp_signed("<", i, k.count(d))):
            i0, i1, i2, i3 = k.unravel(i, d.ne)
            block = k.offset(a, b.sdiv(i0, k.i32(qk)), i1, i2, i3)
            x = quants.dequant_block(k, tq, a.ptr, block, b.srem(i0, k.i32(qk)))
            k.store_f32(x, d.ptr, k.offset(d, i0, i1, i2, i3), td)

    return kir.define("dequant", (tq, td), (tensor("a"), tensor("d")), BLOCK, body)


def _quantize_kernel(ta: str, tq: str) -> kir.Kernel:
    """d = a quantized (a of d's shape, any strides): a thread per block of d."""
    qk = quants.block_size(tq)

    def body(k: kir.KernelBuilder) -> None:
        b, a, d = k.b, k.args["a"], k.args["d"]
        t = k.global_id()
        with k.if_then(b.icmp_signed("<", t, b.sdiv(k.count(d), k.i32(qk)))):
            blk, i1, i2, i3 = k.unravel(t, [b.sdiv(d.ne[0], k.i32(qk)), *d.ne[1:]])
            first = b.mul(blk, k.i32(qk))

            def load(j: ir.Value) -> ir.Value:
                return k.load_f32(a.ptr, k.offset(a, b.add(first, j), i1, i2, i3), ta)
            quants.quantize_block(k, tq, load, d.ptr, k.offset(d, blk, i1, i2, i3))

    return kir.define("quantize", (ta, tq), (tensor("a"), tensor("d")), QUANTIZE_BLOCK, body)


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
        return src.name in quants.QUANTS and dst.name in FLOATS
    return src.name in CONVERTIBLE and (dst.name in CONVERTIBLE or (src.name in FLOATS and dst.name in quants.QUANTS))


@kernel(ops.Cont, ops.Cpy, supports=_copies)
def copy(k, node, srcs, dst) -> None:
    """ggml's cont and cpy: d = a (reshaped, for cont) in d's type, a read from any strides. Both
    contiguous and of one type: a buffer copy; else one kernel of the conversion's kind (only
    same-type copies reshape: a cont keeps the type, a cpy the shape)."""
    (a,) = node.inputs
    src_t, dst_t = a.dtype, node.dtype
    args = [(a.type, srcs[0]), (node.type, dst)]
    reshaped = tuple(int(n) for n in a.type.shape) != tuple(int(n) for n in node.type.shape)
    n = _elements(node)
    if src_t == dst_t and _contiguous(srcs[0]) and _contiguous(dst):
        k.copy(dst, srcs[0], dst.nbytes)
    elif src_t == dst_t and src_t.is_quantized:
        n_bytes = n // src_t.block_size * src_t.type_size
        k.launch(_block_copy_kernel(src_t.block_size, src_t.type_size), _threads(n_bytes), args)
    elif src_t == dst_t:
        k.launch(_raw_kernel(src_t.type_size, reshaped), _threads(n), args)
    elif src_t.is_quantized:
        k.launch(_dequant_kernel(src_t.name, dst_t.name), _threads(n), args)
    elif dst_t.is_quantized:
        k.launch(_quantize_kernel(src_t.name, dst_t.name), _threads(n // dst_t.block_size, QUANTIZE_BLOCK), args)
    else:
        k.launch(_convert_kernel(src_t.name, dst_t.name), _threads(n), args)


# -- concat, repeat ----------------------------------------------------------------------------------
def _concat_kernel(nbytes: int, dim: int) -> kir.Kernel:
    """d = a and b joined along ggml axis `dim` (off it, all three have the same extents)."""
    def body(k: kir.KernelBuilder) -> None:
        b, a, c, d = k.b, k.args["a"], k.args["b"], k.args["d"]
        i = k.global_id()
        with k.if_then(b.icmp_signed("<", i, k.count(d))):
            idx = k.unravel(i, d.ne)
            in_a = b.icmp_signed("<", idx[dim], a.ne[dim])
            idx_b = [b.sub(v, a.ne[dim]) if axis == dim else v for axis, v in enumerate(idx)]
            src = b.select(in_a, k.at(a.ptr, k.offset(a, *idx)), k.at(c.ptr, k.offset(c, *idx_b)))
            k.store(k.load(src, _int_type(nbytes)), d.ptr, k.offset(d, *idx))

    return kir.define("concat", (nbytes, dim), (tensor("a"), tensor("b"), tensor("d")), BLOCK, body)


def _raw_storage(node) -> bool:
    return not any(v.dtype.is_quantized for v in (*node.inputs, node))


@kernel(ops.Concat, supports=_raw_storage)
def concat(k, node, srcs, dst) -> None:
    """ggml_concat along the op's (numpy) axis."""
    a, c = node.inputs
    dim = a.type.rank - 1 - node.op.axis % a.type.rank
    k.launch(_concat_kernel(a.dtype.type_size, dim), _threads(_elements(node)),
             [(a.type, srcs[0]), (c.type, srcs[1]), (node.type, dst)])


def _repeat_kernel(nbytes: int) -> kir.Kernel:
    """d = a tiled to d's shape (each of a's extents divides d's)."""
    def body(k: kir.KernelBuilder) -> None:
        b, a, d = k.b, k.args["a"], k.args["d"]
        i = k.global_id()
        with k.if_then(b.icmp_signed("<", i, k.count(d))):
            idx = k.unravel(i, d.ne)
            src = k.offset(a, *(b.srem(v, n) for v, n in zip(idx, a.ne, strict=True)))
            k.store(k.load(a.ptr, _int_type(nbytes), src), d.ptr, k.offset(d, *idx))

    return kir.define("repeat", (nbytes,), (tensor("a"), tensor("d")), BLOCK, body)


@kernel(ops.Repeat, supports=_raw_storage)
def repeat(k, node, srcs, dst) -> None:
    (a,) = node.inputs
    k.launch(_repeat_kernel(a.dtype.type_size), _threads(_elements(node)), [(a.type, srcs[0]), (node.type, dst)])


# -- rows ------------------------------------------------------------------------------------------------
def _index(k: kir.KernelBuilder, t: kir.Tensor, dtype: str, i0, i1, i2) -> ir.Value:
    """Element (i0, i1, i2) of an i32 or i64 index tensor, as i64."""
    v = k.load(t.ptr, I32 if dtype == "i32" else I64, k.offset(t, i0, i1, i2))
    return k.b.sext(v, I64) if dtype == "i32" else v


def _set_rows_kernel(ts: str, ti: str, td: str) -> kir.Kernel:
    """d[.., idx[i1, i2 % idx.ne1, i3 % idx.ne2], i2, i3] = s[.., i1, i2, i3] converted; a thread
    per element of s, or per block of it for a block-typed d."""
    qk = quants.block_size(td) if td in quants.QUANTS else 1

    def body(k: kir.KernelBuilder) -> None:
        b, s, ix, d = k.b, k.args["s"], k.args["i"], k.args["d"]
        t = k.global_id()
        with k.if_then(b.icmp_signed("<", t, b.sdiv(k.count(s), k.i32(qk)))):
            i0, i1, i2, i3 = k.unravel(t, [b.sdiv(s.ne[0], k.i32(qk)), *s.ne[1:]])
            row = _index(k, ix, ti, i1, b.srem(i2, ix.ne[1]), b.srem(i3, ix.ne[2]))
            if qk == 1:
                x = k.load_f32(s.ptr, k.offset(s, i0, i1, i2, i3), ts)
                k.store_f32(x, d.ptr, k.offset(d, i0, row, i2, i3), td)
            else:
                first = b.mul(i0, k.i32(qk))

                def load(j: ir.Value) -> ir.Value:
                    return k.load_f32(s.ptr, k.offset(s, b.add(first, j), i1, i2, i3), ts)
                quants.quantize_block(k, td, load, d.ptr, k.offset(d, i0, row, i2, i3))

    block = BLOCK if qk == 1 else QUANTIZE_BLOCK
    return kir.define("set_rows", (ts, ti, td), (tensor("s"), tensor("i"), tensor("d")), block, body)


def _set_rows_ok(node) -> bool:
    d, s, idx = node.inputs
    return s.dtype.name in FLOATS and (d.dtype.name in FLOATS or d.dtype.name in quants.QUANTS) \
        and idx.dtype.name in ("i32", "i64") and idx.type.rank <= 3


@kernel(ops.SetRows, supports=_set_rows_ok)
def set_rows(k, node, srcs, dst) -> None:
    """ggml_set_rows: rows of s written over rows of d (the node's result is d itself), i32 or
    i64 indices tiled over the batch axes."""
    d, s, idx = node.inputs
    kern = _set_rows_kernel(s.dtype.name, idx.dtype.name, d.dtype.name)
    n = _elements(s) // (d.dtype.block_size if d.dtype.is_quantized else 1)
    k.launch(kern, _threads(n, kern.block[0]), [(s.type, srcs[1]), (idx.type, srcs[2]), (d.type, dst)])


def _get_rows_kernel(ta: str) -> kir.Kernel:
    """d[c, n, i2, i3] = a[c, idx[n, i2, i3], i2, i3] as f32 (i32 copied as it is)."""
    def body(k: kir.KernelBuilder) -> None:
        b, a, ix, d = k.b, k.args["a"], k.args["i"], k.args["d"]
        i = k.global_id()
        with k.if_then(b.icmp_signed("<", i, k.count(d))):
            c, n, i2, i3 = k.unravel(i, d.ne)
            row = _index(k, ix, "i32", n, i2, i3)
            out = k.offset(d, c, n, i2, i3)
            if ta == "i32":
                k.store(k.load(a.ptr, I32, k.offset(a, c, row, i2, i3)), d.ptr, out)
            elif ta in quants.QUANTS:
                qk = quants.block_size(ta)
                block = k.offset(a, b.sdiv(c, k.i32(qk)), row, i2, i3)
                k.store(quants.dequant_block(k, ta, a.ptr, block, b.srem(c, k.i32(qk))), d.ptr, out)
            else:
                k.store(k.load_f32(a.ptr, k.offset(a, c, row, i2, i3), ta), d.ptr, out)

    return kir.define("get_rows", (ta,), (tensor("a"), tensor("i"), tensor("d")), BLOCK, body)


@kernel(ops.GetRows, supports=lambda node: node.inputs[0].dtype.name in (*FLOATS, "i32", *quants.QUANTS))
def get_rows(k, node, srcs, dst) -> None:
    """ggml_get_rows: rows of a gathered by i32 indices, each batch from its own rows."""
    a, idx = node.inputs
    k.launch(_get_rows_kernel(a.dtype.name), _threads(_elements(node)),
             [(a.type, srcs[0]), (idx.type, srcs[1]), (node.type, dst)])
