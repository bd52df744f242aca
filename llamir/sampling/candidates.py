"""llama_token_data_array: the candidates a sampler chain narrows down to one token."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(eq=False)
class TokenDataArray:
    """Candidate tokens as llama.cpp's llama_token_data_array, one numpy array per field.

    `ids` (int32), `logits` and `p` (float32) have one entry per candidate, in the array's current
    order; `selected` is an index into them (-1: none yet) and `sorted` says the logits are in
    descending order. Samplers change all of it in place and may replace the arrays with shorter
    ones; `take` is the one way they reorder or drop candidates."""

    ids: np.ndarray
    logits: np.ndarray
    p: np.ndarray
    selected: int = -1
    sorted: bool = False

    def __post_init__(self) -> None:
        self.ids = np.ascontiguousarray(self.ids, dtype=np.int32)
        self.logits = np.ascontiguousarray(self.logits, dtype=np.float32)
        self.p = np.ascontiguousarray(self.p, dtype=np.float32)
        if not self.ids.ndim == self.logits.ndim == self.p.ndim == 1:
            raise ValueError(f"TokenDataArray fields must be 1-D, got ids {self.ids.shape}, "
                             f"logits {self.logits.shape}, p {self.p.shape}")
        if not len(self.ids) == len(self.logits) == len(self.p):
            raise ValueError(f"TokenDataArray fields differ in length: ids {len(self.ids)}, "
                             f"logits {len(self.logits)}, p {len(self.p)}")

    @classmethod
    def from_logits(cls, row) -> TokenDataArray:
        """Every token of one row of logits [n_vocab], in id order, p = 0 (as llama_sampler_sample fills it)."""
        logits = np.array(row, dtype=np.float32)
        if logits.ndim != 1:
            raise ValueError(f"a row of logits must be 1-D [n_vocab], got shape {logits.shape}")
        return cls(np.arange(len(logits), dtype=np.int32), logits, np.zeros(len(logits), dtype=np.float32))

    @property
    def size(self) -> int:
        return len(self.ids)

    def __len__(self) -> int:
        return len(self.ids)

    def take(self, order: np.ndarray) -> None:
        """Keep the candidates at positions `order`, in that order (a permutation or a subset)."""
        self.ids, self.logits, self.p = self.ids[order], self.logits[order], self.p[order]

    def truncate(self, n: int) -> None:
        """Keep the first n candidates (llama.cpp's `cur_p->size = n`)."""
        self.ids, self.logits, self.p = self.ids[:n], self.logits[:n], self.p[:n]

    def copy(self) -> TokenDataArray:
        return TokenDataArray(self.ids.copy(), self.logits.copy(), self.p.copy(), self.selected, self.sorted)

    @property
    def selected_token(self) -> int:
        """The id of the selected candidate; an error when no sampler selected one."""
        if not 0 <= self.selected < len(self.ids):
            raise RuntimeError(f"no token was selected (selected = {self.selected} of {len(self.ids)} candidates): "
                               "end the chain with a sampler that picks one (Dist, Greedy, Mirostat, MirostatV2)")
        return int(self.ids[self.selected])
