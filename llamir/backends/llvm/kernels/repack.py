"""Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 weights repacked for int8 dot products across 16 rows at a time
(the K-quants have their own layout, repack_k.py).

A weight [M, K] of a GGUF block type becomes groups of 16 rows (M padded with zero rows); each
(group, block) holds the block's integer values for the 16 rows laid out for vpdpbusd (byte
4r..4r+3 of a 64-byte vector holds 4 consecutive values of row r: one "chunk"), then the 16
row scales and, for affine types, the 16 mins. 4-bit values are packed two chunks per vector
(chunk v in the low nibbles, chunk v + C/2 in the high ones); others take a byte each, made
unsigned with a fixed offset that the activation side corrects for. Without VNNI, Q8_0 keeps its
signed bytes for vpmaddwd on int16 ("pairs": vpmaddubsw would saturate on offset bytes): each
half-chunk (8 rows x 4 values) holds the rows' values 0, 1, then their values 2, 3, so that one
vpmovsxbw of each 16 bytes gives the operands of two vpmaddwd against broadcast activation pairs.

The arithmetic the kernel does per block (see QFormat.order) follows the reference:
- "block": one integer sum per (row, block), acc = fma(isum, d_w*d_x, acc)  (Q4_0 repacked
  by ggml, q4_0_8x8);
- "lanes8": ggml's 8 lanes of 4-value sums, acc_l = fma(d_w*d_x, P_l, acc_l), then
  ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)) (Q8_0, Q4_1, Q5_x, Q4_0 with M % 8 != 0).
"""

from __future__ import annotations

import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

G = 16   # rows per group: one 16-lane vector of outputs


@dataclass(frozen=True)
class QFormat:
    dtype: str          # the GGUF type repacked
    bs: int             # elements per block (a K-quant's sub-block)
    packing: str        # "nib" | "byte" | "pairs" (bytes, each half-chunk ordered by value pair)
    scale: str          # "f16" | "f32"
    min: str            # "" | "f16" | "f32": added term min_w * aux_x per block
    order: str          # "block" | "lanes8"
    corr: str           # "" | "chunk" | "block": integer correction -offset * sum(x) per chunk/block
    offset: int         # the value offset the correction undoes
    vdt: str            # activation type: "q8_0" | "q8_1" | "q8_k"

    @property
    def chunks(self) -> int:
        return self.bs // 4

    @property
    def quant_bytes(self) -> int:
        return G * self.bs // (2 if self.packing == "nib" else 1)

    @property
    def scale_bytes(self) -> int:
        return G * (2 if self.scale == "f16" else 4)

    @property
    def min_bytes(self) -> int:
        return 0 if not self.min else G * (2 if self.min == "f16" else 4)

    @property
    def block_bytes(self) -> int:
        """Bytes of one (group, block)."""
        return self.quant_bytes + self.scale_bytes + self.min_bytes

    @property
    def name(self) -> str:
        return f"{self.dtype}:{self.order}" + (":pairs" if self.packing == "pairs" else "")


def weight_format(dtype: str, m_rows: int, vnni: bool = True) -> QFormat | None:
    """The packed format of a weight type (None: not supported by the packed kernels); `vnni`:
    whether the kernels get vpdpbusd (else Q8_0 stays signed, for vpmaddwd)."""
    if dtype == "q8_0" and not vnni:
        return Q8_0_PAIRS
    if dtype == "q4_0":
        if m_rows % 8 == 0:   # ggml repacks Q4_0 (q4_0_8x8): one integer sum per block
            return QFormat("q4_0", 32, "nib", "f16", "", "block", "block", 8, "q8_0")
        return QFormat("q4_0", 32, "nib", "f16", "", "lanes8", "chunk", 8, "q8_0")
    return _FORMATS.get(dtype)


