"""flash_attn_ext as ggml's CPU backend computes it (ggml-cpu/ops.cpp), bit for bit per profile.

ggml takes one of three paths, decided by the shapes, the KV types and the thread count:
- one_chunk (fewer than 64 query rows, or quantized / mixed K and V): per query row, q is rounded
  to K's vec_dot_type and every cell's score is one ggml_vec_dot; the online softmax walks the
  cells in order (cells whose mask is -inf are skipped), M and S updated with glibc's expf, and V
  accumulated with ggml_vec_mad_f16 (in f16, for an f16 V) or ggml_vec_mad_f32;
- tiled (64+ query rows, K and V both f16 or both f32): 64 x 64 tiles, q in f32, scores and V
  products as sequential fma chains (simd_gemm), each tile's softmax by ggml_vec_soft_max_f32;
- split KV (one query row, one stream, f16/f32 K = V type, 512+ cells): the cells are cut into
  one chunk per thread, each run as one_chunk, and the partial (M, S, VKQ) combined in order.
Each query row's result depends only on its own path, so rows are computed together here.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from llamir.ir import float_x86, ggml_math, ops
from llamir.ir.dtypes import BF16, F16, F32, DType
from llamir.ir.interp_kernels import _in, f32, f32_to_bf16, kernel, to_f32
from llamir.ir.numerics import Numerics

TILE = 64            # GGML_FA_TILE_Q = GGML_FA_TILE_KV
SPLIT_KV_MIN = 512   # cells from which a one-row decode splits the cells over the threads
f64 = np.float64


def _expf(x) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        return ggml_math.expf(np.asarray(x, dtype=f32))


def kq_dots(k: np.ndarray, k_dtype: DType, q: np.ndarray, numerics: Numerics) -> np.ndarray:
    """[rows, n] scores of q rows f32 [rows, dk] against K rows [n, dk] (storage), as ggml's
    kq_vec_dot: q converted by from_float to K's vec_dot_type, then one vec_dot per pair."""
    from llamir.ir import quants_x86

    if k_dtype == F16:
        return float_x86.vec_dots(k, q.astype(np.float16), numerics)
    if k_dtype == BF16:
        return float_x86.vec_dots(k, f32_to_bf16(q), numerics)
    if k_dtype == F32:
        return float_x86.vec_dots(k, q, numerics)
    return quants_x86.mul_mat_exact(quants_x86.prepare(k, k_dtype), k_dtype, q)   # a KV cache is never repacked


@dataclasses.dataclass
class _Rows:
    """The online-softmax state of a set of query rows: running max, sum, and V accumulator."""

    M: np.ndarray          # [R, 1] f32
    S: np.ndarray          # [R, 1] f32
    acc: np.ndarray        # [R, dv] f32 or f16 (ggml's VKQ16 for an f16 V)

    @classmethod
    def start(cls, n_rows: int, dv: int, f16_acc: bool) -> _Rows:
        return cls(np.full((n_rows, 1), -np.inf, dtype=f32), np.zeros((n_rows, 1), dtype=f32),
                   np.zeros((n_rows, dv), dtype=np.float16 if f16_acc else f32))


def _one_chunk(scores: np.ndarray, mask: np.ndarray | None, v: np.ndarray, cells: range, scale: f32,
               softcap: float, rows: _Rows) -> None:
    """ggml_compute_forward_flash_attn_ext_f16_one_chunk's cell loop over `cells` for every row:
    scores [R, n] raw dots, mask [R, n] slope*mask (or None), v [n, dv] f32 values.

    The scores, the running maximum and both expf of every cell depend on the scores alone, so
    they are computed for all cells at once (element-wise: the same bits as cell by cell); only
    the sum S and the accumulator, rounded after every cell, are walked cell by cell."""
    f16_acc = rows.acc.dtype == np.float16
    sl = slice(cells.start, cells.stop)
    n_rows = scores.shape[0]
    mv = mask[:, sl] if mask is not None else np.zeros((n_rows, len(cells)), dtype=f32)
    live = mv != -np.inf
    with np.errstate(invalid="ignore", over="ignore"):
        if softcap:
            s = f32(softcap) * ggml_math.tanhf(scores[:, sl] * scale) + mv
        else:   # s = s*scale; s += mv: GCC fuses the two into one fma
            s = ggml_math.fma(scores[:, sl], scale, mv)
        # M before each cell: the running maximum of the live scores (a NaN score never grows it)
        running = np.fmax.accumulate(np.concatenate([rows.M, np.where(live, s, -np.inf)], axis=1), axis=1)
        before = running[:, :-1]
        grow = live & (s > before)
        ms_all = np.where(grow, _expf(before - s), f32(1))
        vs_all = np.where(grow | ~live, f32(1), _expf(s - before))
        rows.M = running[:, -1:].astype(f32)
        for i in np.flatnonzero(live.any(axis=0)):
            c = cells.start + i
            g, lv, ms, vs = grow[:, i:i + 1], live[:, i:i + 1], ms_all[:, i:i + 1], vs_all[:, i:i + 1]
            acc = rows.acc.astype(f32)
            if f16_acc:   # ggml_vec_scale_f16, then ggml_vec_mad_f16: each result rounded to f16
                acc = np.where(g, (acc * ms).astype(np.float16).astype(f32), acc)
                new = ggml_math.fma(v[c], vs, acc).astype(np.float16)
            else:
                acc = np.where(g, acc * ms, acc)
                new = ggml_math.fma(v[c], vs, acc)
            rows.acc = np.where(lv, new, rows.acc)
            rows.S = np.where(lv, ggml_math.fma(rows.S, ms, vs), rows.S)


