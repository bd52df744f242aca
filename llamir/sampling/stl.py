"""libstdc++'s std::sort and std::partial_sort (GCC 12), reproduced move for move.

Both are unstable: equal keys come out in an order that depends on the algorithm's every swap, and
llama.cpp's candidate order (so which of several equal tokens a sampler keeps or draws) is that
order. Each function returns the permutation the C++ call leaves over `keys` under `a < b`
(callers sort descending by passing negated keys).

When no keys tie (and none is NaN) the result is simply the sorted order, which numpy gives.
Otherwise the algorithms run as in bits/stl_algo.h and stl_heap.h:
- std::sort = introsort: while a range is longer than 16, median-of-three to the front, Hoare
  partition (unguarded), recurse right, loop left; at depth 2*log2(n) a heapsort. Then one
  insertion sort over everything, which for a strict weak order is a stable sort.
- std::partial_sort = heap select (make_heap on the first `middle`, each later key that is less
  than the heap's top replaces it) and sort_heap.
The partition is vectorised (see _partition); heaps run in Python lists.
"""

from __future__ import annotations

import numpy as np

_THRESHOLD = 16   # libstdc++'s _S_threshold


def _has_ties(sorted_keys: np.ndarray) -> bool:
    return bool(np.any(sorted_keys[1:] == sorted_keys[:-1]))


def sort_perm(keys: np.ndarray) -> np.ndarray:
    """The permutation std::sort(first, last, less) leaves."""
    v = np.array(keys, dtype=np.float64)
    n = len(v)
    nan = bool(np.isnan(v).any())
    if not nan and (n < 2 or not _has_ties(np.sort(v))):
        return np.argsort(v, kind="stable")
    perm = np.arange(n)
    if n > 1:
        _introsort_loop(v, perm, 0, n, 2 * (n.bit_length() - 1))
    if not nan:
        return perm[np.argsort(v, kind="stable")]           # the final insertion sort
    vals, pos = v.tolist(), perm.tolist()
    _final_insertion_sort(vals, pos, 0, n)
    return np.array(pos, dtype=np.int64)


def partial_sort_perm(keys: np.ndarray, middle: int) -> np.ndarray:
    """The first `middle` entries of the permutation std::partial_sort(first, first + middle, last,
    less) leaves (the rest is left in an unspecified order, which no caller reads)."""
    v = np.array(keys, dtype=np.float64)
    n = len(v)
    if middle <= 0:
        return np.zeros(0, dtype=np.int64)
    if not np.isnan(v).any():
        top = np.argsort(v, kind="stable") if middle == n else np.argpartition(v, middle)[:middle + 1]
        top = top[np.argsort(v[top], kind="stable")]
        head = v[top[:middle]]
        strict = middle == n or head[-1] < v[top[middle]]
        if strict and not _has_ties(head):
            return top[:middle]
    vals, pos = v.tolist(), list(range(n))
    _heap_select(vals, pos, 0, middle, n, v)
    _sort_heap(vals, pos, 0, middle)
    return np.array(pos[:middle], dtype=np.int64)


# -- introsort ------------------------------------------------------------------------------------
def _introsort_loop(v: np.ndarray, perm: np.ndarray, first: int, last: int, depth: int) -> None:
    while last - first > _THRESHOLD:
        if depth == 0:
            vals, pos = v[first:last].tolist(), perm[first:last].tolist()
            _heap_select(vals, pos, 0, len(vals), len(vals), None)
            _sort_heap(vals, pos, 0, len(vals))
            v[first:last], perm[first:last] = vals, pos
            return
        depth -= 1
        cut = _partition_pivot(v, perm, first, last)
        _introsort_loop(v, perm, cut, last, depth)
        last = cut


def _swap(v: np.ndarray, perm: np.ndarray, i: int, j: int) -> None:
    v[i], v[j] = v[j], v[i]
    perm[i], perm[j] = perm[j], perm[i]


def _partition_pivot(v: np.ndarray, perm: np.ndarray, first: int, last: int) -> int:
    """__unguarded_partition_pivot: the median of v[first+1], v[mid], v[last-1] moves to first and
    pivots the rest."""
    mid = first + (last - first) // 2
    a, b, c = first + 1, mid, last - 1
    if v[a] < v[b]:
        median = b if v[b] < v[c] else (c if v[a] < v[c] else a)
    elif v[a] < v[c]:
        median = a
    else:
        median = c if v[b] < v[c] else b
    _swap(v, perm, first, median)
    return _partition(v, perm, first + 1, last, v[first])


