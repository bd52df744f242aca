"""Norm and reduction kernels: rms_norm, norm, l2_norm, group_norm, the fused rms_norm_mul and
norm_mul_add, sum_rows, mean, sum, argsort and top_k.

A reduction runs one block per segment (a row, or group_norm's channel group): each thread sums
a strided slice of it (consecutive threads read consecutive values), then `block_reduce` combines
the partial sums. As in ggml-cuda's norms, a segment under 1024 values gets one warp (the
reduction is shuffles only), a longer one 1024 threads. argsort sorts each row in shared memory.
"""

from __future__ import annotations

from collections.abc import Callable

from llvmlite import ir

from llamir.ir import ops
from llamir_cuda import kir
from llamir_cuda.kir import F32, I32, I64, scalar, tensor
from llamir_cuda.lowering import f32_bits, grid_for, is_float, kernel

BIG_SEGMENT = 1024  # segments this long or longer get a block of 1024 threads, shorter ones a warp
MAX_SORT = 4096     # argsort's longest row: padded to a power of two, 8 bytes a slot of shared memory
SORT_BLOCK = 512
PAD_KEY = -1 << 32  # argsort's padding slots: the largest order key, so they sort after every value


def segment_block(n: int) -> int:
    return 1024 if n >= BIG_SEGMENT else kir.WARP


def blocks(n: int) -> tuple[int, int, int]:
    """A grid of `n` blocks (none for an empty tensor)."""
    return grid_for(n) if n > 0 else (0, 1, 1)


def fits_i32(ttype) -> bool:
    """Whether a flat i32 index reaches every element (symbolic shapes are checked at lowering)."""
    numel = ttype.numel
    return not isinstance(numel, int) or numel < 1 << 31


def _floats(node) -> bool:
    return is_float(*(v.type for v in (*node.inputs, node)))


# -- segments --------------------------------------------------------------------------------------
class Row:
    """Row `ctaid.x` of `x`: its ne0 values, element j at (j, i1, i2, i3)."""

    def __init__(self, k: kir.KernelBuilder, x: kir.Tensor):
        b, r = k.b, k.ctaid(0)
        self.i1 = b.urem(r, x.ne[1])
        r = b.udiv(r, x.ne[1])
        self.i2, self.i3 = b.urem(r, x.ne[2]), b.udiv(r, x.ne[2])
        self.n = x.ne[0]

    def coords(self, k: kir.KernelBuilder, j: ir.Value) -> tuple[ir.Value, ...]:
        return (j, self.i1, self.i2, self.i3)


class ChannelGroup:
    """group_norm's segment `ctaid.x` of x [W, L, C, N] (ggml's order): `group` channels of one
    batch (fewer in the last group), all their W*L values; element j has W fastest, then L."""

    def __init__(self, k: kir.KernelBuilder, x: kir.Tensor, group: ir.Value):
        b = k.b
        n_groups = b.udiv(b.add(x.ne[2], b.sub(group, k.i32(1))), group)
        seg = k.ctaid(0)
        self.c0, self.i3 = b.mul(b.urem(seg, n_groups), group), b.udiv(seg, n_groups)
        left = b.sub(x.ne[2], self.c0)
        channels = k.select(b.icmp_unsigned("<", left, group), left, group)
        self.ne0, self.ne1 = x.ne[0], x.ne[1]
        self.n = b.mul(b.mul(self.ne0, self.ne1), channels)

    def coords(self, k: kir.KernelBuilder, j: ir.Value) -> tuple[ir.Value, ...]:
        b = k.b
        rest = b.udiv(j, self.ne0)
        return (b.urem(j, self.ne0), b.urem(rest, self.ne1), b.add(self.c0, b.udiv(rest, self.ne1)), self.i3)


class Whole:
    """Every element of `x` as one segment (sum): element j at its unravelled coordinates."""

    def __init__(self, k: kir.KernelBuilder, x: kir.Tensor):
        self.ne, self.n = x.ne, k.count(x)

    def coords(self, k: kir.KernelBuilder, j: ir.Value) -> tuple[ir.Value, ...]:
        return tuple(k.unravel(j, self.ne))


