"""Matrix products: mul_mat and mul_mat_id with f32, f16 and bf16 weights (block-quantized weights
are kernels_quant's), as ggml's CPU computes them: b is first rounded to the weight's
vec_dot_type (f16 for f16, bf16 for bf16; f32 stays f32), so every product is exact in f32.

- mul_mv, up to MV_MAX_COLS columns of b (token generation): one warp per row of a, its lanes
  reading the row in coalesced vectors, every column's dot product summed across the warp.
- mul_mm (matmul_tiles.py), more columns: a tile of d per block, a and b staged through shared
  memory; m16n8k16 tensor-core products for f16 / bf16 weights (b rounded as it is staged),
  register-blocked FMAs for f32 weights.

mul_mat_id reuses both: mul_mv with the expert id read per (token, slot); for more tokens
mul_mat_id_pairs lists on the device, per expert, the (token, slot) pairs that chose it, and
mul_mm computes each expert's rows for BN of its pairs per block.
"""

from __future__ import annotations

from llamir.backends import BackendError, TensorData
from llamir.ir import TensorType, ops, vec_dot_type
from llamir_cuda import kernels_quant, kir
from llamir_cuda.kir import F32, I32, scalar, tensor
from llamir_cuda.lowering import ceil_div, device_ptr, kernel, tensor_args
from llamir_cuda.matmul_tiles import FMA, MMA, VECTOR_BYTES, load_raw, mul_mm_kernel, to_vec_dot, widen

FLOAT_A = ("f32", "f16", "bf16")
FLOAT_B = ("f32", "f16")
MV_MAX_COLS = 8  # b columns up to which mul_mat takes the matrix-vector kernel (as ggml-vulkan)
MV_WARPS = 4  # rows of a per mul_mv block, one per warp
PAIRS_BLOCK = 256
MAX_GRID_YZ = 65535


# -- vector loads ----------------------------------------------------------------------------------
def vector_width(ttype: TensorType, td: TensorData, widest: int) -> int:
    """The most consecutive elements along ne0 (a power of two up to `widest`) that the kernels may
    read as one aligned vector: rows contiguous and whole vectors long, every row starting on a
    vector boundary."""
    args = tensor_args(ttype, td)
    ptr, ne, nb = args[0], args[1:5], args[5:9]
    size = ttype.dtype.type_size
    if ne[0] > 1 and nb[0] != size:
        return 1
    width = widest
    while width > 1 and (ne[0] % width or ptr % (width * size) or
                         any(n > 1 and s % (width * size) for n, s in zip(ne[1:], nb[1:], strict=True))):
        width //= 2
    return width


# -- mul_mv ----------------------------------------------------------------------------------------
def _mv_kernel(ta: str, tb: str, vdt: str, n_cols: int, width: int, b_vector: bool, by_id: bool) -> kir.Kernel:
    """d[row, c] = a[row, :] . b[c, :] for c < n_cols; one warp per row, lane l reading elements
    [width*l, width*l + width) of every 32*width. Grid: (rows / MV_WARPS, then i12, i13 of d), or
    with `by_id` (slot, token) of mul_mat_id's d, whose expert is ids[token, slot]."""
    params = (tensor("a"), tensor("b"), *((tensor("ids"),) if by_id else ()), tensor("d"))

    def body(k: kir.KernelBuilder) -> None:
        b, a, x, d = k.b, k.args["a"], k.args["b"], k.args["d"]
        lane = k.lane()
        row = b.add(b.mul(k.ctaid(0), k.i32(MV_WARPS)), k.warp())
        if by_id:
            slot, token = k.ctaid(1), k.ctaid(2)
            expert = k.load(k.args["ids"].ptr, I32, k.offset(k.args["ids"], slot, token))
            inside = b.and_(b.icmp_signed(">=", expert, k.i32(0)), b.icmp_signed("<", expert, a.ne[2]))
            with k.if_then(b.not_(inside)):
                b.ret_void()  # no expert to read: the reference rejects such ids
            a_row = k.offset(a, None, row, expert)
            b_col = k.offset(x, None, b.srem(slot, x.ne[1]), token)
            d_col = k.offset(d, None, slot, token)
        else:
            i12, i13 = k.ctaid(1), k.ctaid(2)
            i02, i03 = b.sdiv(i12, b.sdiv(x.ne[2], a.ne[2])), b.sdiv(i13, b.sdiv(x.ne[3], a.ne[3]))
            a_row = k.offset(a, None, row, i02, i03)
            b_col, d_col = k.offset(x, None, None, i12, i13), k.offset(d, None, None, i12, i13)
        with k.if_then(b.icmp_signed("<", row, a.ne[1])):  # the whole warp agrees
            sums = _mv_dot(k, a_row, b_col, n_cols, lane, ta, tb, vdt, width, b_vector)
            with k.if_then(b.icmp_unsigned("==", lane, k.i32(0))):
                for c, total in enumerate(sums):
                    col = b.add(d_col, b.mul(k.i64(c), d.nb[1])) if c else d_col
                    k.store(total, d.ptr, b.add(col, k.offset(d, row)))

    key = (ta, tb, vdt, n_cols, width, b_vector, by_id)
    return kir.define("mul_mv_id" if by_id else "mul_mv", key, params, kir.WARP * MV_WARPS, body)


