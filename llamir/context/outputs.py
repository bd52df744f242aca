"""The output buffer of a context: logits and embeddings rows, the batch -> row map, pooled
embeddings per sequence, and llama.cpp's lazy reordering (output_swaps / output_reorder)."""

from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np


class OutputError(LookupError):
    """An output that the last batch did not produce (llama.cpp logs it and returns NULL)."""


LLAMA_TOKEN_NULL = -1


class SampledRows:
    """The backend samplers' section of the output buffer (llama_context's `sampling`): per output
    row the sampled token (LLAMA_TOKEN_NULL when none), and the logits, probabilities and candidate
    ids the in-graph prefix left, with their counts (0: none)."""

    def __init__(self, n_rows: int, n_vocab: int):
        self.token = np.full(n_rows, LLAMA_TOKEN_NULL, dtype=np.int32)
        self.logits = np.zeros((n_rows, n_vocab), dtype=np.float32)
        self.probs = np.zeros((n_rows, n_vocab), dtype=np.float32)
        self.candidates = np.zeros((n_rows, n_vocab), dtype=np.int32)
        self.logits_count = np.zeros(n_rows, dtype=np.int64)
        self.probs_count = np.zeros(n_rows, dtype=np.int64)
        self.candidates_count = np.zeros(n_rows, dtype=np.int64)

    @property
    def arrays(self) -> tuple[np.ndarray, ...]:
        return (self.token, self.logits, self.probs, self.candidates, self.logits_count, self.probs_count,
                self.candidates_count)

    def copy(self) -> SampledRows:
        out = SampledRows.__new__(SampledRows)
        (out.token, out.logits, out.probs, out.candidates, out.logits_count, out.probs_count,
         out.candidates_count) = (a.copy() for a in self.arrays)
        return out

    def write(self, row: int, token, logits, probs, candidates) -> None:
        """One row from the graph's outputs (None: the prefix did not produce it)."""
        if token is not None:
            self.token[row] = int(np.asarray(token).reshape(-1)[0])
        for values, buf, count in ((logits, self.logits, self.logits_count), (probs, self.probs, self.probs_count)):
            if values is not None:
                v = np.asarray(values, dtype=np.float32).reshape(-1)
                buf[row, :len(v)] = v
                count[row] = len(v)
        if candidates is not None:
            c = np.asarray(candidates, dtype=np.int32).reshape(-1)
            self.candidates[row, :len(c)] = c
            self.candidates_count[row] = len(c)

    def swap(self, i: int, j: int) -> None:
        for buf in self.arrays:
            buf[[i, j]] = buf[[j, i]]