def block_sum(k: kir.KernelBuilder, seg, term: Callable[[ir.Value], ir.Value]) -> ir.Value:
    """The sum of term(j) over the segment, returned to every thread: each thread adds the
    j = tid, tid + block, ... of its slice, then the block reduces the partial sums."""
    block = k.block[0]
    acc = k.var(F32, k.f32(0.0))
    with k.loop(k.tid(0), seg.n, block) as j:
        k.set(acc, k.b.fadd(k.get(acc, F32), term(j)))
    return k.block_reduce(k.get(acc, F32), k.b.fadd, k.f32(0.0))


def rounded(k: kir.KernelBuilder, value: ir.Value, dtype: str) -> ir.Value:
    """`value` rounded to `dtype` and back: a fused op's intermediate stored as the unfused op
    would store it."""
    if dtype == "f16":
        return k.h2f(k.f2h(value))
    if dtype == "bf16":
        return k.bf2f(k.f2bf(value))
    return value


# -- normalisations --------------------------------------------------------------------------------
def _norm_kernel(kind: str, tx: str, td: str, tw: str | None, tb: str | None, grouped: bool,
                 block: int) -> kir.Kernel:
    """rms (x / sqrt(mean(x^2) + eps)), norm ((x - mean) / sqrt(var + eps)) or l2
    (x / max(|x|, eps)) over each segment, then y * w (+ b) with w and b tiled to x's shape.
    x is read twice (three times for norm); the rereads of a row mostly hit the cache."""
    params = (tensor("x"), tensor("d"), *((tensor("w"),) if tw else ()), *((tensor("b"),) if tb else ()),
              scalar("eps", "f"), *((scalar("group", "i"),) if grouped else ()))

    def body(k: kir.KernelBuilder) -> None:
        b, x, d, eps = k.b, k.args["x"], k.args["d"], k.args["eps"]
        seg = ChannelGroup(k, x, k.args["group"]) if grouped else Row(k, x)
        n = b.uitofp(seg.n, F32)

        def load_x(coords):
            return k.load_f32(x.ptr, k.offset(x, *coords), tx)

        def at(j):
            return load_x(seg.coords(k, j))

        mean = None
        if kind == "norm":
            mean = b.fdiv(block_sum(k, seg, at), n)
            centred = block_sum(k, seg, lambda j: _square(b, b.fsub(at(j), mean)))
            scale = b.fdiv(k.f32(1.0), k.sqrt(b.fadd(b.fdiv(centred, n), eps)))
        else:
            squares = block_sum(k, seg, lambda j: _square(b, at(j)))
            if kind == "rms":
                scale = b.fdiv(k.f32(1.0), k.sqrt(b.fadd(b.fdiv(squares, n), eps)))
            else:
                scale = b.fdiv(k.f32(1.0), k.fmax(k.sqrt(squares), eps))
        with k.loop(k.tid(0), seg.n, block) as j:
            coords = seg.coords(k, j)
            v = load_x(coords)
            y = b.fmul(v if mean is None else b.fsub(v, mean), scale)
            for name, dtype, combine in (("w", tw, b.fmul), ("b", tb, b.fadd)):
                if dtype:
                    t = k.args[name]
                    tiled = [b.urem(c, ne) for c, ne in zip(coords, t.ne, strict=True)]
                    y = combine(rounded(k, y, td), k.load_f32(t.ptr, k.offset(t, *tiled), dtype))
            k.store_f32(y, d.ptr, k.offset(d, *coords), td)

    key = (kind, tx, td, tw, tb, grouped, block)
    return kir.define(f"norm_{kind}", key, params, block, body)


def _square(b: ir.IRBuilder, v: ir.Value) -> ir.Value:
    return b.fmul(v, v)


