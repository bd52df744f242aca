"""K-quant weights (Q2_K..Q6_K) repacked for ggml's integer orders across 16 rows at a time.

A weight [M, K] becomes groups of 16 rows (M padded with zero rows); each (group, super-block of
256 values) holds, in this order:

    q      the values as bit planes, vectors of 64 bytes in which byte 4r+t belongs to value t of
           row r of a 4-value chunk (chunk c: values 4c..4c+3). Unpacked, chunk c is the unsigned
           stored value (Q3_K as q+4, Q6_K as q+32: the kernel subtracts the offset times the
           activation sums).
             Q4_K, Q5_K  per 32-value block (8 chunks): 4 nibble vectors (chunk i low, chunk i+4
                         high), then Q5_K's bit vector (bit i: chunk i's fifth bit)
             Q6_K        per 16-value sub-block (4 chunks): 3 vectors, vector i holding chunk i in
                         bits 0-5 and bits 4-2i, 5-2i of chunk 3 in bits 6, 7
             Q3_K        per 32-value block: the two sub-blocks' crumb vectors (bits 2i, 2i+1:
                         chunk i's low two) and a bit vector (bit i: chunk i's third)
             Q2_K        per sub-block: a crumb vector
    sc     S sub-block scales per row, int8 [S][16]   (S = 16 for Q2_K/Q3_K/Q6_K, 8 otherwise)
    mn     the sub-block mins in pairs, int8 [S/2][16][2]: (m[2l], m[2l+1]) per row, widened to
           int16 for a vpmaddwd with the activation's sum pairs  (Q2_K, Q4_K, Q5_K)
    d      the super-block's d, fp16 [16]
    dmin   its dmin, fp16 [16]                           (Q2_K, Q4_K, Q5_K)

Every part splits into two contiguous halves of 8 rows (the 256-bit kernels' unit). Token generation
streams the whole weight once per token, so the values take as many bits as in ggml's blocks, and
scales and mins a byte each: per 16 rows and 256 values, Q6_K 3360 bytes as ggml, Q5_K 2880 (ggml:
2816), Q4_K 2368 (2304), Q3_K 1824 (1760), Q2_K 1600 (1344, its 4-bit scales and mins).

The integers are ggml's own (sc*q summed exactly in int32); the kernel (matmul_quant_k.py) then
applies each ggml kernel's float order to them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llamir.ir import quants

G = 16
QK_K = 256


@dataclass(frozen=True)
class KFormat:
    dtype: str      # "q2_k" | "q3_k" | "q4_k" | "q5_k" | "q6_k"

    @property
    def subs(self) -> int:
        """Sub-blocks per super-block."""
        return 8 if self.dtype in ("q4_k", "q5_k") else 16

    @property
    def chunks_per_sub(self) -> int:
        return 64 // self.subs

    @property
    def block32_bytes(self) -> int:
        """Bytes of q per 32-value block (8 chunks) of the 16 rows: the values' bits / 8 * 512."""
        return {"q2_k": 128, "q3_k": 192, "q4_k": 256, "q5_k": 320, "q6_k": 384}[self.dtype]

    @property
    def has_min(self) -> bool:
        return self.dtype in ("q2_k", "q4_k", "q5_k")

    @property
    def offset(self) -> int:
        """What the stored unsigned value exceeds the signed one by."""
        return {"q3_k": 4, "q6_k": 32}.get(self.dtype, 0)

    @property
    def q_bytes(self) -> int:
        return 8 * self.block32_bytes

    @property
    def off_sc(self) -> int:
        return self.q_bytes

    @property
    def off_mn(self) -> int:
        return self.off_sc + 16 * self.subs

    @property
    def off_d(self) -> int:
        return self.off_mn + (16 * self.subs if self.has_min else 0)

    @property
    def off_dmin(self) -> int:
        return self.off_d + 2 * G

    @property
    def block_bytes(self) -> int:
        return self.off_dmin + (2 * G if self.has_min else 0)

    @property
    def vdt(self) -> str:
        return "q8_k"

    @property
    def name(self) -> str:
        return f"{self.dtype}:ggml"