def _partition(v: np.ndarray, perm: np.ndarray, lo: int, hi: int, pivot: float) -> int:
    """__unguarded_partition over [lo, hi) with the pivot at lo - 1, all at once.

    The left scan stops at keys not less than the pivot, the right scan at keys the pivot is not
    less than (the pivot's own slot stops it at the latest). Until they cross, the t-th stops of
    each scan are the t-th such positions of the untouched range, and each pair is swapped. At
    the crossing the left scan stops at its next position, or at the right scan's last swap
    (which now holds a left-stopping key), whichever comes first."""
    seg = v[lo:hi]
    left = np.flatnonzero(~(seg < pivot)) + lo
    right = np.concatenate([np.flatnonzero(~(pivot < seg))[::-1] + lo, [lo - 1]])
    m = min(len(left), len(right))
    crossed = np.flatnonzero(left[:m] >= right[:m])
    t = int(crossed[0]) if len(crossed) else m
    if t:
        i, j = left[:t], right[:t]
        v[i], v[j] = v[j], v[i].copy()
        perm[i], perm[j] = perm[j], perm[i].copy()
    if t < len(left) and (t == 0 or left[t] < right[t - 1]):
        return int(left[t])
    return int(right[t - 1])


def _final_insertion_sort(v: list, p: list, first: int, last: int) -> None:
    """__final_insertion_sort, move by move (for keys that are not a strict weak order: NaN)."""
    if last - first > _THRESHOLD:
        _insertion_sort(v, p, first, first + _THRESHOLD)
        for i in range(first + _THRESHOLD, last):
            _unguarded_linear_insert(v, p, i)
    else:
        _insertion_sort(v, p, first, last)


def _insertion_sort(v: list, p: list, first: int, last: int) -> None:
    for i in range(first + 1, last):
        if v[i] < v[first]:
            val, pay = v[i], p[i]
            v[first + 1:i + 1], p[first + 1:i + 1] = v[first:i], p[first:i]
            v[first], p[first] = val, pay
        else:
            _unguarded_linear_insert(v, p, i)


def _unguarded_linear_insert(v: list, p: list, last: int) -> None:
    val, pay = v[last], p[last]
    prev = last - 1
    while val < v[prev]:
        v[last], p[last] = v[prev], p[prev]
        last, prev = prev, prev - 1
    v[last], p[last] = val, pay


# -- heaps ----------------------------------------------------------------------------------------
def _half(x: int) -> int:
    """C's x / 2 (truncates toward zero)."""
    return x // 2 if x >= 0 else -((-x) // 2)


def _adjust_heap(v: list, p: list, base: int, hole: int, length: int, val: float, pay: int) -> None:
    top = child = hole
    while child < _half(length - 1):
        child = 2 * (child + 1)
        if v[base + child] < v[base + child - 1]:
            child -= 1
        v[base + hole], p[base + hole] = v[base + child], p[base + child]
        hole = child
    if length & 1 == 0 and child == _half(length - 2):
        child = 2 * (child + 1)
        v[base + hole], p[base + hole] = v[base + child - 1], p[base + child - 1]
        hole = child - 1
    parent = _half(hole - 1)
    while hole > top and v[base + parent] < val:       # __push_heap
        v[base + hole], p[base + hole] = v[base + parent], p[base + parent]
        hole = parent
        parent = _half(hole - 1)
    v[base + hole], p[base + hole] = val, pay


def _pop_heap(v: list, p: list, first: int, last: int, result: int) -> None:
    val, pay = v[result], p[result]
    v[result], p[result] = v[first], p[first]
    _adjust_heap(v, p, first, 0, last - first, val, pay)


def _make_heap(v: list, p: list, first: int, last: int) -> None:
    length = last - first
    if length < 2:
        return
    for parent in range(_half(length - 2), -1, -1):
        _adjust_heap(v, p, first, parent, length, v[first + parent], p[first + parent])


def _sort_heap(v: list, p: list, first: int, last: int) -> None:
    while last - first > 1:
        last -= 1
        _pop_heap(v, p, first, last, last)


def _heap_select(v: list, p: list, first: int, middle: int, last: int, scan: np.ndarray | None) -> None:
    """__heap_select. Each key after `middle` is read once, before anything writes its slot, so
    `scan` (the original keys as an array) finds the ones below the heap's top in chunks; the heap's
    top only grows, so a chunk's candidates are rechecked one by one against the current top."""
    _make_heap(v, p, first, middle)
    if middle == first:
        for i in range(middle, last):
            if v[i] < v[first]:
                _pop_heap(v, p, first, middle, i)
        return
    if scan is None:
        for i in range(middle, last):
            if v[i] < v[first]:
                _pop_heap(v, p, first, middle, i)
        return
    start, chunk = middle, 256
    while start < last:
        stop = min(last, start + chunk)
        for i in (np.flatnonzero(scan[start:stop] < v[first]) + start).tolist():
            if v[i] < v[first]:
                _pop_heap(v, p, first, middle, i)
        start, chunk = stop, min(chunk * 2, 1 << 16)
