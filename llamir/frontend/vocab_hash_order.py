"""Which token llama.cpp finds first when it scans its `token_to_id` std::unordered_map.

llama.cpp picks the EOT and FIM tokens by text, taking the first match while iterating an
unordered_map; when a vocab has two candidates (Qwen2: <|im_end|> and <|endoftext|>) the answer
is the container's iteration order. We reproduce libstdc++'s (GCC's) order: std::hash<string> is
_Hash_bytes (a MurmurHash2 variant), buckets grow through a fixed prime sequence, and each insert
goes to the front of its bucket, or of the whole list when the bucket was empty.
"""

from __future__ import annotations

from collections.abc import Sequence

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
    inserted = np.fromiter(first.values(), dtype=np.int64, count=len(first))
    hashes = hash_bytes([keys[i] for i in inserted.tolist()])
    order = np.zeros(0, dtype=np.int64)   # the list, as indices into `inserted`
    lo = 0
    for capacity in BUCKET_COUNTS:
        hi = min(capacity, len(inserted))
        order = _insert(_rehash(order, hashes, capacity), np.arange(lo, hi), hashes, capacity)
        lo = hi
        if lo == len(inserted):
            return inserted[order].tolist()
    raise ValueError(f"{len(inserted)} keys are more than this emulation of unordered_map handles")


def _first_positions(buckets: np.ndarray, n_buckets: int) -> np.ndarray:
    """Per bucket, the list position of its first node (-1 when empty)."""
    first = np.full(n_buckets, -1, dtype=np.int64)
    present, index = np.unique(buckets, return_index=True)
    first[present] = index
    return first


def _rehash(order: np.ndarray, hashes: np.ndarray, n_buckets: int) -> np.ndarray:
    """_M_rehash_aux walks the list putting each node at the front of its new bucket, and a node
    opening a bucket at the front of the list: buckets end up in reverse order of their first
    node, and each bucket's nodes reversed."""
    buckets = (hashes[order] % np.uint64(n_buckets)).astype(np.int64)
    first = _first_positions(buckets, n_buckets)
    pos = np.arange(len(order))
    return order[np.lexsort((-pos, -first[buckets]))]


def _insert(order: np.ndarray, new: np.ndarray, hashes: np.ndarray, n_buckets: int) -> np.ndarray:
    """Insert `new` one by one: into the front of its bucket, or, opening a bucket, at the front
    of the list. Sort key: bucket rank (new buckets first, latest first), then node rank."""
    old_buckets = (hashes[order] % np.uint64(n_buckets)).astype(np.int64)
    new_buckets = (hashes[new] % np.uint64(n_buckets)).astype(np.int64)
    first = _first_positions(old_buckets, n_buckets)
    opened = np.zeros(n_buckets, dtype=np.int64)
    present, index = np.unique(new_buckets, return_index=True)
    opened[present] = index
    t = np.arange(len(new))
    new_rank = np.where(first[new_buckets] >= 0, first[new_buckets], -(opened[new_buckets] + 1))
    bucket_rank = np.concatenate([first[old_buckets], new_rank])
    node_rank = np.concatenate([np.arange(len(order)), -(t + 1)])
    return np.concatenate([order, new])[np.lexsort((node_rank, bucket_rank))]