_FORMATS = {
    "q8_0": QFormat("q8_0", 32, "byte", "f16", "", "lanes8", "chunk", 128, "q8_0"),
    "q4_1": QFormat("q4_1", 32, "nib", "f16", "f16", "lanes8", "", 0, "q8_1"),
    "q5_0": QFormat("q5_0", 32, "byte", "f16", "", "lanes8", "chunk", 16, "q8_0"),
    "q5_1": QFormat("q5_1", 32, "byte", "f16", "f16", "lanes8", "", 0, "q8_1"),
}
Q8_0_PAIRS = QFormat("q8_0", 32, "pairs", "f16", "", "lanes8", "", 0, "q8_0")


# -- integer values, scales and mins of each type ([M, nb, bs] uint8, [M, nb], [M, nb]) ------------
def _f16_bits(blocks: np.ndarray, off: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[..., off:off + 2]).view(np.uint16)[..., 0]


def _f16_f32(blocks: np.ndarray, off: int) -> np.ndarray:
    return _f16_bits(blocks, off).view(np.float16).astype(np.float32)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high32(qh: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(qh).view("<u4")[..., 0]
    return ((bits[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _split(raw: np.ndarray, fmt: QFormat):
    m = raw.shape[0]
    if fmt.dtype in ("q4_0", "q8_0", "q4_1", "q5_0", "q5_1"):
        blocks = raw.reshape(m, -1, {"q4_0": 18, "q8_0": 34, "q4_1": 20, "q5_0": 22, "q5_1": 24}[fmt.dtype])
        if fmt.dtype == "q4_0":
            return _nibbles32(blocks[..., 2:18]), _f16_bits(blocks, 0), None
        if fmt.dtype == "q8_0":   # int8 + offset stored as uint8: the same bits as a wrapping uint8 add
            q = np.add(blocks[..., 2:34], np.uint8(fmt.offset % 256), dtype=np.uint8)
            return q, _f16_bits(blocks, 0), None
        if fmt.dtype == "q4_1":
            return _nibbles32(blocks[..., 4:20]), _f16_bits(blocks, 0), _f16_bits(blocks, 2)
        if fmt.dtype == "q5_0":
            return _nibbles32(blocks[..., 6:22]) | (_high32(blocks[..., 2:6]) << 4), _f16_bits(blocks, 0), None
        return _nibbles32(blocks[..., 8:24]) | (_high32(blocks[..., 4:8]) << 4), _f16_bits(blocks, 0), \
            _f16_bits(blocks, 2)
    raise ValueError(f"no packed layout for {fmt.dtype} weights (K-quants use repack_k.KFormat)")


def repack(raw: np.ndarray, fmt) -> np.ndarray:
    """uint8 [n_groups, nb, block_bytes] from a weight's bytes [M, row_bytes] (fmt: a QFormat,
    or a repack_k.KFormat for the K-quants' ggml orders)."""
    from llamir.backends.llvm.kernels.repack_k import KFormat, repack_k

    if isinstance(fmt, KFormat):
        return repack_k(raw, fmt)
    raw = np.ascontiguousarray(raw).reshape(raw.shape[0], -1)
    with np.errstate(invalid="ignore", over="ignore"):
        q, scale, mins = _split(raw, fmt)
    m, nb, bs = q.shape
    groups = -(-m // G)
    pad = groups * G - m
    if pad:
        q = np.concatenate([q, np.zeros((pad, nb, bs), np.uint8)])
        scale = np.concatenate([scale, np.zeros((pad, nb), scale.dtype)])
        mins = None if mins is None else np.concatenate([mins, np.zeros((pad, nb), mins.dtype)])
    # the transposes move whole 4-value chunks (2-value pairs): one uint32 (uint16) an element
    q = np.ascontiguousarray(q).view(np.uint32).reshape(groups, G, nb, fmt.chunks)
    q = q.transpose(0, 2, 3, 1)                                                 # [g, nb, C, 16] chunks
    if fmt.packing == "pairs":   # [g, nb, C, half, pair, 8 rows] pairs
        q = np.ascontiguousarray(q).view(np.uint16).reshape(groups, nb, fmt.chunks, 2, 8, 2)
        q = q.transpose(0, 1, 2, 3, 5, 4)
    if fmt.packing == "nib":
        half = fmt.chunks // 2
        q = q[:, :, :half] | (q[:, :, half:] << 4)
    parts = [np.ascontiguousarray(q).view(np.uint8).reshape(groups, nb, -1)]
    for arr, kind in ((scale, fmt.scale), (mins, fmt.min)):
        if arr is None or not kind:
            continue
        arr = arr.reshape(groups, G, nb).transpose(0, 2, 1)
        arr = arr.astype(np.uint16) if kind == "f16" and arr.dtype == np.uint16 else arr.astype(np.float32)
        parts.append(np.ascontiguousarray(arr).view(np.uint8).reshape(groups, nb, -1))
    out = np.ascontiguousarray(np.concatenate(parts, axis=-1))
    assert out.shape[-1] == fmt.block_bytes, (out.shape, fmt)
    return out


HUGE_PAGE = 2 << 20      # x86-64's transparent huge page


class PackedWeights:
    """Process-wide cache of repacked weights by (buffer address, shape, format). An entry lives
    as long as the array it was packed from (a weak reference), so a freed model's packed copy is
    dropped and a new array at the same address is never mistaken for the old one."""

    def __init__(self):
        self._lock = threading.Lock()
        self._cache: dict[tuple, tuple] = {}

    def get(self, raw: np.ndarray, fmt) -> np.ndarray:
        key = self._key(raw, fmt)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and hit[0]() is not None:
                return hit[1]
        packed = repack(raw, fmt)
        with self._lock:
            for k in [k for k, (ref, _) in self._cache.items() if ref() is None]:
                del self._cache[k]
            self._cache[key] = (weakref.ref(raw), packed)
        return packed

    def prepare(self, pairs) -> None:
        """Pack the (raw, fmt) pairs not packed yet, on a thread each CPU (numpy lets go of the GIL
        in the copies and the bit operations): a model's first call packs all its weights."""
        with self._lock:
            todo = [(raw, fmt) for raw, fmt in pairs if (hit := self._cache.get(self._key(raw, fmt))) is None
                    or hit[0]() is None]
        if len(todo) < 2:
            return
        with ThreadPoolExecutor(min(len(todo), os.cpu_count() or 1)) as pool:
            list(pool.map(lambda pair: self.get(*pair), todo))
        self._gather([self._key(raw, fmt) for raw, fmt in todo])

    def _gather(self, keys: list[tuple]) -> None:
        """Move the packed weights of `keys` into one arena, in that order (the graph's), on 2 MiB
        transparent huge pages: numpy advises them for allocations of 4 MiB and more, and the
        arena starts on a 2 MiB boundary. A token streams every weight once; from a few hundred
        KiB each on 4 KiB pages it missed the TLB every page (Zen 2, AVX2: big-q4_0 4.1 -> 3.7 ms a
        token, big-q8_0 6.6 -> 6.2, big-q4_k 4.5 -> 4.3). The arena lives while any weight in it does."""
        with self._lock:
            keys = [key for key in dict.fromkeys(keys) if key in self._cache]
            spans = [-(-self._cache[key][1].nbytes // 64) * 64 for key in keys]   # each on a cache line
            if sum(spans) < HUGE_PAGE:
                return
            arena = np.empty(sum(spans) + HUGE_PAGE, dtype=np.uint8)
            at = -arena.__array_interface__["data"][0] % HUGE_PAGE
            for key, span in zip(keys, spans, strict=True):   # each packed copy is freed as soon as it has moved
                ref, packed = self._cache[key]
                view = arena[at:at + packed.nbytes].view(packed.dtype).reshape(packed.shape)
                view[...] = packed
                self._cache[key] = (ref, view)
                at += span

    @staticmethod
    def _key(raw: np.ndarray, fmt) -> tuple:
        return (raw.__array_interface__["data"][0], raw.shape, raw.strides, fmt)

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()


PACKED = PackedWeights()
