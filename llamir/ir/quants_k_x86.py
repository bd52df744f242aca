"""ggml's x86 K-quant matmuls (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K weights x Q8_K activations), bit for bit.

Four kernels compute them, each with its own float order (the integer sums are exact in all):

- ggml_vec_dot_qN_K_q8_K (arch/x86/quants.c, the __AVX2__ code; AVX-512 builds compile the same
  code): per 256-value super-block, 8 int32 lanes, lane l summing sc*q*q8 over the values e with
  (e % 32) // 4 == l; d = d_x * d_w; acc_l = fma(d, lane_l, acc_l); hsum_float_8 at the end. The
  mins enter per type: Q2_K fmas them into the same lanes before the super-block's sum, Q4_K keeps
  4 lanes of their own, Q5_K one float (GCC fuses `summs += dmin * int`); Q6_K subtracts
  32 * sc * bsums in integers.
- the tiled matmul (ggml-cpu/tiled, both builds; taken over vec_dot from 8 activation rows on):
  per super-block one integer sum s1 and one min sum s2, res = fma(-dmin, s2, d * s1),
  y = fma(res, d_x, y).
- the CPU_REPACK gemv (ggml_gemv_q4_K/q2_K_8x8_q8_K, arch/x86/repack.cpp): one integer sum per
  (output, super-block): acc = fma(isum, d_w * d_x, acc); minus the same for the mins.
- the CPU_REPACK gemm (4 activation rows at a time): the same, but one fma per 64 values (Q4_K)
  or 128 values (Q2_K); its activations come from ggml_quantize_mat_q8_K_4x8, which takes the
  positive sign when +amax and -amax are both in a super-block (the reference takes the first).

The integer sums are float32 matmuls of small integers, exact because every partial sum stays
below 2^24 (activations are split as 16*hi + lo where a full product could exceed it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from llamir.ir import quants
from llamir.ir.dtypes import Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, DType
from llamir.ir.ggml_math import fma

f32, f64 = np.float32, np.float64
QK_K = 256
K_TYPES = frozenset({Q2_K.name, Q3_K.name, Q4_K.name, Q5_K.name, Q6_K.name})
_EXACT_F32 = 1 << 24
_TILE = 1 << 21          # elements of an [N, M, lanes] float tile processed at once
TILED_MIN_ROWS = 8       # ggml_tiled_min_batch
_GEMM_SPAN = {Q4_K.name: 64, Q2_K.name: 128}   # values per fma in the repacked gemm


@dataclass
class KWeight:
    """A K-quant weight [M, K] split into integers and scales; matmul layouts are built on first use."""

    dtype: DType
    wq: np.ndarray              # int32 [M, nb, 256]: sc * q per value (Q6_K: q unsigned 0..63)
    d: np.ndarray               # f32 [M, nb]: the super-block's fp16 d
    dmin: np.ndarray | None     # f32 [M, nb]: fp16 dmin (Q2_K, Q4_K, Q5_K)
    mins: np.ndarray | None     # int32 [M, nb, S]: the sub-block mins (Q6_K: its int8 scales)
    _layouts: dict = field(default_factory=dict, repr=False)

    @property
    def m_rows(self) -> int:
        return self.wq.shape[0]

    @property
    def nb(self) -> int:
        return self.wq.shape[1]

    def layout(self, kind: str, span: int = 0) -> tuple[np.ndarray, int]:
        """float32 weights for the batched matmuls (exact integers) and their largest magnitude.

        "lanes": [nb*8, 32, M], batch (b, l) holding values 32j + 4l + t;
        "span":  [nb*256/span, span, M], batch c holding values c*span ... (c+1)*span - 1."""
        key = (kind, span)
        hit = self._layouts.get(key)
        if hit is None:
            m = self.m_rows
            if kind == "lanes":
                w = self.wq.reshape(m, self.nb, 8, 8, 4).transpose(1, 3, 2, 4, 0).reshape(self.nb * 8, 32, m)
            else:
                w = self.wq.reshape(m, -1, span).transpose(1, 2, 0)
            hit = self._layouts[key] = (np.ascontiguousarray(w, dtype=f32), int(np.abs(self.wq).max(initial=0)))
        return hit


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[..., offset:offset + 2]).view(np.float16)[..., 0].astype(f32)


def prepare(a_raw: np.ndarray, dtype: DType) -> KWeight:
    """Split a [M, row_bytes] K-quant weight into the integers and scales its dot products use."""
    if dtype.name not in K_TYPES:
        raise ValueError(f"quants_k_x86.prepare: {dtype} is not a K-quant type ({', '.join(sorted(K_TYPES))})")
    a_raw = np.ascontiguousarray(a_raw)
    if a_raw.dtype != np.uint8 or a_raw.ndim != 2 or a_raw.shape[1] % dtype.type_size:
        raise ValueError(f"a {dtype} weight must be uint8 bytes [M, row_bytes] of whole {dtype.type_size}-byte "
                         f"blocks, got {a_raw.dtype} {a_raw.shape}")
    m = a_raw.shape[0]
    b = a_raw.reshape(-1, dtype.type_size)
    i32 = np.int32
    dmin = mins = None
    if dtype == Q2_K:
        sc = b[:, 0:16]
        q = quants._crumbs(b[:, 16:80]).astype(i32)                            # [nb, 16, 16]
        wq = (sc & 0xF).astype(i32)[:, :, None] * q
        d, dmin, mins = _f16(b, 80), _f16(b, 82), (sc >> 4).astype(i32)
    elif dtype == Q3_K:
        hm = ((b[:, None, 0:32] >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1).reshape(-1, 16, 16)
        q = quants._crumbs(b[:, 32:96]).astype(i32) - 4 * (1 - hm.astype(i32))  # -4..3
        wq = (quants._q3_k_scales(b[:, 96:108]) - 32)[:, :, None] * q
        d = _f16(b, 108)
    elif dtype in (Q4_K, Q5_K):
        sc, mn = quants.k4_scales_mins(b[:, 4:16])
        qs = 16 if dtype == Q4_K else 48
        q = quants._nibble_pairs(b[:, qs:qs + 128]).astype(i32)                # [nb, 8, 32]
        if dtype == Q5_K:
            q = q + 16 * ((b[:, None, 16:48] >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1)
        wq = sc.astype(i32)[:, :, None] * q
        d, dmin, mins = _f16(b, 0), _f16(b, 2), mn.astype(i32)
    else:
        ql = b[:, 0:128].reshape(-1, 2, 2, 32)
        low = np.concatenate([ql & 0x0F, ql >> 4], axis=2)
        qh = (b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
        q = (low | (qh << 4)).reshape(-1, 16, 16).astype(i32)                  # unsigned 0..63
        mins = b[:, 192:208].view(np.int8).astype(i32)                         # the scales, for 32*sc*bsum
        wq = mins[:, :, None] * q
        d = _f16(b, 208)
    nb = b.shape[0] // m if m else 0
    return KWeight(dtype, wq.reshape(m, nb, QK_K), d.reshape(m, nb),
                   None if dmin is None else dmin.reshape(m, nb),
                   None if mins is None else mins.reshape(m, nb, -1))


# -- Q8_K activations ------------------------------------------------------------------------------
@dataclass
class Q8K:
    """Activations [N, K] as ggml's block_q8_K: q int32 [N, nb, 256], d f32 [N, nb]."""

    q: np.ndarray
    d: np.ndarray

    def sums(self, width: int) -> np.ndarray:
        """int32 [N, nb, 256 / width]: sums of q over consecutive groups (bsums for width 16)."""
        n, nb, _ = self.q.shape
        return self.q.reshape(n, nb, -1, width).sum(axis=-1, dtype=np.int32)

    def rows(self, sl: slice) -> Q8K:
        return Q8K(self.q[sl], self.d[sl])


