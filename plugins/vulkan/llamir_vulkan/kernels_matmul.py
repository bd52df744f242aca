"""Matrix kernels: mul_mat, mul_mat_id and get_rows, for f32 / f16 / bf16 and every GGUF block type
test-backend-ops uses as a weight (shaders/dequant.glsl dequantizes them).

mul_mat takes the matrix-vector shader (mul_mv.comp) for a few columns of b, the token-generation
path, and the tiled one (mul_mm.comp) for batches of tokens, as ggml-vulkan does. A src0 larger
than one storage-buffer binding (maxStorageBufferRange) is bound in pieces: whole batch matrices
when one fits, else row ranges of one matrix; each piece is one dispatch writing its slice of the
result (views of b and d for the batches that piece serves, its columns of d).

The products see b as ggml's CPU mul_mat does: converted to the weight's vec_dot_type first
(llamir/ir/quants.py: q8_0 for q4_0 / q5_0 / q8_0, q8_1 for q4_1 / q5_1, q8_K for the K-quants,
f16 for f16, bf16 for bf16; f32 stays f32). quantize_b.comp writes that conversion, bit for bit
cpu_from_float's, into scratch memory, and the matrix shaders read it through mul_b.glsl; for
q4_1 / q5_1 the block's min enters as m * s_b with the q8_1 block's stored s_b, as in
ggml's vec_dot_q4_1_q8_1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llamir.backends import BackendError, TensorData
from llamir.ir import DType, TensorType, geometry, ops, vec_dot_type
from llamir_vulkan.lowering import Params, float_type, groups_for, kernel, unit_of

A_TYPES = ("f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k")
TILE = {"BM": 64, "BN": 64, "BK": 32, "TM": 8, "TN": 4}  # mul_mm: a BM x BN tile, TM x TN per thread
TILE_WG = (TILE["BM"] // TILE["TM"]) * (TILE["BN"] // TILE["TN"])
MV_WG = 32  # a warp on NVIDIA (16 is about 15% faster on lavapipe)
MV_ROWS = 16  # rows of a per mul_mv workgroup
MV_MAX_COLS = 8  # b columns (tokens) up to which mul_mat takes the matrix-vector shader
ROWS_WG = 256
QUANTIZE_WG = 64
SPLIT_MIN = ("q4_1", "q5_1")  # weights whose block min enters as m * s_b (b in q8_1)


@dataclass(frozen=True)
class _Tensor:
    """A kernel operand as four logical axes (numpy order, padded in front with 1s) over its
    storage; `strides` are TensorData's byte strides (a quantized row's last one is a byte)."""

    dtype: DType
    td: TensorData
    shape: tuple[int, int, int, int]
    strides: tuple[int, int, int, int]

    @classmethod
    def of(cls, ttype: TensorType, td: TensorData) -> _Tensor:
        """The operand of logical type `ttype` (its dims read off the storage, so concrete)."""
        dtype = ttype.dtype
        shape = tuple(td.shape)
        if dtype.is_quantized:
            shape = shape[:-1] + (shape[-1] // dtype.type_size * dtype.block_size,)
        pad = 4 - len(shape)
        outer = td.strides[0] * shape[0]
        strides = (outer,) * pad + tuple(td.strides)
        td = TensorData(td.buffer, td.offset, (1,) * pad + tuple(td.shape), td.dtype, strides, td.nbytes)
        return cls(dtype, td, (1,) * pad + shape, strides)

    def row_nbytes(self) -> int:
        """The byte extent of one row."""
        n = self.shape[3]
        if self.dtype.is_quantized:
            return self.dtype.row_bytes(n)
        return (n - 1) * self.strides[3] + self.td.dtype.itemsize if n else 0

    def nbytes(self) -> int:
        """The byte extent from the first element to the end of the last."""
        if 0 in self.shape:
            return 0
        return sum((n - 1) * s for n, s in zip(self.shape[:3], self.strides[:3], strict=True)) + self.row_nbytes()

    def view(self, start: tuple[int, ...], shape: tuple[int, ...]) -> _Tensor:
        """The sub-tensor of `shape` at `start` (element indices; a quantized row is never cut)."""
        offset = self.td.offset + sum(i * s for i, s in zip(start, self.strides, strict=True))
        sub = _Tensor(self.dtype, self.td, tuple(shape), self.strides)  # for its extents
        storage = tuple(shape[:3]) + ((sub.row_nbytes(),) if self.dtype.is_quantized else (shape[3],))
        td = TensorData(self.td.buffer, offset, storage, self.td.dtype, self.strides, sub.nbytes())
        return _Tensor(self.dtype, td, sub.shape, self.strides)

    def arg(self, written: bool = False) -> tuple[TensorType, TensorData, bool]:
        """The operand as Lowering.dispatch takes it."""
        return TensorType(self.shape, self.dtype), self.td, written


def _pieces(k, a: _Tensor) -> list[tuple[tuple[int, int], tuple[int, int], tuple[int, int]]]:
    """How to bind src0: ranges of its axes 0 and 1 (the batch axes) and of its rows, each range
    triple a window that fits one binding. All of it when it fits; else runs of whole matrices
    along axis 1; else row ranges of one matrix."""
    limit, align = k.info.max_storage_range, k.info.min_storage_alignment
    n3, n2, rows, _ = a.shape
    if a.td.offset % align + max(a.td.nbytes, 1) <= limit:
        return [((0, n3), (0, n2), (0, rows))]
    budget = limit - align  # a window starts up to `align` bytes before its first element
    matrix = (rows - 1) * a.strides[2] + a.row_nbytes()
    if matrix <= budget:
        per = 1 + (budget - matrix) // max(a.strides[1], 1)
        return [((i3, i3 + 1), (j, min(j + per, n2)), (0, rows)) for i3 in range(n3) for j in range(0, n2, per)]
    row = a.row_nbytes()
    if row > budget:
        raise BackendError(f"vulkan: a {row}-byte row of {a.dtype} exceeds {k.info.name}'s "
                           f"maxStorageBufferRange ({limit} bytes)")
    per = 1 + (budget - row) // max(a.strides[2], 1)
    return [((i3, i3 + 1), (j, j + 1), (r, min(r + per, rows)))
            for i3 in range(n3) for j in range(n2) for r in range(0, rows, per)]


def _vec4(k, t: _Tensor) -> bool:
    """Whether a float operand's rows can be read as vec4s: contiguous, whole vec4s long, and
    every row starting on a 4-element boundary of its binding."""
    if t.dtype.name not in ("f32", "f16"):
        return False
    size = 4 * t.td.dtype.itemsize
    return t.strides[3] == t.td.dtype.itemsize and t.shape[3] % 4 == 0 and \
        all(s % size == 0 for n, s in zip(t.shape[:3], t.strides[:3], strict=True) if n > 1) and \
        t.td.offset % k.info.min_storage_alignment % size == 0


def _ab_defines(k, a: _Tensor, b: _Tensor | None = None) -> dict:
    """The dequant.glsl defines of src0 (and, for a matmul, mul_b.glsl's of b and A_SPLIT_MIN)."""
    defines = {f"A_{a.dtype.name.upper()}": 1, "A_UNIT": unit_of(TensorType(a.shape, a.dtype))}
    if _vec4(k, a):
        defines["A_VEC4"] = 1
    if b is not None:
        defines[f"B_{b.dtype.name.upper()}"] = 1
        if _vec4(k, b):
            defines["B_VEC4"] = {"f32": "vec4", "f16": "f16vec4"}[b.dtype.name]
        if a.dtype.name in SPLIT_MIN:
            defines["A_SPLIT_MIN"] = 1
    return defines


def _vec_dot_b(k, a_dtype: DType, b: _Tensor, name: str) -> _Tensor:
    """b as the matrix shaders read it: in the weight's vec_dot_type, as ggml's CPU mul_mat
    converts it. b itself when it already is (or the type is f32: an f16 b widens exactly), else
    quantize_b's conversion into scratch memory, contiguous rows."""
    vdt = vec_dot_type(a_dtype)
    if vdt == b.dtype or vdt.name == "f32":
        return b
    *batch, n_k = b.shape
    rows = int(np.prod(batch))
    quantized = vdt.is_quantized
    np_dtype = np.dtype(np.uint8) if quantized else geometry.storage_dtype(vdt)
    row = vdt.row_bytes(n_k) if quantized else n_k * np_dtype.itemsize
    strides = (batch[1] * batch[2] * row, batch[2] * row, row, np_dtype.itemsize)
    scratch = k.scratch(rows * row)
    td = TensorData(scratch.buffer, scratch.offset, (*batch, row if quantized else n_k), np_dtype, strides, rows * row)
    q = _Tensor(vdt, td, b.shape, strides)
    if quantized:
        defines, threads = {f"QUANT_{vdt.name.upper()}": 1}, rows * (n_k // vdt.block_size)
    else:
        defines, threads = {f"QB_{vdt.name.upper()}": 1}, rows * n_k
    defines.update({"A_TYPE": float_type(b.dtype), "LOAD_A": "float", "WG": QUANTIZE_WG})
    k.dispatch("quantize_b", defines, [b.arg(), q.arg(True)], None, groups_for(_ceil(threads, QUANTIZE_WG)), name)
    return q


def _ceil(n: int, d: int) -> int:
    return -(-n // d)


def _mv_defines(k, n: int, a: _Tensor, b: _Tensor) -> dict:
    """mul_mv's defines for n columns of b; MV_WORDS (whole-word reads, mul_mv_words.glsl) for a
    quantized a when both bindings are whole words long (their blocks are at least 2-byte aligned)."""
    defines = {"NCOLS": n, "ROWS": MV_ROWS, "WG": MV_WG}
    if a.dtype.is_quantized and all(k.bind(t.td).range % 4 == 0 for t in (a, b)):
        defines["MV_WORDS"] = 1
    return defines


def _mul_mat_ok(node) -> bool:
    a, b = node.inputs
    return a.dtype.name in A_TYPES and b.dtype.name in ("f32", "f16")


@kernel(ops.MulMat, supports=_mul_mat_ok, splits_src0=True)
def mul_mat(k, node, srcs, dst) -> None:
    """ggml_mul_mat: d[..., n, m] = sum_k a[..., m, k] * b[..., n, k], a's batches broadcast into
    b's; b (f32 or f16, any strides) is seen in a's vec_dot_type (_vec_dot_b). Up to MV_MAX_COLS
    columns of b: mul_mv, one workgroup per MV_ROWS rows of a and batch; more: mul_mm, one
    workgroup per BM x BN tile of d and batch."""
    a_in, b_in = node.inputs
    a, b, d = _Tensor.of(a_in.type, srcs[0]), _Tensor.of(b_in.type, srcs[1]), _Tensor.of(node.type, dst)
    if 0 in d.shape:
        return
    b = _vec_dot_b(k, a.dtype, b, node.name)
    r3, r2 = b.shape[0] // a.shape[0], b.shape[1] // a.shape[1]
    n, kk = b.shape[2], a.shape[3]
    for (c0, c1), (j0, j1), (m0, m1) in _pieces(k, a):
        av = a.view((c0, j0, m0, 0), (c1 - c0, j1 - j0, m1 - m0, kk))
        bv = b.view((c0 * r3, j0 * r2, 0, 0), ((c1 - c0) * r3, (j1 - j0) * r2, n, kk))
        dv = d.view((c0 * r3, j0 * r2, 0, m0), ((c1 - c0) * r3, (j1 - j0) * r2, n, m1 - m0))
        batches = bv.shape[0] * bv.shape[1]
        if n <= MV_MAX_COLS:
            shader, defines = "mul_mv", _mv_defines(k, n, av, bv)
            groups = _ceil(m1 - m0, MV_ROWS) * batches
        else:
            shader, defines = "mul_mm", {**TILE, "WG": TILE_WG}
            groups = _ceil(m1 - m0, TILE["BM"]) * _ceil(n, TILE["BN"]) * batches
        k.dispatch(shader, {**defines, **_ab_defines(k, av, bv)}, [av.arg(), bv.arg(), dv.arg(True)], None,
                   groups_for(groups), node.name)


def _mul_mat_id_ok(node) -> bool:
    w, b, _ = node.inputs
    return w.dtype.name in A_TYPES and b.dtype.name in ("f32", "f16")


@kernel(ops.MulMatId, supports=_mul_mat_id_ok, splits_src0=True)
def mul_mat_id(k, node, srcs, dst) -> None:
    """ggml_mul_mat_id: d[t, i] = as[ids[t, i]] @ b[t, i % n_b] (as [E, M, K], b [T, n_b, K], ids
    [T, k], d [T, k, M]). Up to MV_MAX_COLS tokens: mul_mv per (MV_ROWS rows, token, slot); more:
    mul_mm per (BM-row tile, expert), gathering the pairs that chose that expert as its columns. A
    piece of `as` holds experts expert_base.. (or rows of one); pairs choosing another are left
    to another dispatch."""
    w_in, b_in, ids_in = node.inputs
    w, b = _Tensor.of(w_in.type, srcs[0]), _Tensor.of(b_in.type, srcs[1])
    ids, d = _Tensor.of(ids_in.type, srcs[2]), _Tensor.of(node.type, dst)
    if 0 in d.shape:
        return
    b = _vec_dot_b(k, w.dtype, b, node.name)
    _, n_tok, n_slot, _ = d.shape
    for _, (e0, e1), (m0, m1) in _pieces(k, w):
        wv = w.view((0, e0, m0, 0), (1, e1 - e0, m1 - m0, w.shape[3]))
        dv = d.view((0, 0, 0, m0), (1, n_tok, n_slot, m1 - m0))
        if n_tok <= MV_MAX_COLS:
            shader, defines = "mul_mv", _mv_defines(k, 1, wv, b)
            groups = _ceil(m1 - m0, MV_ROWS) * n_tok * n_slot
        else:
            shader, defines = "mul_mm", {**TILE, "WG": TILE_WG}
            groups = _ceil(m1 - m0, TILE["BM"]) * (e1 - e0)
        k.dispatch(shader, {**defines, **_ab_defines(k, wv, b), "MUL_MAT_ID": 1},
                   [wv.arg(), b.arg(), ids.arg(), dv.arg(True)], Params().u32(e0), groups_for(groups), node.name)


def _get_rows_ok(node) -> bool:
    return node.inputs[0].dtype.name in (*A_TYPES, "i32")


@kernel(ops.GetRows, supports=_get_rows_ok, splits_src0=True)
def get_rows(k, node, srcs, dst) -> None:
    """ggml_get_rows: d[..., i, :] = a[..., idx[..., i], :] dequantized to f32 (i32 copied), a
    [B3, B2, R, C] with idx [B3, B2, N]. One thread per four elements of d; a piece of a holds
    rows row_base.. and indices outside it are left to another dispatch."""
    a_in, idx_in = node.inputs
    a, idx, d = _Tensor.of(a_in.type, srcs[0]), _Tensor.of(idx_in.type, srcs[1]), _Tensor.of(node.type, dst)
    if 0 in d.shape:
        return
    n, c = idx.shape[3], a.shape[3]
    for (c0, c1), (j0, j1), (r0, r1) in _pieces(k, a):
        av = a.view((c0, j0, r0, 0), (c1 - c0, j1 - j0, r1 - r0, c))
        defines = {"A_I32": 1} if a.dtype.name == "i32" else _ab_defines(k, av)
        iv = idx.view((0, c0, j0, 0), (1, c1 - c0, j1 - j0, n))
        dv = d.view((c0, j0, 0, 0), (c1 - c0, j1 - j0, n, c))
        threads = _ceil(c, 4) * (c1 - c0) * (j1 - j0) * n
        k.dispatch("get_rows", {**defines, "WG": ROWS_WG}, [av.arg(), iv.arg(), dv.arg(True)], Params().u32(r0),
                   groups_for(_ceil(threads, ROWS_WG)), node.name)
