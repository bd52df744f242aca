"""The fill-in-the-middle sampler (llama_sampler_init_infill): prefers end-of-generation when it is
likely enough, merges tokens whose text is a prefix of another's, and drops unlikely ones."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from llamir.sampling.candidates import TokenDataArray
from llamir.sampling.floats import sum_f32
from llamir.sampling.ordering import softmax
from llamir.sampling.sampler import Sampler

if TYPE_CHECKING:
    from llamir.frontend.vocab import Vocab

f32 = np.float32


class Infill(Sampler):
    """After softmax (sorted): if 3 * P(EOG) * n > P(text), keep only the EOG tokens. Otherwise a
    token whose piece is a prefix of another's absorbs it (into the likelier of the two), tokens
    with p < 0.2 go, then those below 1 / (n_text + 1); with no text token left, the answer is EOT
    (or EOS). Meant after top-k / top-p: the merge compares every pair."""

    NAME = "infill"

    def __init__(self, vocab: Vocab):
        for method in ("is_eog", "token_to_piece"):
            if not callable(getattr(vocab, method, None)):
                raise ValueError(f"Infill: vocab must be a llamir Vocab (with {method}), got {vocab!r}")
        self.vocab = vocab

    def clone(self) -> Infill:
        return Infill(self.vocab)

    def apply(self, cur: TokenDataArray) -> None:
        softmax(cur, True)
        eog = np.array([self.vocab.is_eog(int(t)) for t in cur.ids], dtype=bool)
        p_eog, p_txt = sum_f32(cur.p[eog]), sum_f32(cur.p[~eog])
        if f32(3) * p_eog * f32(cur.size) > p_txt:
            cur.take(np.flatnonzero(eog))
            with np.errstate(all="ignore"):
                cur.p = cur.p / sum_f32(cur.p)
            return
        self._merge_prefixes(cur)
        kept = np.flatnonzero(~(cur.p < f32(0.2)) | eog)
        n_text = int(np.count_nonzero(~eog[kept]))
        if n_text == 0:
            self._end_of_text(cur, kept)
            return
        cur.take(kept)
        eog = eog[kept]
        with np.errstate(all="ignore"):
            cur.p = cur.p / sum_f32(cur.p)
            threshold = f32(1.0 / (n_text + 1))
        cur.take(np.flatnonzero(~(cur.p < threshold) | eog))
        with np.errstate(all="ignore"):
            cur.p = cur.p / sum_f32(cur.p)

    def _merge_prefixes(self, cur: TokenDataArray) -> None:
        """For each pair (i0, i1) in order: if piece(i0) is a non-empty prefix of piece(i1), the less
        likely one's p moves to the other and it becomes logit -inf, p 0."""
        pieces = [self.vocab.token_to_piece(int(t), 0, False) for t in cur.ids]
        logits, p = cur.logits.tolist(), cur.p.tolist()
        n = len(pieces)
        for i0 in range(n):
            for i1 in range(n):
                if logits[i0] == -np.inf:
                    break
                if i0 == i1 or logits[i1] == -np.inf:
                    continue
                a, b = pieces[i0], pieces[i1]
                if a and b.startswith(a):
                    dst, src = (i1, i0) if p[i1] > p[i0] else (i0, i1)
                    p[dst] = float(f32(p[dst]) + f32(p[src]))
                    logits[src], p[src] = -np.inf, 0.0
        cur.logits, cur.p = np.array(logits, dtype=f32), np.array(p, dtype=f32)

    def _end_of_text(self, cur: TokenDataArray, kept: np.ndarray) -> None:
        """No text token survived: one candidate, EOT (else EOS), logit 1; its p is that of the first
        kept candidate (or of the first candidate when none was kept)."""
        token = self.vocab.eot if self.vocab.eot is not None else self.vocab.eos
        if token is None:
            raise RuntimeError("Infill: the vocab has neither an EOT nor an EOS token to end the infill with")
        first = int(kept[0]) if len(kept) else 0
        cur.ids = np.array([token], dtype=np.int32)
        cur.logits = np.array([1.0], dtype=f32)
        cur.p = cur.p[first:first + 1].copy()