def _norm(k, node, srcs, dst, kind: str, group: int = 0) -> None:
    """Launch one block per segment: a row of x, or (`group` > 0) `group` channels of a batch."""
    x, extra = node.inputs[0], node.inputs[1:]
    shape = [int(d) for d in x.type.shape]
    if group:
        n_segments = -(-shape[-3] // group) * (shape[-4] if len(shape) == 4 else 1)
        length = group * shape[-2] * shape[-1]
    else:
        length = shape[-1]
        n_segments = int(node.type.numel) // max(length, 1)
    tw, tb = ([v.dtype.name for v in extra] + [None, None])[:2]
    kern = _norm_kernel(kind, x.dtype.name, node.dtype.name, tw, tb, bool(group), segment_block(length))
    args = [(x.type, srcs[0]), (node.type, dst), *((v.type, td) for v, td in zip(extra, srcs[1:], strict=True)),
            f32_bits(node.op.eps), *((group,) if group else ())]
    k.launch(kern, blocks(n_segments), args, name=node.name)


NORM_KIND = {ops.RmsNorm: "rms", ops.Norm: "norm", ops.L2Norm: "l2"}


@kernel(*NORM_KIND, supports=_floats)
def row_norm(k, node, srcs, dst) -> None:
    """ggml's rms_norm, norm and l2_norm over each row of x (f32, f16 or bf16; any strides)."""
    _norm(k, node, srcs, dst, NORM_KIND[type(node.op)])


@kernel(ops.GroupNorm, supports=_floats)
def group_norm(k, node, srcs, dst) -> None:
    """ggml_group_norm: x [N, C, L, W] normalised over each group of ceil(C / n_groups) channels
    (their L * W values together), one block per group and batch."""
    channels = int(node.inputs[0].type.shape[-3])
    _norm(k, node, srcs, dst, "norm", group=-(-channels // node.op.n_groups))


@kernel(ops.RmsNormMul, supports=_floats)
def rms_norm_mul(k, node, srcs, dst) -> None:
    """The fused rms_norm(x) * w (w tiled to x's shape), as ggml-cuda fuses rms_norm and mul."""
    _norm(k, node, srcs, dst, "rms")


@kernel(ops.NormMulAdd, supports=_floats)
def norm_mul_add(k, node, srcs, dst) -> None:
    """The fused layer norm: norm(x) * w (+ b), w and b tiled to x's shape, of any float types."""
    _norm(k, node, srcs, dst, "norm")


# -- sums ------------------------------------------------------------------------------------------
def _sum_kernel(what: str, tx: str, td: str, block: int) -> kir.Kernel:
    """`rows`: y[r] = the sum of row r; `mean`: divided by the row's length; `all`: y[0] = the
    sum of every element (one block)."""

    def body(k: kir.KernelBuilder) -> None:
        b, x, d = k.b, k.args["x"], k.args["d"]
        seg = Whole(k, x) if what == "all" else Row(k, x)
        total = block_sum(k, seg, lambda j: k.load_f32(x.ptr, k.offset(x, *seg.coords(k, j)), tx))
        if what == "mean":
            total = b.fdiv(total, b.uitofp(seg.n, F32))
        out = k.offset(d) if what == "all" else k.offset(d, None, seg.i1, seg.i2, seg.i3)
        with k.if_then(b.icmp_unsigned("==", k.tid(0), k.i32(0))):
            k.store_f32(total, d.ptr, out, td)

    return kir.define(f"sum_{what}", (tx, td, block), (tensor("x"), tensor("d")), block, body)


@kernel(ops.SumRows, ops.Mean, ops.Sum, supports=lambda node: _floats(node) and fits_i32(node.inputs[0].type))
def sum_rows(k, node, srcs, dst) -> None:
    """ggml's sum_rows and mean (one block per row) and sum (one block over all of x)."""
    (x,) = node.inputs
    numel, n = int(x.type.numel), int(x.type.shape[-1]) if x.type.rank else 1
    what = "all" if node.is_op(ops.Sum) else "mean" if node.is_op(ops.Mean) else "rows"
    n_blocks, length = (1, numel) if what == "all" else (numel // max(n, 1), n)
    kern = _sum_kernel(what, x.dtype.name, node.dtype.name, segment_block(length))
    k.launch(kern, blocks(n_blocks), [(x.type, srcs[0]), (node.type, dst)], name=node.name)


# -- orderings -------------------------------------------------------------------------------------
def order_key(k: kir.KernelBuilder, v: ir.Value, descending: bool) -> ir.Value:
    """An i32 whose unsigned order is the sort order of the f32 `v` (of -v when descending), with
    -0 equal to +0 and NaNs after everything, as numpy's argsort orders them."""
    b = k.b
    if descending:
        v = b.fneg(v)
    v = b.fadd(v, k.f32(0.0))  # -0 + 0 = +0
    bits = b.bitcast(v, I32)
    key = k.select(b.icmp_signed("<", bits, k.i32(0)), b.not_(bits), b.xor(bits, k.i32(-1 << 31)))
    return k.select(b.fcmp_unordered("uno", v, v), k.i32(-1), key)


def _argsort_kernel(npad: int, descending: bool, block: int) -> kir.Kernel:
    """The indices that sort each row of x, stable: a bitonic sort of the row's npad slots in
    shared memory, each slot (order key << 32 | index), so keys compare as one u64 and ties keep
    the index order; slots past the row hold PAD_KEY and sort last. Writes the first d.ne0."""
    log_npad = npad.bit_length() - 1

    def body(k: kir.KernelBuilder) -> None:
        b, x, d, t = k.b, k.args["x"], k.args["d"], k.tid(0)
        slots = k.shared(I64, npad, "slots")
        row = Row(k, x)
        with k.loop(t, k.i32(npad), block) as i:
            slot = k.var(I64, b.or_(k.i64(PAD_KEY), b.zext(i, I64)))
            with k.if_then(b.icmp_unsigned("<", i, row.n)):
                key = order_key(k, k.load(x.ptr, F32, k.offset(x, *row.coords(k, i))), descending)
                k.set(slot, b.or_(b.shl(b.zext(key, I64), k.i64(32)), b.zext(i, I64)))
            k.sstore(k.get(slot, I64), slots, i)
        k.barrier()
        # stage s merges bitonic runs into sorted runs of 2^s (alternately ascending and descending)
        with k.loop(k.i32(1), k.i32(log_npad + 1)) as stage:
            with k.loop(k.i32(0), stage) as step:
                dist = b.shl(k.i32(1), b.sub(b.sub(stage, k.i32(1)), step))
                with k.loop(t, k.i32(npad // 2), block) as pair:
                    low = b.and_(pair, b.sub(dist, k.i32(1)))
                    i = b.or_(b.shl(b.sub(pair, low), k.i32(1)), low)  # pair with a 0 inserted at bit dist
                    partner = b.or_(i, dist)
                    ascending = b.icmp_unsigned("==", b.and_(i, b.shl(k.i32(1), stage)), k.i32(0))
                    first, second = k.sload(slots, i), k.sload(slots, partner)
                    with k.if_then(b.icmp_unsigned("==", b.icmp_unsigned(">", first, second), ascending)):
                        k.sstore(second, slots, i)
                        k.sstore(first, slots, partner)
                k.barrier()
        with k.loop(t, d.ne[0], block) as i:
            index = b.trunc(k.sload(slots, i), I32)
            k.store(index, d.ptr, k.offset(d, i, row.i1, row.i2, row.i3))

    return kir.define("argsort", (npad, descending, block), (tensor("x"), tensor("d")), block, body)


def _sortable(node) -> bool:
    n = node.inputs[0].type.shape[-1]
    return isinstance(n, int) and 1 <= n <= MAX_SORT


@kernel(ops.Argsort, ops.TopK, supports=_sortable)
def argsort(k, node, srcs, dst) -> None:
    """ggml's argsort (ascending or descending, stable) and top_k (the indices of the k largest,
    largest first, ties by index): one block sorts each row, top_k keeps the first k."""
    (x,) = node.inputs
    n = int(x.type.shape[-1])
    npad = 1 << max(n - 1, 1).bit_length()
    descending = node.is_op(ops.TopK) or node.op.descending
    kern = _argsort_kernel(npad, descending, max(kir.WARP, min(npad // 2, SORT_BLOCK)))
    k.launch(kern, blocks(int(x.type.numel) // n), [(x.type, srcs[0]), (node.type, dst)], name=node.name)