K_FORMATS = {name: KFormat(name) for name in ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k")}
_TYPE_SIZE = {"q2_k": 84, "q3_k": 110, "q4_k": 144, "q5_k": 176, "q6_k": 210}


def _f16(b: np.ndarray, off: int) -> np.ndarray:
    return np.ascontiguousarray(b[:, off:off + 2]).view(np.float16)[:, 0].copy()     # the bits as stored


def _values(b: np.ndarray, dtype: str):
    """Blocks [n, type_size] -> (q uint8 [n, 256] stored values, sc int16 [n, S], mn int16 [n, S] | None,
    d f16 [n], dmin f16 [n] | None)."""
    bits = np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    if dtype == "q2_k":
        return (quants._crumbs(b[:, 16:80]).reshape(-1, QK_K), (b[:, 0:16] & 0xF).astype(np.int16),
                (b[:, 0:16] >> 4).astype(np.int16), _f16(b, 80), _f16(b, 82))
    if dtype == "q3_k":
        hm = ((b[:, None, 0:32] >> bits) & 1).reshape(-1, 16, 16)
        q = quants._crumbs(b[:, 32:96]) + 4 * hm                                  # q + 4, 0..7
        return q.reshape(-1, QK_K), (quants._q3_k_scales(b[:, 96:108]) - 32).astype(np.int16), None, \
            _f16(b, 108), None
    if dtype in ("q4_k", "q5_k"):
        sc, mn = quants.k4_scales_mins(b[:, 4:16])
        qs = 16 if dtype == "q4_k" else 48
        q = quants._nibble_pairs(b[:, qs:qs + 128])
        if dtype == "q5_k":
            q = q + 16 * ((b[:, None, 16:48] >> bits) & 1)
        return q.reshape(-1, QK_K), sc.astype(np.int16), mn.astype(np.int16), _f16(b, 0), _f16(b, 2)
    # in 64-bit words (8 values a word: each byte's fields shift and mask within the byte)
    ql = np.ascontiguousarray(b[:, 0:128]).view(np.uint64).reshape(-1, 2, 2, 4)
    low = np.concatenate([ql & _BYTES_0F, (ql >> np.uint64(4)) & _BYTES_0F], axis=2)
    qh = np.ascontiguousarray(b[:, 128:192]).view(np.uint64).reshape(-1, 2, 1, 4)
    qh = (qh >> np.array([0, 2, 4, 6], np.uint64).reshape(1, 1, 4, 1)) & _BYTES_03
    q = (low | (qh << np.uint64(4))).view(np.uint8).reshape(-1, QK_K)             # q + 32, 0..63
    return q, b[:, 192:208].view(np.int8).astype(np.int16), None, _f16(b, 208), None


_BYTES_0F, _BYTES_03 = np.uint64(0x0F0F0F0F0F0F0F0F), np.uint64(0x0303030303030303)


def _pad_rows(a: np.ndarray, groups: int) -> np.ndarray:
    pad = groups * G - a.shape[0]
    return a if not pad else np.concatenate([a, np.zeros((pad,) + a.shape[1:], a.dtype)])


def _bits(chunks: np.ndarray, width: int) -> np.ndarray:
    """[..., n, 64] values below 2**width -> [..., 64] with chunk i at bits width*i."""
    out = np.zeros(chunks.shape[:-2] + chunks.shape[-1:], np.uint8)
    for i in range(chunks.shape[-2]):
        out |= chunks[..., i, :] << (width * i)
    return out


def _planes(q: np.ndarray, dtype: str) -> np.ndarray:
    """Stored values [g, nb, 64 chunks, 64 bytes] -> the bit planes [g, nb, q_bytes] (see the module)."""
    g, nb = q.shape[:2]
    if dtype in ("q4_k", "q5_k"):              # [g, nb, 8 blocks, 8 chunks, 64]
        blk = q.reshape(g, nb, 8, 8, 64)
        vecs = [(blk[:, :, :, :4] & 15) | ((blk[:, :, :, 4:] & 15) << 4)]
        if dtype == "q5_k":
            vecs.append(_bits(blk >> 4, 1)[:, :, :, None])
    elif dtype == "q3_k":                      # [g, nb, 8 blocks, 2 sub-blocks, 4 chunks, 64]
        blk = q.reshape(g, nb, 8, 2, 4, 64)
        vecs = [_bits(blk & 3, 2), _bits(blk.reshape(g, nb, 8, 8, 64) >> 2, 1)[:, :, :, None]]
    else:                                      # [g, nb, 16 sub-blocks, 4 chunks, 64]
        sub = q.reshape(g, nb, 16, 4, 64)
        if dtype == "q2_k":
            vecs = [_bits(sub, 2)[:, :, :, None]]
        else:
            top = (sub[:, :, :, 3:] >> np.array([4, 2, 0], np.uint8).reshape(3, 1)) & 3
            vecs = [sub[:, :, :, :3] | (top << 6)]
    return np.ascontiguousarray(np.concatenate(vecs, axis=3)).reshape(g, nb, -1)


def repack_k(raw: np.ndarray, fmt: KFormat) -> np.ndarray:
    """uint8 [n_groups, nb, block_bytes] from a K-quant weight's bytes [M, row_bytes]."""
    raw = np.ascontiguousarray(raw).reshape(raw.shape[0], -1)
    m = raw.shape[0]
    size = _TYPE_SIZE[fmt.dtype]
    if raw.shape[1] % size:
        raise ValueError(f"{fmt.dtype} rows of {raw.shape[1]} bytes are not whole {size}-byte blocks")
    nb = raw.shape[1] // size
    with np.errstate(invalid="ignore", over="ignore"):
        q, sc, mn, d, dmin = _values(raw.reshape(-1, size), fmt.dtype)
    groups = -(-m // G)
    q = np.ascontiguousarray(q, dtype=np.uint8).view(np.uint32)      # a 4-value chunk a word
    q = _pad_rows(q.reshape(m, nb, 64), groups).reshape(groups, G, nb, 64).transpose(0, 2, 3, 1)
    parts = [_planes(np.ascontiguousarray(q).view(np.uint8).reshape(groups, nb, 64, 64), fmt.dtype)]
    sc = _pad_rows(sc.reshape(m, nb, fmt.subs), groups).reshape(groups, G, nb, fmt.subs).transpose(0, 2, 3, 1)
    parts.append(np.ascontiguousarray(sc, dtype=np.int8).view(np.uint8).reshape(groups, nb, -1))
    if mn is not None:   # [g, 16, nb, S/2, 2] -> [g, nb, S/2, 16, 2]
        mn = _pad_rows(mn.reshape(m, nb, fmt.subs), groups).reshape(groups, G, nb, fmt.subs // 2, 2)
        parts.append(np.ascontiguousarray(mn.transpose(0, 2, 3, 1, 4), dtype=np.int8).view(np.uint8)
                     .reshape(groups, nb, -1))
    for arr in (d, dmin):
        if arr is not None:
            arr = _pad_rows(arr.reshape(m, nb), groups).reshape(groups, G, nb)
            parts.append(np.ascontiguousarray(arr.transpose(0, 2, 1), dtype="<f2").view(np.uint8)
                         .reshape(groups, nb, -1))
    out = np.ascontiguousarray(np.concatenate(parts, axis=-1))
    if out.shape[-1] != fmt.block_bytes:
        raise AssertionError(f"{fmt.dtype}: packed {out.shape[-1]} bytes per block, expected {fmt.block_bytes}")
    return out
