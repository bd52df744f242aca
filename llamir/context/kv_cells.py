"""KV cells of one stream (llama_kv_cells): a position, a shift and a sequence set per cell."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_NO_POS = np.iinfo(np.int32).max


@dataclass
class CellsSnapshot:
    pos: np.ndarray
    seq: np.ndarray
    shift: np.ndarray
    has_shift: bool


class KVCells:
    """Vectorised cell metadata: pos (-1 = empty), shift since the last K-shift, seq membership."""

    def __init__(self, size: int, n_seq_max: int):
        self.size = size
        self.n_seq_max = n_seq_max
        self.pos = np.full(size, -1, dtype=np.int32)
        self.shift = np.zeros(size, dtype=np.int32)
        self.seq = np.zeros((size, n_seq_max), dtype=bool)
        self.has_shift = False
        self._n_used = 0                       # kept as cells change, like llama.cpp's `used` set
        self._used_max_p1: int | None = 0      # None: recount on the next query
        # seq_pos_max per sequence as last computed, kept up to date by the mutations below (each
        # generated token asks for it); whoever writes pos/seq directly calls recount()
        self._pos_max: dict[int, int] = {}

    # -- queries ----------------------------------------------------------------------------------
    def is_empty(self, i: int) -> bool:
        return self.pos[i] == -1

    def get_used(self) -> int:
        return self._n_used

    def used_max_p1(self) -> int:
        if self._used_max_p1 is None:
            used = np.flatnonzero(self.pos >= 0)
            self._used_max_p1 = int(used[-1]) + 1 if len(used) else 0
        return self._used_max_p1

    def recount(self) -> None:
        """Recompute the used count (and, lazily, used_max_p1 and the sequences' largest
        positions) after cells were set directly."""
        self._n_used = int(np.count_nonzero(self.pos >= 0))
        self._used_max_p1 = None
        self._pos_max.clear()

    def seq_count(self, i: int) -> int:
        return int(self.seq[i].sum())

    def seq_get(self, i: int) -> int:
        """The only sequence of cell i (it must hold exactly one)."""
        return int(np.nonzero(self.seq[i])[0][0])

    def seq_has(self, i: int, s: int) -> bool:
        return bool(self.seq[i, s])

    def seq_pos_min(self, s: int) -> int:
        p = int(self.pos.min(where=self.seq[:, s], initial=_NO_POS))
        return -1 if p == _NO_POS else p

    def seq_pos_max(self, s: int) -> int:
        p = self._pos_max.get(s)
        if p is None:
            p = self._pos_max[s] = int(self.pos.max(where=self.seq[:, s], initial=-1))
        return p

    def cells_of(self, s: int) -> np.ndarray:
        return np.nonzero(self.seq[:, s])[0]

    # -- mutations --------------------------------------------------------------------------------
    def reset(self) -> None:
        self.pos[:] = -1
        self.shift[:] = 0
        self.seq[:] = False
        self.has_shift = False
        self._n_used, self._used_max_p1 = 0, 0
        self._pos_max.clear()

    def rm(self, i: int) -> None:
        if self.pos[i] >= 0:
            self._n_used -= 1
            if i + 1 == self._used_max_p1:
                self._used_max_p1 = None
            if self._pos_max:
                for s in np.flatnonzero(self.seq[i]).tolist():
                    self._pos_max.pop(s, None)
        self.pos[i] = -1
        self.shift[i] = 0
        self.seq[i] = False

    def seq_rm(self, i: int, s: int) -> bool:
        """Drop s from cell i; empty the cell (and return True) when no sequence remains."""
        self.seq[i, s] = False
        self._pos_max.pop(s, None)
        if not self.seq[i].any():
            self.rm(i)
            return True
        return False

    def seq_keep(self, i: int, s: int) -> bool:
        self._pos_max.clear()
        if self.seq[i, s]:
            self.seq[i] = False
            self.seq[i, s] = True
            return False
        if self.seq[i].any():
            self.rm(i)
            return True
        return False

    def seq_add(self, i: int, s: int) -> None:
        if self.pos[i] < 0:
            raise ValueError(f"seq_add({i}, {s}) on an empty cell")
        self.seq[i, s] = True
        p = self._pos_max.get(s)
        if p is not None and self.pos[i] > p:
            self._pos_max[s] = int(self.pos[i])

    def pos_set(self, i: int, p: int) -> None:
        if self.pos[i] != -1 or p < 0:
            raise ValueError(f"pos_set({i}, {p}): the cell holds position {self.pos[i]}, or {p} is negative")
        self.pos[i] = p
        self._n_used += 1
        if self._used_max_p1 is not None and i >= self._used_max_p1:
            self._used_max_p1 = i + 1

    def occupy(self, idxs: np.ndarray, pos: np.ndarray, seq_ids: list[tuple[int, ...]]) -> None:
        """pos_set(idxs[k], pos[k]) then seq_add(idxs[k], s) for each s of seq_ids[k], at once: the
        cells must be empty and distinct, the positions >= 0 (what apply_ubatch gives a free slot)."""
        if len(idxs) == 0:
            return
        if (self.pos[idxs] != -1).any() or int(pos.min()) < 0:
            raise ValueError(f"occupy: cells {idxs.tolist()} are not all empty, or a position is negative")
        self.pos[idxs] = pos
        first = seq_ids[0]
        if all(ids is first for ids in seq_ids):
            for s in first:
                self.seq[idxs, s] = True
        else:
            for idx, ids in zip(idxs.tolist(), seq_ids):
                self.seq[idx, list(ids)] = True
        self._n_used += len(idxs)
        top = int(idxs.max()) + 1
        if self._used_max_p1 is not None and top > self._used_max_p1:
            self._used_max_p1 = top
        if self._pos_max:
            for k, ids in enumerate(seq_ids):
                p = int(pos[k])
                for s in ids:
                    known = self._pos_max.get(s)
                    if known is not None and p > known:
                        self._pos_max[s] = p

    def pos_add(self, i: int, d: int) -> bool:
        """pos += d and shift += d; a position below 0 empties the cell (returns True)."""
        self.has_shift = True
        self._pos_max.clear()
        if self.pos[i] + d < 0:
            self.rm(i)
            return True
        self.pos[i] += d
        self.shift[i] += d
        return False

    def pos_div(self, i: int, d: int) -> None:
        """pos /= d. Like llama.cpp, shift grows by old - new (sic: the opposite sign of pos_add)."""
        old = int(self.pos[i])
        new = int(old / d)
        self._pos_max.clear()
        self.pos[i] = new
        self.shift[i] += old - new
        self.has_shift = True

    def reset_shift(self) -> None:
        self.shift[:] = 0
        self.has_shift = False

    def snapshot(self) -> CellsSnapshot:
        return CellsSnapshot(self.pos.copy(), self.seq.copy(), self.shift.copy(), self.has_shift)

    def restore(self, snap: CellsSnapshot) -> None:
        self.pos[:] = snap.pos
        self.seq[:] = snap.seq
        self.shift[:] = snap.shift
        self.has_shift = snap.has_shift
        self.recount()