@dataclass
class _Previous:
    """The outputs of the last successful batch, while a new one is being written."""

    logits: np.ndarray
    embd: np.ndarray
    logits_rows: np.ndarray       # the rows the new batch overwrites, as they were
    embd_rows: np.ndarray
    output_ids: np.ndarray
    n_outputs: int
    swaps: list[tuple[int, int]]
    embd_seq: dict[int, np.ndarray]
    sampled: SampledRows | None


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
        self.sampled: SampledRows | None = None   # only for a batch a backend sampler saw
        self._previous: _Previous | None = None

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

    def begin(self, n_outputs: int, sampling: bool = False) -> None:
        """Start a batch of n_outputs rows (output_reserve). What the batch overwrites is kept
        (only the rows it writes over, not the whole buffer) until commit() or abandon(). With
        `sampling` (a backend sampler has a sequence in the batch) the sampled section is made,
        every token LLAMA_TOKEN_NULL and every count 0 until the graph writes them."""
        kept = min(self.n_outputs, n_outputs)
        self._previous = _Previous(self.logits, self.embd, self.logits[:kept].copy(), self.embd[:kept].copy(),
                                   self.output_ids.copy(), self.n_outputs, self.swaps, self.embd_seq, self.sampled)
        self.swaps, self.embd_seq = [], {}
        self.reserve(n_outputs)
        self.sampled = SampledRows(max(n_outputs, self.n_seq_max), self.n_vocab) if sampling else None

    def commit(self, out_ids: list[int], n_outputs: int) -> None:
        """The batch succeeded: its rows become the outputs (see finish)."""
        self.finish(out_ids, n_outputs)
        self._previous = None

    def abandon(self) -> None:
        """The batch failed: the previous batch's outputs are back, exactly as they were."""
        prev, self._previous = self._previous, None
        if prev is None:
            return
        self.logits, self.embd = prev.logits, prev.embd
        self.logits[:len(prev.logits_rows)] = prev.logits_rows
        self.embd[:len(prev.embd_rows)] = prev.embd_rows
        self.output_ids, self.n_outputs = prev.output_ids, prev.n_outputs
        self.swaps, self.embd_seq, self.sampled = prev.swaps, prev.embd_seq, prev.sampled

    def commit_one(self, logits: np.ndarray | None, embd: np.ndarray | None) -> None:
        """begin(1), write(0, logits, embd) and commit([0], 1) at once, for a batch whose one
        output is its token 0 (a generated token), once its compute has succeeded: there is
        nothing to put back, so nothing is kept."""
        self.swaps, self.embd_seq, self.sampled = [], {}, None
        n_max = max(1, self.n_seq_max)
        if (self.has_logits and self.logits.shape[0] < n_max) or (self.has_embd and self.embd.shape[0] < n_max):
            self.reserve(1)
        elif not (self.n_outputs == 1 and self.output_ids[0] == 0):
            # the map holds exactly n_outputs rows: with the one row at token 0, the rest is -1
            self.output_ids[:] = -1
        self.write(0, logits, embd)
        self.output_ids[0] = 0
        self.n_outputs = 1

    def write(self, row0: int, logits: np.ndarray | None, embd: np.ndarray | None) -> None:
        n = 0 if logits is None and embd is None else len(logits if logits is not None else embd)
        if logits is not None and self.has_logits:
            self.logits[row0:row0 + n] = logits
        if embd is not None and self.has_embd:
            self.embd[row0:row0 + n] = embd

    def finish(self, out_ids: list[int], n_outputs: int) -> None:
        """Map batch positions to rows; record the swaps that restore batch order, applied lazily."""
        self.n_outputs = n_outputs
        self.swaps.clear()
        if len(out_ids) == 1:   # one output row (a generated token): nothing to sort
            self.output_ids[out_ids[0]] = 0
            return
        ids = list(out_ids)
        for i, batch_idx in enumerate(ids):
            self.output_ids[batch_idx] = i
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
            if self.sampled is not None:
                self.sampled.swap(i, j)
        self.swaps.clear()

    def row(self, i: int) -> int:
        """The row of batch token i (negative i counts back from the last output)."""
        try:
            i = operator.index(i)
        except TypeError:
            raise OutputError(f"output index must be an integer, got {type(i).__name__} {i!r}") from None
        self.reorder()
        if self.n_outputs == 0:
            raise OutputError("no outputs: decode a batch that asks for logits first")
        if i < 0:
            j = self.n_outputs + i
            if j < 0:
                raise OutputError(f"negative index {i} out of range [-{self.n_outputs}, 0)")
            return j
        if i >= len(self.output_ids):
            raise OutputError(f"index {i} out of range [0, {len(self.output_ids)})")
        j = int(self.output_ids[i])
        if j < 0:
            raise OutputError(f"batch.logits[{i}] != true: token {i} asked for no output")
        if j >= self.n_outputs:
            raise OutputError(f"corrupt output buffer (j={j}, n_outputs={self.n_outputs})")
        return j

    # -- the backend samplers' section --------------------------------------------------------------
    def sampled_row(self, i: int) -> int | None:
        """The row of batch token i in the sampled section, None when no backend sampler ran."""
        if self.sampled is None:
            return None
        return self.row(i)

