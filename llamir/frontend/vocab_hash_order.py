"""Which token llama.cpp finds first when it scans its `token_to_id` std::unordered_map.

llama.cpp picks the EOT and FIM tokens by text, taking the first match while iterating an
unordered_map; when a vocab has two candidates (Qwen2: <|im_end|> and <|endoftext|>) the answer
is the container's iteration order. We reproduce libstdc++'s (GCC's) order: std::hash<string> is
_Hash_bytes (a MurmurHash2 variant), buckets grow through a fixed prime sequence, and each insert
goes to the front of its bucket, or of the whole list when the bucket was empty.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

_MUL = np.uint64(0xC6A4A7935BD1E995)
_SEED = np.uint64(0xC70F6907)
_SHIFT = np.uint64(47)

# bucket counts of a std::unordered_map grown one insert at a time (libstdc++'s
# _Prime_rehash_policy, max_load_factor 1): it rehashes when the size would exceed the count
BUCKET_COUNTS = (13, 29, 59, 127, 257, 541, 1109, 2357, 5087, 10273, 20753, 42043, 85229, 172933,
                 351061, 712697, 1447153, 2938679, 5967347, 12117689, 24599243)


def _shift_mix(v: np.ndarray) -> np.ndarray:
    return v ^ (v >> _SHIFT)


def hash_bytes(keys: Sequence[bytes]) -> np.ndarray:
    """std::_Hash_bytes(key, len, 0xc70f6907) for each key (64-bit size_t), vectorized."""
    lengths = np.array([len(k) for k in keys], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    buf = np.frombuffer(b"".join(keys) + bytes(8), dtype=np.uint8)
    lanes = np.arange(8, dtype=np.int64)

    def load(offsets: np.ndarray, n_bytes: np.ndarray) -> np.ndarray:
        raw = buf[offsets[:, None] + lanes].copy()
        raw[lanes[None, :] >= n_bytes[:, None]] = 0     # little-endian load of n_bytes
        return raw.view("<u8").reshape(-1)

    with np.errstate(over="ignore"):
        h = _SEED ^ (lengths.astype(np.uint64) * _MUL)
        n_blocks = lengths // 8
        for block in range(int(n_blocks.max(initial=0))):
            live = n_blocks > block
            data = load(starts[live] + 8 * block, np.full(int(live.sum()), 8))
            h[live] = (h[live] ^ (_shift_mix(data * _MUL) * _MUL)) * _MUL
        tail = lengths % 8
        live = tail > 0
        data = load(starts[live] + 8 * n_blocks[live], tail[live])
        h[live] = (h[live] ^ data) * _MUL
        h = _shift_mix(_shift_mix(h) * _MUL)
    return h


def iteration_order(keys: Sequence[bytes]) -> list[int]:
    """Indices of distinct `keys` in the order an unordered_map iterates them after inserting
    them one by one in this order (a repeated key is not inserted again)."""
    first: dict[bytes, int] = {}
    for i, k in enumerate(keys):
        first.setdefault(k, i)
    inserted = list(first.values())
    hashes = hash_bytes([keys[i] for i in inserted])
    # buckets: bucket -> members (front of the bucket last); order: buckets, front of list last
    buckets: dict[int, list[int]] = {}
    order: list[int] = []
    capacity, stage, bucket_of = 0, 0, []
    for n in range(len(inserted)):
        if n + 1 > capacity:  # rehash before inserting; the empty map rehashes on its first insert
            capacity = BUCKET_COUNTS[stage]
            stage += 1
            bucket_of = (hashes % np.uint64(capacity)).tolist()
            buckets, order = _rehash(_walk(buckets, order), bucket_of)
        b = bucket_of[n]
        if b in buckets:
            buckets[b].append(n)
        else:
            buckets[b] = [n]
            order.append(b)
    return [inserted[n] for n in _walk(buckets, order)]


def _walk(buckets: dict[int, list[int]], order: list[int]) -> Iterable[int]:
    for b in reversed(order):
        yield from reversed(buckets[b])


def _rehash(walk: Iterable[int], bucket_of: list[int]) -> tuple[dict[int, list[int]], list[int]]:
    """_M_rehash_aux: walk the old list, putting each node at the front of its new bucket."""
    buckets: dict[int, list[int]] = {}
    order: list[int] = []
    for n in walk:
        b = bucket_of[n]
        if b in buckets:
            buckets[b].append(n)
        else:
            buckets[b] = [n]
            order.append(b)
    return buckets, order


def first_in_map_order(keys: Sequence[bytes], candidates: Iterable[int]) -> int:
    """The candidate index (into `keys`) an unordered_map scan meets first."""
    wanted = set(candidates)
    return next(i for i in iteration_order(keys) if i in wanted)
