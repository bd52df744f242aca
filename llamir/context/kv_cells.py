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
        """Recompute the used count (and, lazily, used_max_p1) after cells were set directly."""
        self._n_used = int(np.count_nonzero(self.pos >= 0))
        self._used_max_p1 = None

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
        return int(self.pos.max(where=self.seq[:, s], initial=-1))

    def cells_of(self, s: int) -> np.ndarray:
        return np.nonzero(self.seq[:, s])[0]

    # -- mutations --------------------------------------------------------------------------------
    def reset(self) -> None:
        self.pos[:] = -1
        self.shift[:] = 0
        self.seq[:] = False
        self.has_shift = False
        self._n_used, self._used_max_p1 = 0, 0

    def rm(self, i: int) -> None:
        if self.pos[i] >= 0:
            self._n_used -= 1
            if i + 1 == self._used_max_p1:
                self._used_max_p1 = None
        self.pos[i] = -1
        self.shift[i] = 0
        self.seq[i] = False

    def seq_rm(self, i: int, s: int) -> bool:
        """Drop s from cell i; empty the cell (and return True) when no sequence remains."""
        self.seq[i, s] = False
        if not self.seq[i].any():
            self.rm(i)
            return True
        return False

    def seq_keep(self, i: int, s: int) -> bool:
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

    def pos_set(self, i: int, p: int) -> None:
        if self.pos[i] != -1 or p < 0:
            raise ValueError(f"pos_set({i}, {p}): the cell holds position {self.pos[i]}, or {p} is negative")
        self.pos[i] = p
        self._n_used += 1
        if self._used_max_p1 is not None and i >= self._used_max_p1:
            self._used_max_p1 = i + 1

    def pos_add(self, i: int, d: int) -> bool:
        """pos += d and shift += d; a position below 0 empties the cell (returns True)."""
        self.has_shift = True
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
