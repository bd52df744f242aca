"""The output buffer of a context: logits and embeddings rows, the batch -> row map, pooled
embeddings per sequence, and llama.cpp's lazy reordering (output_swaps / output_reorder)."""

from __future__ import annotations

import numpy as np


class Outputs:
    """Rows are written in ubatch order; get_* calls see them in batch order."""

    def __init__(self, n_vocab: int, n_embd: int, n_batch: int, n_seq_max: int, has_logits: bool = True,
                 has_embd: bool = False):
        self.n_vocab, self.n_embd, self.n_seq_max = n_vocab, n_embd, n_seq_max
        self.has_logits, self.has_embd = has_logits, has_embd
        self.logits = np.zeros((0, n_vocab), dtype=np.float32)
        self.embd = np.zeros((0, n_embd), dtype=np.float32)
        self.output_ids = np.full(n_batch, -1, dtype=np.int64)
        self.n_outputs = 0
        self.swaps: list[tuple[int, int]] = []
        self.embd_seq: dict[int, np.ndarray] = {}

    @property
    def capacity(self) -> int:
        return max(self.logits.shape[0], self.embd.shape[0])

    def reserve(self, n_outputs: int) -> int:
        """output_reserve: grow (never shrink) to max(n_outputs, n_seq_max) rows; reset the map."""
        n_max = max(n_outputs, self.n_seq_max)
        if self.has_logits and self.logits.shape[0] < n_max:
            self.logits = np.zeros((n_max, self.n_vocab), dtype=np.float32)
        if self.has_embd and self.embd.shape[0] < n_max:
            self.embd = np.zeros((n_max, self.n_embd), dtype=np.float32)
        self.output_ids[:] = -1
        self.n_outputs = 0
        return n_max

    def begin_batch(self) -> None:
        self.swaps.clear()
        self.embd_seq.clear()

    def write(self, row0: int, logits: np.ndarray | None, embd: np.ndarray | None) -> None:
        n = 0 if logits is None and embd is None else len(logits if logits is not None else embd)
        if logits is not None and self.has_logits:
            self.logits[row0:row0 + n] = logits
        if embd is not None and self.has_embd:
            self.embd[row0:row0 + n] = embd

    def finish(self, out_ids: list[int], n_outputs: int) -> None:
        """Map batch positions to rows; record the swaps that restore batch order, applied lazily."""
        self.n_outputs = n_outputs
        ids = list(out_ids)
        for i, batch_idx in enumerate(ids):
            self.output_ids[batch_idx] = i
        self.swaps.clear()
        for i in range(len(ids) - 1):  # selection sort, as llama.cpp does
            j_min = min(range(i, len(ids)), key=lambda j: ids[j])
            if j_min != i:
                ids[i], ids[j_min] = ids[j_min], ids[i]
                self.swaps.append((i, j_min))
        if self.swaps:
            for i, batch_idx in enumerate(ids):
                self.output_ids[batch_idx] = i

    def reorder(self) -> None:
        """output_reorder: apply the pending swaps to the rows (first access after a decode)."""
        for i, j in self.swaps:
            for buf in (self.logits, self.embd):
                if buf.shape[0] > max(i, j):
                    buf[[i, j]] = buf[[j, i]]
        self.swaps.clear()

    def row(self, i: int) -> int:
        """The row of batch token i (negative i counts back from the last output)."""
        self.reorder()
        if self.n_outputs == 0:
            raise IndexError("no outputs: decode a batch that asks for logits first")
        if i < 0:
            j = self.n_outputs + i
            if j < 0:
                raise IndexError(f"negative index {i} out of range [-{self.n_outputs}, 0)")
            return j
        if i >= len(self.output_ids):
            raise IndexError(f"out of range [0, {len(self.output_ids)})")
        j = int(self.output_ids[i])
        if j < 0:
            raise IndexError(f"batch.logits[{i}] != true: token {i} asked for no output")
        if j >= self.n_outputs:
            raise IndexError(f"corrupt output buffer (j={j}, n_outputs={self.n_outputs})")
        return j
