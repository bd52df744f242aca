"""ggml's x86 (AVX2 and up) dot products of Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 weights, bit for bit.

For these types both ggml's vec_dot (token generation) and llamafile's tinyBLAS (prompts)
accumulate the same way: for each 32-value block, 8 lanes of 4-value integer sums (exact),
scaled by d_a*d_b (rounded to f32) and fused-multiply-added into 8 f32 lanes, then a fixed
horizontal sum ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)). Q4_1/Q5_1 add sum_b m_a*s_b, itself
accumulated with fma. Matching this order makes the numpy reference agree with llama.cpp exactly,
so a quantized activation never rounds differently and greedy decoding stays identical.

Float weights (and KV caches) are in llamir/ir/float_x86.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llamir.ir.dtypes import Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, DType

f32 = np.float32
EXACT_TYPES = frozenset({Q8_0.name, Q4_0.name, Q4_1.name, Q5_0.name, Q5_1.name})
_ROW_CHUNK = 1 << 21  # elements of the [N, M, 8] lane tile processed at once


@dataclass
class PreparedWeight:
    """A weight split into what the kernel reads: int quants, block scales, block mins."""

    q: np.ndarray          # int8/uint8 values as f32 [M, nb, 8, 4]
    d: np.ndarray          # f32 [M, nb]
    m: np.ndarray | None   # f32 [M, nb] (Q4_1/Q5_1) or None
    repacked: bool = False  # Q4_0 with M % 8 == 0: ggml's CPU_REPACK q4_0_8x8 kernels


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[..., offset:offset + 2]).view(np.float16)[..., 0].astype(f32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    bits = np.unpackbits(qh, axis=-1, bitorder="little")
    return bits


def prepare(a_raw: np.ndarray, dtype: DType, repacked: bool = False) -> PreparedWeight:
    """Split a [M, row_bytes] weight of an exact type into lanes and scales. `repacked`: the
    weight sits in CPU_REPACK (a Q4_0 model weight with M % 8 == 0, see repack_x86)."""
    m_rows = a_raw.shape[0]
    blocks = np.ascontiguousarray(a_raw).reshape(m_rows, -1, dtype.type_size)
    mins = None
    if dtype == Q8_0:
        q = blocks[..., 2:34].view(np.int8).astype(f32)
    elif dtype == Q4_0:
        q = (_nibbles(blocks[..., 2:18]).astype(np.int16) - 8).astype(f32)
    elif dtype == Q4_1:
        q = _nibbles(blocks[..., 4:20]).astype(f32)
        mins = _f16(blocks, 2)
    elif dtype == Q5_0:
        q = (_nibbles(blocks[..., 6:22]) | (_high_bits(blocks[..., 2:6]) << 4)).astype(np.int16) - 16
        q = q.astype(f32)
    elif dtype == Q5_1:
        q = (_nibbles(blocks[..., 8:24]) | (_high_bits(blocks[..., 4:8]) << 4)).astype(f32)
        mins = _f16(blocks, 2)
    else:
        raise ValueError(f"no exact x86 kernel for {dtype}")
    if repacked and dtype != Q4_0:
        raise ValueError(f"ggml repacks no {dtype} weights into q8_0-activation layouts on x86")
    return PreparedWeight(q.reshape(m_rows, -1, 8, 4), _f16(blocks, 0), mins, repacked)


def _fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """f32 fused multiply-add with one rounding (vfmadd)."""
    from llamir.ir.ggml_math import fma

    return fma(a, b, c)


def _hsum8(acc: np.ndarray) -> np.ndarray:
    """hsum_float_8 on the last axis of 8 lanes."""
    r = acc[..., 4:8] + acc[..., 0:4]
    return (r[..., 0] + r[..., 2]) + (r[..., 1] + r[..., 3])


def mul_mat(w: PreparedWeight, b_q: np.ndarray, b_d: np.ndarray, b_s: np.ndarray | None) -> np.ndarray:
    """y [N, M] from activations quantized to Q8_0/Q8_1: b_q f32 ints [N, nb, 32], b_d [N, nb],
    b_s (Q8_1's fp16-rounded d*sum(q)) [N, nb] for weights with mins."""
    n, nb = b_q.shape[0], b_q.shape[1]
    m = w.q.shape[0]
    bq = b_q.reshape(n, nb, 8, 4)
    out = np.empty((n, m), dtype=f32)
    step = max(1, _ROW_CHUNK // max(1, m * 8 * nb))
    if not w.repacked:
        w_lanes = np.ascontiguousarray(w.q.transpose(1, 2, 3, 0))          # [nb, 8, 4, M]
    for n0 in range(0, n, step):
        sl = slice(n0, n0 + step)
        scale = (b_d[sl].T[:, :, None] * w.d.T[:, None, :]).astype(f32)     # [nb, n, m]
        if w.repacked:  # one integer sum per block, one f32 accumulator per output
            isum = np.einsum("nbls,mbls->bnm", bq[sl], w.q, optimize=True)
            acc1 = np.zeros(isum.shape[1:], dtype=f32)
            for blk in range(nb):
                acc1 = _fma(isum[blk], scale[blk], acc1)
            out[sl] = acc1
            continue
        b_lanes = np.ascontiguousarray(bq[sl].transpose(1, 2, 0, 3))       # [nb, 8, n, 4]
        acc = np.zeros((8,) + scale.shape[1:], dtype=f32)                   # lane-major [8, n, m]
        for blk in range(nb):
            lanes = np.matmul(b_lanes[blk], w_lanes[blk])                    # exact integer sums
            acc = _fma(scale[blk], lanes, acc)
        total = _hsum8(np.moveaxis(acc, 0, -1))
        if w.m is not None:
            summs = np.zeros(total.shape, dtype=f32)
            for blk in range(nb):
                summs = _fma(w.m[None, :, blk], b_s[sl][:, None, blk], summs)
            total = total + summs
        out[sl] = total
    return out


def quantize_activations(b: np.ndarray, with_sum: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """ggml's x86 quantize_row_q8_0/q8_1 of b [N, K]: ints (as f32) [N, nb, 32], d, and s."""
    from llamir.ir import quants
    from llamir.ir.dtypes import Q8_1

    n, k = b.shape
    vdt = Q8_1 if with_sum else Q8_0
    raw = quants.cpu_from_float(np.ascontiguousarray(b, dtype=f32), vdt)
    blocks = raw.reshape(n, k // 32, vdt.type_size)
    if with_sum:
        return blocks[..., 4:36].view(np.int8).astype(f32), _f16(blocks, 0), _f16(blocks, 2)
    return blocks[..., 2:34].view(np.int8).astype(f32), _f16(blocks, 0), None


def mul_mat_exact(w: PreparedWeight, dtype: DType, b: np.ndarray) -> np.ndarray:
    """b [N, K] f32 @ weight.T with ggml's x86 quantization of b and its accumulation order."""
    q, d, s = quantize_activations(b, with_sum=w.m is not None)
    return mul_mat(w, q, d, s)