def quantize_q8_k(x: np.ndarray, positive_ties: bool = False) -> Q8K:
    """quantize_row_q8_K_ref of rows x [N, K]: iscale = -127/max (max: the first value of largest
    magnitude, sign kept), q = nearest_int(iscale * x), d = 1/iscale.

    positive_ties: ggml_quantize_mat_q8_K_4x8 on x86 (the repacked gemm's rows), whose max is
    +amax whenever +amax occurs in the super-block, even after -amax."""
    x = np.ascontiguousarray(x, dtype=f32)
    n, k = x.shape
    if k % QK_K:
        raise ValueError(f"Q8_K activations need rows of whole {QK_K}-value super-blocks, got K = {k}")
    blocks = x.reshape(n, k // QK_K, QK_K)
    mx = quants.signed_absmax(blocks)[..., 0]
    if positive_ties:
        mx = np.where((blocks == np.abs(mx)[..., None]).any(axis=-1), np.abs(mx), mx)
    zero = mx == 0
    with np.errstate(divide="ignore"):
        iscale = np.where(zero, f32(0), f32(-127) / np.where(zero, f32(1), mx)).astype(f32)
        d = np.where(zero, f32(0), f32(1) / np.where(zero, f32(1), iscale)).astype(f32)
    with np.errstate(invalid="ignore"):   # nearest_int(NaN) is 0
        scaled = iscale[..., None] * blocks
        q = np.clip(np.rint(np.where(np.isnan(scaled), f32(0), scaled)), -128, 127).astype(np.int32)
    return Q8K(q, d)


# -- exact integer sums ------------------------------------------------------------------------------
def _exact_matmul(x: np.ndarray, w: np.ndarray, w_max: int, terms: int) -> np.ndarray:
    """x [B, N, T] int32 @ w [B, T, M] (float32 integers) -> exact sums as float64 [B, N, M]."""
    if w_max * 127 * terms < _EXACT_F32:
        return np.matmul(x.astype(f32), w).astype(f64)
    if w_max * 8 * terms >= _EXACT_F32:
        raise ValueError(f"integer sums of {terms} terms up to {w_max}*128 are not exact in float32 halves")
    hi = (x + 8) >> 4                 # x = 16*hi + lo, |lo| <= 8, |hi| <= 8
    lo = x - 16 * hi
    return np.matmul(hi.astype(f32), w).astype(f64) * 16 + np.matmul(lo.astype(f32), w)


def _lanes(w: KWeight, x: Q8K) -> np.ndarray:
    """vec_dot's 8 integer lanes per super-block, as float32 [nb, N, M, 8] (cvtepi32_ps)."""
    n, nb = x.q.shape[0], w.nb
    wl, w_max = w.layout("lanes")
    xl = x.q.reshape(n, nb, 8, 8, 4).transpose(1, 3, 0, 2, 4).reshape(nb * 8, n, 32)
    lanes = _exact_matmul(xl, wl, w_max, 32).reshape(nb, 8, n, w.m_rows)
    if w.dtype == Q6_K:   # sumi - 32 * (sc[2l]*bsums[2l] + sc[2l+1]*bsums[2l+1])
        corr = np.einsum("nbls,mbls->bnml", x.sums(16).reshape(n, nb, 8, 2).astype(f64),
                         w.mins.reshape(-1, nb, 8, 2).astype(f64), optimize=True)
        return (lanes.transpose(0, 2, 3, 1) - 32 * corr).astype(f32)
    return lanes.transpose(0, 2, 3, 1).astype(f32)


def _min_sums(w: KWeight, x: Q8K, per: int) -> np.ndarray:
    """Integer sums of min * bsum over `per` consecutive sub-blocks, float32 [nb, N, M, S/per]."""
    s = w.mins.shape[-1]
    sums = x.sums(QK_K // s)                                                  # [N, nb, S]
    n, nb = sums.shape[:2]
    out = np.einsum("nbgs,mbgs->bnmg", sums.reshape(n, nb, s // per, per).astype(f64),
                    w.mins.reshape(-1, nb, s // per, per).astype(f64), optimize=True)
    return out.astype(f32)


def _hsum8(acc: np.ndarray) -> np.ndarray:
    """hsum_float_8 over the last axis."""
    r = acc[..., 4:8] + acc[..., 0:4]
    return (r[..., 0] + r[..., 2]) + (r[..., 1] + r[..., 3])


# -- the three kernels --------------------------------------------------------------------------------
def vec_dot(w: KWeight, x: Q8K) -> np.ndarray:
    """y [N, M] as ggml_vec_dot_qN_K_q8_K computes each output."""
    n, m = x.q.shape[0], w.m_rows
    out = np.empty((n, m), dtype=f32)
    step = max(1, _TILE // max(1, m * 8 * w.nb))
    for n0 in range(0, n, step):
        xs = x.rows(slice(n0, n0 + step))
        out[n0:n0 + step] = _vec_dot_rows(w, xs)
    return out


def _vec_dot_rows(w: KWeight, x: Q8K) -> np.ndarray:
    lanes = _lanes(w, x)                                                     # [nb, n, m, 8]
    n, m = lanes.shape[1:3]
    d = (x.d.T[:, :, None] * w.d.T[:, None, :]).astype(f32)                  # [nb, n, m]
    dmin = None if w.dmin is None else (-x.d.T[:, :, None] * w.dmin.T[:, None, :]).astype(f32)
    mins = None
    if w.dtype == Q2_K:
        mins = _min_sums(w, x, 2)                                            # 8 lanes
    elif w.dtype == Q4_K:
        mins = _min_sums(w, x, 2)                                            # 4 lanes
    elif w.dtype == Q5_K:
        mins = _min_sums(w, x, 8)[..., 0]                                    # one integer
    acc = np.zeros((n, m, 8), dtype=f32)
    acc_m = np.zeros((n, m, 4) if w.dtype == Q4_K else (n, m), dtype=f32)
    for b in range(w.nb):
        if w.dtype == Q2_K:
            acc = fma(dmin[b, :, :, None], mins[b], acc)
        acc = fma(d[b, :, :, None], lanes[b], acc)
        if w.dtype == Q4_K:
            acc_m = fma(dmin[b, :, :, None], mins[b], acc_m)
        elif w.dtype == Q5_K:
            acc_m = fma(dmin[b], mins[b], acc_m)
    total = _hsum8(acc)
    if w.dtype == Q4_K:
        return total + ((acc_m[..., 0] + acc_m[..., 2]) + (acc_m[..., 1] + acc_m[..., 3]))
    if w.dtype == Q5_K:
        return total + acc_m
    return total


def repacked(w: KWeight, x: Q8K, span: int) -> np.ndarray:
    """y [N, M] as the CPU_REPACK kernels compute it: one integer sum per `span` values (256: the
    gemv; 64 for Q4_K, 128 for Q2_K: the gemm), acc = fma(isum, d_w*d_x, acc), minus the mins'."""
    n, m = x.q.shape[0], w.m_rows
    out = np.empty((n, m), dtype=f32)
    step = max(1, _TILE // max(1, m * w.nb * QK_K // span))
    for n0 in range(0, n, step):
        out[n0:n0 + step] = _repacked_rows(w, x.rows(slice(n0, n0 + step)), span)
    return out


def _repacked_rows(w: KWeight, x: Q8K, span: int) -> np.ndarray:
    n, nb = x.q.shape[:2]
    per_block = QK_K // span
    wl, w_max = w.layout("span", span)
    isum = _exact_matmul(x.q.reshape(n, -1, span).transpose(1, 0, 2), wl, w_max, span).astype(f32)
    mins = _min_sums(w, x, w.mins.shape[-1] // per_block)                    # [nb, n, m, per_block]
    d = (w.d.T[:, None, :] * x.d.T[:, :, None]).astype(f32)                  # col * row, [nb, n, m]
    dm = (w.dmin.T[:, None, :] * x.d.T[:, :, None]).astype(f32)
    acc = np.zeros(isum.shape[1:], dtype=f32)
    acc_m = np.zeros_like(acc)
    for c in range(nb * per_block):
        b = c // per_block
        acc = fma(isum[c], d[b], acc)
        acc_m = fma(mins[b, :, :, c % per_block], dm[b], acc_m)
    return acc - acc_m


def tiled(w: KWeight, x: Q8K) -> np.ndarray:
    """y [N, M] as ggml-cpu's tiled K-quant matmul computes it (ggml_compute_forward_mul_mat_tiled)."""
    n, m = x.q.shape[0], w.m_rows
    out = np.empty((n, m), dtype=f32)
    step = max(1, _TILE // max(1, m * w.nb))
    for n0 in range(0, n, step):
        out[n0:n0 + step] = _tiled_rows(w, x.rows(slice(n0, n0 + step)))
    return out


def _tiled_rows(w: KWeight, x: Q8K) -> np.ndarray:
    n, nb = x.q.shape[:2]
    wl, w_max = w.layout("span", QK_K)
    s1 = _exact_matmul(x.q.transpose(1, 0, 2), wl, w_max, QK_K)               # [nb, n, m]
    if w.dtype == Q6_K:   # the tile holds q - 32 (BIAS): subtract 32 * sc * bsums
        s1 = s1 - 32 * np.einsum("nbs,mbs->bnm", x.sums(16).astype(f64), w.mins.astype(f64), optimize=True)
    s1 = s1.astype(f32)
    acc = np.zeros(s1.shape[1:], dtype=f32)
    s2 = _min_sums(w, x, w.mins.shape[-1])[..., 0] if w.dmin is not None else None
    for b in range(nb):
        res = (s1[b] * w.d[None, :, b]).astype(f32)
        if s2 is not None:
            res = fma(-w.dmin[None, :, b], s2[b], res)
        acc = fma(res, x.d[:, b, None], acc)
    return acc


# -- ggml's choice ---------------------------------------------------------------------------------------
def mul_mat(w: KWeight, b: np.ndarray, repack: bool, gemm: bool = True) -> np.ndarray:
    """b [N, K] f32 @ weight.T as ggml's CPU backend computes it for this K-quant weight.

    repack: the weight sits in CPU_REPACK (see repack_x86.repack_type). Then rows come four at
    a time to the gemm (quantized by ggml_quantize_mat_q8_K_4x8) and the N % 4 left over to the
    gemv (quantize_row_q8_K), as forward_mul_mat splits them; gemm=False sends every row to the
    gemv (forward_mul_mat_id). Otherwise (quantize_row_q8_K) 8 or more rows go to the tiled
    matmul, fewer to one vec_dot per output."""
    b = np.asarray(b, dtype=f32)
    if b.ndim != 2 or b.shape[1] != w.nb * QK_K:
        raise ValueError(f"activations {b.shape} do not match a {w.dtype} weight of K = {w.nb * QK_K}")
    if not repack:
        x = quantize_q8_k(b)
        return tiled(w, x) if b.shape[0] >= TILED_MIN_ROWS else vec_dot(w, x)
    n = b.shape[0]
    grouped = n - n % 4 if gemm and n > 3 else 0
    out = np.empty((n, w.m_rows), dtype=f32)
    if grouped:
        out[:grouped] = repacked(w, quantize_q8_k(b[:grouped], positive_ties=True), _GEMM_SPAN[w.dtype.name])
    if grouped < n:
        out[grouped:] = repacked(w, quantize_q8_k(b[grouped:]), QK_K)
    return out