def _mv_dot(k, a_row, b_col, n_cols, lane, ta, tb, vdt, width, b_vector) -> list:
    """Each column's dot product with the row at a_row, summed over the warp (every lane has it)."""
    b, a, x = k.b, k.args["a"], k.args["b"]
    acc = [k.var(F32, k.f32(0.0)) for _ in range(n_cols)]
    with k.loop(b.mul(lane, k.i32(width)), a.ne[0], kir.WARP * width) as k0:
        w = [widen(k, v, ta) for v in load_raw(k, a.ptr, b.add(a_row, k.offset(a, k0)), a.nb[0], ta, width, True)]
        for c in range(n_cols):
            col = b.add(b_col, k.offset(x, k0, k.i32(c)))
            raw = load_raw(k, x.ptr, col, x.nb[0], tb, width, b_vector)
            total = k.get(acc[c], F32)
            for wi, ri in zip(w, raw, strict=True):
                total = k.fma(wi, to_vec_dot(k, ri, tb, vdt), total)
            k.set(acc[c], total)
    return [k.warp_sum(k.get(v, F32)) for v in acc]


def _launch_mv(k, node, args, n_cols: int, grid, by_id: bool) -> None:
    """mul_mv over `grid` (rows of a on x), its vector width from a's and b's layouts."""
    (a_type, a_td), (b_type, b_td) = args[0], args[1]
    width = vector_width(a_type, a_td, VECTOR_BYTES // a_type.dtype.type_size)
    b_vector = vector_width(b_type, b_td, width) == width
    ta, tb = a_type.dtype.name, b_type.dtype.name
    kern = _mv_kernel(ta, tb, vec_dot_type(a_type.dtype).name, n_cols, width, b_vector, by_id)
    k.launch(kern, _checked(grid, node), args, name=node.name)


def _checked(grid: tuple[int, int, int], node) -> tuple[int, int, int]:
    if max(grid[1:]) > MAX_GRID_YZ:
        raise BackendError(f"cuda: {node.name}: grid {grid} exceeds {MAX_GRID_YZ} blocks along y or z")
    return grid


# -- mul_mat_id's pairs per expert -----------------------------------------------------------------
def _pairs_kernel() -> kir.Kernel:
    """For expert e = blockIdx.x: table[e] = how many (token, slot) pairs chose an expert below e,
    table[E + e] = how many chose e, and table[2E + table[e] ...] lists those pairs, p = token *
    n_slots + slot, in order. Every block reads all of ids: a few thousand words, from L2."""

    def body(k: kir.KernelBuilder) -> None:
        b, ids, table = k.b, k.args["ids"], k.args["table"]
        e, n_experts, tid = k.ctaid(0), k.args["n_experts"], k.tid(0)
        n_pairs = b.mul(ids.ne[0], ids.ne[1])

        def expert_of(p):
            inside = b.icmp_signed("<", p, n_pairs)
            q = k.select(inside, p, k.i32(0))
            offset = k.offset(ids, b.srem(q, ids.ne[0]), b.sdiv(q, ids.ne[0]))
            return k.select(inside, k.load(ids.ptr, I32, offset), k.i32(-1))

        below = k.var(I32, k.i32(0))
        with k.loop(tid, n_pairs, PAIRS_BLOCK) as p:
            chose = expert_of(p)
            lower = b.and_(b.icmp_signed(">=", chose, k.i32(0)), b.icmp_signed("<", chose, e))
            k.set(below, b.add(k.get(below, I32), b.zext(lower, I32)))
        first = k.block_reduce(k.get(below, I32), b.add, k.i32(0))
        mine = k.var(I32, k.i32(0))
        list_start = b.add(b.mul(n_experts, k.i32(2)), first)
        with k.loop(k.i32(0), n_pairs, PAIRS_BLOCK) as base:
            p = b.add(base, tid)
            chosen = b.icmp_signed("==", expert_of(p), e)
            before, total = _block_scan(k, b.zext(chosen, I32))
            with k.if_then(chosen):
                slot = b.add(list_start, b.add(k.get(mine, I32), before))
                k.store(p, table, b.mul(slot, k.i32(4)))
            k.set(mine, b.add(k.get(mine, I32), total))
        with k.if_then(b.icmp_unsigned("==", tid, k.i32(0))):
            k.store(first, table, b.mul(e, k.i32(4)))
            k.store(k.get(mine, I32), table, b.mul(b.add(n_experts, e), k.i32(4)))

    params = (tensor("ids"), scalar("table", "p"), scalar("n_experts", "i"))
    return kir.define("mul_mat_id_pairs", (), params, PAIRS_BLOCK, body)


def _block_scan(k: kir.KernelBuilder, x):
    """(the sum of x over the threads before this one, the sum over the block) of an i32: a
    butterfly scan in each warp, then the warps' totals through shared memory."""
    b, lane, warp = k.b, k.lane(), k.warp()
    before, total = k.i32(0), x
    step = 1
    while step < kir.WARP:
        other = k.shfl_xor(total, step)
        upper = b.icmp_unsigned("!=", b.and_(lane, k.i32(step)), k.i32(0))
        before = b.add(before, k.select(upper, other, k.i32(0)))
        total = b.add(total, other)
        step *= 2
    n_warps = PAIRS_BLOCK // kir.WARP
    sums = k.shared(I32, n_warps, "warp_sums")
    with k.if_then(b.icmp_unsigned("==", lane, k.i32(0))):
        k.sstore(total, sums, warp)
    k.barrier()
    block_total = k.i32(0)
    for w in range(n_warps):
        s = k.sload(sums, k.i32(w))
        before = b.add(before, k.select(b.icmp_unsigned("<", k.i32(w), warp), s, k.i32(0)))
        block_total = b.add(block_total, s)
    k.barrier()  # the next scan rewrites the sums
    return before, block_total


# -- registrations ---------------------------------------------------------------------------------
def _float_ok(w: TensorType, b: TensorType) -> bool:
    return w.dtype.name in FLOAT_A and b.dtype.name in FLOAT_B


def _mul_mat_ok(node) -> bool:
    a, b = node.inputs
    return kernels_quant.supports(node) if a.dtype.is_quantized else _float_ok(a.type, b.type)


def _tiled(k, node, args, n_cols: int, n_z: int, by_id: bool) -> None:
    """mul_mm over (tiles of a's rows, tiles of n_cols columns, n_z): tensor cores for f16 / bf16
    weights, FMAs for f32."""
    (a_type, a_td), (b_type, b_td) = args[0], args[1]
    tile = FMA if a_type.dtype.name == "f32" else MMA
    widths = (vector_width(a_type, a_td, tile.unit(a_type.dtype.type_size)),
              vector_width(b_type, b_td, tile.unit(b_type.dtype.type_size)))
    kern = mul_mm_kernel(tile, a_type.dtype.name, b_type.dtype.name, vec_dot_type(a_type.dtype).name, widths, by_id)
    n_rows = tensor_args(a_type, a_td)[2]
    grid = (ceil_div(n_rows, tile.bm), ceil_div(n_cols, tile.bn), n_z)
    k.launch(kern, _checked(grid, node), args, name=node.name)


@kernel(ops.MulMat, supports=_mul_mat_ok)
def mul_mat(k, node, srcs, dst) -> None:
    """ggml_mul_mat: d[i13, i12, n, m] = a[i13 / r3, i12 / r2, m, :] . b[i13, i12, n, :], b in any
    strides. Up to MV_MAX_COLS columns: mul_mv, one block per MV_WARPS rows and batch; more:
    mul_mm, one block per tile of d and batch."""
    a, x = node.inputs
    if a.dtype.is_quantized:
        kernels_quant.lower(k, node, srcs, dst)
        return
    args = [(a.type, srcs[0]), (x.type, srcs[1]), (node.type, dst)]
    n_rows, (n_cols, b2, b3) = tensor_args(*args[0])[2], tensor_args(*args[2])[2:5]
    if n_cols <= MV_MAX_COLS:
        _launch_mv(k, node, args, n_cols, (ceil_div(n_rows, MV_WARPS), b2, b3), by_id=False)
    else:
        _tiled(k, node, args, n_cols, b2 * b3, by_id=False)


def _mul_mat_id_ok(node) -> bool:
    w, b, _ = node.inputs
    return kernels_quant.supports(node) if w.dtype.is_quantized else _float_ok(w.type, b.type)


@kernel(ops.MulMatId, supports=_mul_mat_id_ok)
def mul_mat_id(k, node, srcs, dst) -> None:
    """ggml_mul_mat_id: d[t, i] = as[ids[t, i]] @ b[t, i % n_b] (as [E, M, K], b [T, n_b, K], ids
    [T, k], d [T, k, M]). Up to MV_MAX_COLS tokens: mul_mv per (MV_WARPS rows, slot, token); more:
    mul_mat_id_pairs, then mul_mm per (tile of rows, BN pairs, expert), blocks past an expert's
    pairs returning at once."""
    w, x, ids = node.inputs
    if w.dtype.is_quantized:
        kernels_quant.lower(k, node, srcs, dst)
        return
    _, n_rows, n_experts = tensor_args(w.type, srcs[0])[1:4]
    n_slots, n_tokens = tensor_args(ids.type, srcs[2])[1:3]
    if n_tokens <= MV_MAX_COLS:
        args = [(w.type, srcs[0]), (x.type, srcs[1]), (ids.type, srcs[2]), (node.type, dst)]
        _launch_mv(k, node, args, 1, (ceil_div(n_rows, MV_WARPS), n_slots, n_tokens), by_id=True)
        return
    n_pairs = n_slots * n_tokens
    table = device_ptr(k.scratch(4 * (2 * n_experts + n_pairs)))
    k.launch(_pairs_kernel(), (n_experts, 1, 1), [(ids.type, srcs[2]), table, n_experts], name=node.name)
    args = [(w.type, srcs[0]), (x.type, srcs[1]), (node.type, dst), table]
    _tiled(k, node, args, n_pairs, n_experts, by_id=True)
