"""llama-sampler.cpp's shared steps: its partial sorts, softmax, top-k and temperature.

The candidate order they leave is llama.cpp's exactly: up to 128 candidates are ordered by
std::partial_sort; more go through llama.cpp's bucket sort (128 buckets of logit over [-10, 10],
bucket = int(6.4f * logit + 64.0f) clamped, so the x86 conversion sends NaN, infinities and huge
logits to bucket 0), every bucket above the cut std::sort-ed and the cut bucket partially sorted.
"""

from __future__ import annotations

import numpy as np

from llamir.sampling import stl
from llamir.sampling.candidates import TokenDataArray
from llamir.sampling.floats import expf, fold_max, sum_f32, to_int_array

f32 = np.float32
N_BUCKETS = 128
_BUCKET_SCALE = f32(N_BUCKETS) / f32(20.0)     # nbuckets / (bucket_high - bucket_low)
_BUCKET_INTER = f32(10.0) * _BUCKET_SCALE       # -bucket_low * bucket_scale


def buckets(logits: np.ndarray) -> np.ndarray:
    """Each logit's bucket: clamp(int(6.4f * logit + 64.0f), 0, 127) in float, with x86's int()."""
    with np.errstate(all="ignore"):
        scaled = _BUCKET_SCALE * np.asarray(logits, dtype=f32) + _BUCKET_INTER
    return np.clip(to_int_array(scaled), 0, N_BUCKETS - 1)


def bucket_partial_sort(logits: np.ndarray, npartial: int) -> np.ndarray:
    """llama_token_data_array_partial_sort: positions of the first `npartial` candidates of its
    result, in order (descending logit)."""
    bucket = buckets(logits)
    histo = np.bincount(bucket, minlength=N_BUCKETS)
    from_top = np.cumsum(histo[::-1])
    cut = N_BUCKETS - 1 - int(np.argmax(from_top >= npartial))   # the lowest bucket taken
    members = np.flatnonzero(bucket >= cut)
    members = members[np.argsort(-bucket[members], kind="stable")]   # bucket by bucket, in array order
    keys = -logits[members].astype(np.float64)                          # comp is a.logit > b.logit
    if not np.isnan(keys).any() and not _ties(keys):
        order = np.lexsort((keys, -bucket[members]))
        return members[order[:npartial]]
    out, start = [], 0
    for b in range(N_BUCKETS - 1, cut - 1, -1):
        n = int(histo[b])
        seg = slice(start, start + n)
        if b > cut:
            out.append(members[seg][stl.sort_perm(keys[seg])])
        else:
            out.append(members[seg][stl.partial_sort_perm(keys[seg], npartial - start)])
        start += n
    return np.concatenate(out)[:npartial] if out else np.zeros(0, dtype=np.int64)


def _ties(keys: np.ndarray) -> bool:
    s = np.sort(keys)
    return bool(np.any(s[1:] == s[:-1]))


def partial_sort_inplace(cur: TokenDataArray, npartial: int) -> None:
    """llama_token_data_array_partial_sort_inplace: the first `npartial` candidates, sorted."""
    if npartial <= 128:
        order = stl.partial_sort_perm(-cur.logits.astype(np.float64), npartial)
    else:
        order = bucket_partial_sort(cur.logits, npartial)
    cur.take(order)
    cur.sorted = True


def softmax(cur: TokenDataArray, do_sort: bool) -> None:
    """llama_sampler_softmax_impl: p = expf(logit - max) / sum, in float (sorting first if asked)."""
    if cur.size == 0:
        raise RuntimeError("softmax over an empty candidate array (llama.cpp asserts cur_p->size > 0)")
    if do_sort and not cur.sorted:
        partial_sort_inplace(cur, cur.size)
    max_l = cur.logits[0] if cur.sorted else fold_max(cur.logits[1:], cur.logits[0])
    with np.errstate(all="ignore"):
        p = expf(cur.logits - max_l)
        cur.p = p / sum_f32(p)


def top_k(cur: TokenDataArray, k: int) -> None:
    """llama_sampler_top_k_impl: the k highest logits, sorted (k <= 0 keeps everything)."""
    if k <= 0:
        return
    k = min(k, cur.size)
    if not cur.sorted:
        partial_sort_inplace(cur, k)
    cur.truncate(k)


def temperature(cur: TokenDataArray, temp) -> None:
    """llama_sampler_temp_impl: logit / temp; temp <= 0 keeps only the first highest logit (the
    others become -inf)."""
    if cur.size == 0:
        return
    temp = f32(temp)
    if temp <= 0:
        keep = first_max_index(cur.logits)
        kept = cur.logits[keep]
        cur.logits = np.full(cur.size, -np.inf, dtype=f32)
        cur.logits[keep] = kept
        return
    with np.errstate(all="ignore"):
        cur.logits = cur.logits / temp


def first_max_index(logits: np.ndarray) -> int:
    """The index a `if (x[i] > x[best]) best = i` scan from 0 ends on (NaNs never win, a NaN at 0 does)."""
    if np.isnan(logits[0]):
        return 0
    masked = np.where(np.isnan(logits), -np.inf, logits)
    best = int(np.argmax(masked))
    return best if masked[best] > logits[0] else 0