def _sinks(rows: _Rows, sinks: np.ndarray, acc: np.ndarray, fused: bool) -> np.ndarray:
    """The sink logit of each row's head joins the softmax after the cells; returns the scaled acc.
    S = S*ms + vs is one fma in the tiled kernel, two roundings in one_chunk (as GCC compiled them)."""
    big = sinks > rows.M
    with np.errstate(invalid="ignore", over="ignore"):
        ms = np.where(big, _expf(rows.M - sinks), f32(1))
        vs = np.where(big, f32(1), _expf(sinks - rows.M))
    rows.S = ggml_math.fma(rows.S, ms, vs) if fused else rows.S * ms + vs
    rows.M = np.where(big, sinks, rows.M)   # one_chunk's M (a split-KV partial keeps it)
    return np.where(big, acc * ms, acc)


def _finish(S: np.ndarray, acc: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        inv = np.where(S == 0, f32(0), f32(1) / S)
    return acc * inv


def _tiled(q: np.ndarray, k32: np.ndarray, v32: np.ndarray, mask: np.ndarray | None, scale: f32,
           softcap: float, sinks: np.ndarray | None, numerics: Numerics) -> np.ndarray:
    """ggml_compute_forward_flash_attn_ext_tiled for rows q [R, dk] of one KV head: k32 [n, dk],
    v32 [n, dv] as f32, mask [R, n] (slope*mask) or None. Returns [R, dv]."""
    n_rows, dk = q.shape
    n_kv, dv = k32.shape[0], v32.shape[1]
    M = np.full((n_rows, 1), -np.inf, dtype=f32)
    S = np.zeros((n_rows, 1), dtype=f32)
    acc = np.zeros((n_rows, dv), dtype=f32)
    with np.errstate(invalid="ignore", over="ignore"):
        # simd_gemm: one fma chain per score; every tile's chains at once (each score's chain alone
        # decides its bits)
        kq_all = np.zeros((n_rows, n_kv), dtype=f32)
        for d in range(dk):
            kq_all = ggml_math.fma(q[:, d:d + 1], k32[None, :, d], kq_all)
        for ic in range(0, n_kv, TILE):
            width = min(TILE, n_kv - ic)
            kq = np.zeros((n_rows, TILE), dtype=f32)
            kq[:, :width] = kq_all[:, ic:ic + width]
            kq = kq * scale
            if softcap:
                kq = ggml_math.tanhf(kq) * f32(softcap)
            kq[:, width:] = -np.inf
            if mask is not None:
                kq[:, :width] = kq[:, :width] + mask[:, ic:ic + width]
            tile_max = np.max(kq, axis=-1, keepdims=True)
            live = tile_max != -np.inf
            m_new = np.fmax(M, tile_max)
            grow = live & (m_new > M)
            ms = np.where(grow, _expf(M - m_new), f32(1))
            acc = np.where(grow, acc * ms, acc)
            S = np.where(grow, S * ms, S)
            M = np.where(live, m_new, M)
            e, total = ggml_math.vec_soft_max(kq, M, numerics)
            e = np.where(live, e, f32(0))
            S = np.where(live, (S.astype(f64) + total).astype(f32), S)
            for t in range(width):                    # VKQ += softmax(KQ) V, one fma chain per value
                acc = ggml_math.fma(e[:, t:t + 1], v32[None, ic + t], acc)
    if sinks is not None:
        rows = _Rows(M, S, acc)
        acc = _sinks(rows, sinks, acc, fused=True)
        S = rows.S
    return _finish(S, acc)


def _split_kv(scores: np.ndarray, mask: np.ndarray | None, v32: np.ndarray, f16_acc: bool, scale: f32,
              softcap: float, sinks: np.ndarray | None, n_threads: int) -> np.ndarray:
    """One query row per head over cells cut into n_threads chunks, each a one_chunk partial,
    combined as ggml_flash_attn_ext_reduce_partials does (sinks join chunk 0's partial)."""
    n_rows, n_kv = scores.shape
    chunk = -(-n_kv // n_threads)
    M_final = np.full((n_rows, 1), -np.inf, dtype=f32)
    S_final = np.zeros((n_rows, 1), dtype=f32)
    acc_final = np.zeros((n_rows, v32.shape[1]), dtype=f32)
    for c0 in range(0, n_kv, chunk):
        rows = _Rows.start(n_rows, v32.shape[1], f16_acc)
        _one_chunk(scores, mask, v32, range(c0, min(c0 + chunk, n_kv)), scale, softcap, rows)
        acc = rows.acc.astype(f32)
        if sinks is not None and c0 == 0:
            acc = _sinks(rows, sinks, acc, fused=False)
        with np.errstate(invalid="ignore", over="ignore"):
            m_new = np.fmax(M_final, rows.M)
            scale_old, scale_new = _expf(M_final - m_new), _expf(rows.M - m_new)
            used = rows.S != 0
            acc_final = np.where(used, ggml_math.fma(acc_final, scale_old, acc * scale_new), acc_final)
            S_final = np.where(used, ggml_math.fma(S_final, scale_old, rows.S * scale_new), S_final)
            M_final = np.where(used, m_new, M_final)
    with np.errstate(divide="ignore"):
        return np.where(S_final != 0, acc_final * (f32(1) / S_final), acc_final)


def _mask_of(mask: np.ndarray | None, s: int, h: int, n_tok: int, slope: f32) -> np.ndarray | None:
    """slope * mask for the rows of stream s, head h (mask [S', H', T', n], broadcast)."""
    if mask is None:
        return None
    m = mask[s % mask.shape[0], h % mask.shape[1], :n_tok]
    return (slope * m).astype(f32)


@kernel(ops.FlashAttnExt)
def _flash_attn(ctx, node, args, bindings):
    """See the module docstring; y [S, T, H, dv]."""
    from llamir.ir.interp_nn import alibi_slopes

    op = node.op
    q, k, v = args[:3]
    rest = list(args[3:])
    k_dtype, v_dtype = _in(node, 1), _in(node, 2)
    mask = to_f32(rest.pop(0), _in(node, 3)) if op.mask else None
    sinks = rest.pop(0).astype(f32) if op.sinks else None
    n_s, n_head, n_tok, _ = q.shape
    n_kv, dv = k.shape[2], node.type.evaluate(bindings)[-1]
    group = n_head // k.shape[1]
    scale = f32(op.scale / op.logit_softcap) if op.logit_softcap else f32(op.scale)
    slopes = alibi_slopes(n_head, op.max_bias)
    floats = k_dtype in (F16, F32) and k_dtype == v_dtype
    split = floats and n_tok == 1 and n_s == 1 and n_kv >= SPLIT_KV_MIN
    tiled = floats and n_tok >= TILE
    out = np.empty((n_s, n_tok, n_head, dv), dtype=f32)
    for s in range(n_s):
        for kh in range(k.shape[1]):
            k_rows = k[s, kh]
            v32 = to_f32(v[s, kh], v_dtype) if v_dtype != F32 else v[s, kh]
            for h in range(kh * group, (kh + 1) * group):
                m = _mask_of(mask, s, h, n_tok, slopes[h])
                sink = None if sinks is None else np.full((n_tok, 1), sinks[h], dtype=f32)
                if tiled:
                    y = _tiled(q[s, h], to_f32(k_rows, k_dtype), v32, m, scale, op.logit_softcap, sink, ctx.numerics)
                else:
                    scores = kq_dots(k_rows, k_dtype, q[s, h], ctx.numerics)
                    if split:
                        y = _split_kv(scores, m, v32, v_dtype == F16, scale, op.logit_softcap, sink, ctx.n_threads)
                    else:
                        rows = _Rows.start(n_tok, dv, v_dtype == F16)
                        _one_chunk(scores, m, v32, range(n_kv), scale, op.logit_softcap, rows)
                        acc = rows.acc.astype(f32)
                        if sink is not None:
                            acc = _sinks(rows, sink, acc, fused=False)
                        y = _finish(rows.S, acc)
                out[s, :, h] = y
    return out
