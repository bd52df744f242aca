"""The samplers that look at history: penalties (repeat/frequency/presence over the last n accepted
tokens) and DRY (penalise tokens that would extend a repetition), as llama-sampler.cpp does them."""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from llamir.sampling.candidates import TokenDataArray
from llamir.sampling.floats import logf1, pow_double, to_int
from llamir.sampling.sampler import Sampler, check_float, check_int

if TYPE_CHECKING:
    from llamir.frontend.vocab import Vocab

f32 = np.float32
_FLOAT_MAX_LOG = f32(88.7228391)
_DRY_MAX_CHAR_LEN = 40   # bytes of one sequence breaker
_DRY_MAX_SEQ_LEN = 20    # tokens of a breaker's tail


class Penalties(Sampler):
    """For each candidate seen c > 0 times among the last `penalty_last_n` accepted tokens:
    logit = logit * repeat (logit <= 0) or logit / repeat, then logit -= c * freq + present.
    Off when last_n == 0 or (repeat, freq, present) == (1, 0, 0)."""

    NAME = "penalties"

    def __init__(self, n_vocab: int, penalty_last_n: int, penalty_repeat: float, penalty_freq: float,
                 penalty_present: float):
        owner = "Penalties"
        self.n_vocab = check_int(owner, "n_vocab", n_vocab, 1)
        self.penalty_last_n = check_int(owner, "penalty_last_n", penalty_last_n, 0)
        self.penalty_repeat = check_float(owner, "penalty_repeat", penalty_repeat)
        self.penalty_freq = check_float(owner, "penalty_freq", penalty_freq)
        self.penalty_present = check_float(owner, "penalty_present", penalty_present)
        if not (math.isfinite(self.penalty_repeat) and self.penalty_repeat > 0
                and math.isfinite(f32(1) / self.penalty_repeat)):
            raise ValueError(f"Penalties: penalty_repeat must be finite and greater than 0, got {penalty_repeat!r}")
        for name in ("penalty_freq", "penalty_present"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"Penalties: {name} must be finite, got {getattr(self, name)!r}")
        self.empty = self.penalty_last_n == 0 or (self.penalty_repeat == 1 and self.penalty_freq == 0
                                                  and self.penalty_present == 0)
        self.prev: deque[int] = deque(maxlen=max(self.penalty_last_n, 1))
        self.token_count: Counter[int] = Counter()

    def accept(self, token: int) -> None:
        if self.empty:
            return
        token = int(token)
        self.token_count[token] += 1
        if len(self.prev) >= self.penalty_last_n:
            old = self.prev[0]
            self.token_count[old] -= 1
            if self.token_count[old] == 0:
                del self.token_count[old]
        self.prev.append(token)

    def apply(self, cur: TokenDataArray) -> None:
        if self.empty:
            return
        cur.sorted = False
        if not self.token_count:
            return
        seen = np.array(sorted(self.token_count), dtype=np.int64)
        counts = np.array([self.token_count[t] for t in seen.tolist()], dtype=f32)
        at = np.minimum(np.searchsorted(seen, cur.ids), len(seen) - 1)
        hit = np.flatnonzero(seen[at] == cur.ids)
        logits = cur.logits[hit]
        with np.errstate(all="ignore"):
            logits = np.where(logits <= 0, logits * self.penalty_repeat, logits / self.penalty_repeat)
            logits = logits - (counts[at[hit]] * self.penalty_freq + f32(1) * self.penalty_present)
        cur.logits[hit] = logits

    def reset(self) -> None:
        self.prev.clear()
        self.token_count.clear()


class Dry(Sampler):
    """DRY ("don't repeat yourself"): a candidate that would extend a repetition of length L >=
    allowed_length among the last `dry_penalty_last_n` tokens loses multiplier * base^(L - allowed)
    from its logit. Sequence breakers (strings, tokenized against `vocab` as llama.cpp does) cut the
    repetitions short and are never penalised themselves. Off when multiplier == 0, base < 1 or
    last_n == 0."""

    NAME = "dry"

    def __init__(self, vocab: Vocab | None, dry_multiplier: float, dry_base: float, dry_allowed_length: int,
                 dry_penalty_last_n: int, seq_breakers: Sequence[str | bytes] = ()):
        self.multiplier = check_float("Dry", "dry_multiplier", dry_multiplier)
        self.base = check_float("Dry", "dry_base", dry_base)
        self.allowed_length = check_int("Dry", "dry_allowed_length", dry_allowed_length)
        self.penalty_last_n = check_int("Dry", "dry_penalty_last_n", dry_penalty_last_n, 0)
        if isinstance(seq_breakers, str | bytes):
            raise ValueError(f"Dry: seq_breakers must be a list of strings, got the string {seq_breakers!r}")
        self.empty = self.multiplier == 0 or not self.base >= 1 or self.penalty_last_n == 0
        self.breakers: dict[int, list[tuple[int, ...]]] = {}
        self.last_tokens: deque[int] = deque(maxlen=max(self.penalty_last_n, 1))
        if self.empty:
            return
        texts = [_breaker_bytes(b) for b in seq_breakers]
        texts = [t[:_DRY_MAX_CHAR_LEN] for t in texts if t]
        if texts and vocab is None:
            raise ValueError("Dry: a vocab is needed to tokenize the sequence breakers")
        if texts:
            words = [vocab.detokenize_bytes([t], remove_special=False, unparse_special=True)
                     for t in range(vocab.n_tokens)]
            for text in texts:
                _overlapping_token_sequences(vocab, words, text, self.breakers)

    @classmethod
    def from_token_breakers(cls, dry_multiplier: float, dry_base: float, dry_allowed_length: int,
                            dry_penalty_last_n: int, seq_breakers: Sequence[Sequence[int]]) -> Dry:
        """Sequence breakers given as token sequences (llama.cpp's llama_sampler_init_dry_testing)."""
        dry = cls(None, dry_multiplier, dry_base, dry_allowed_length, dry_penalty_last_n)
        if not dry.empty:
            for seq in seq_breakers:
                if len(seq):
                    dry.breakers.setdefault(int(seq[0]), []).append(tuple(int(t) for t in seq[1:]))
        return dry

    def accept(self, token: int) -> None:
        if not self.empty:
            self.last_tokens.append(int(token))

    def reset(self) -> None:
        self.last_tokens.clear()

    def clone(self) -> Dry:
        twin = Dry.__new__(Dry)
        twin.__dict__.update(self.__dict__)
        twin.breakers = {k: list(v) for k, v in self.breakers.items()}
        twin.last_tokens = deque(self.last_tokens, maxlen=self.last_tokens.maxlen)
        return twin

    def apply(self, cur: TokenDataArray) -> None:
        if self.empty:
            return
        n = min(len(self.last_tokens), self.penalty_last_n)
        if n <= self.allowed_length:
            return
        recent = list(self.last_tokens)[::-1][:n]          # recent[i] = ring_buffer.rat(i)
        rep_limit = self._repetition_limit(recent)
        if rep_limit < self.allowed_length:
            return
        max_repeat = self._max_token_repeat(recent, _suffix_repeats(recent, rep_limit))
        max_exponent = 0
        if self.base > f32(1.000001):
            max_exponent = to_int(_FLOAT_MAX_LOG / logf1(self.base))
        for i in np.flatnonzero(np.isin(cur.ids, list(max_repeat))).tolist():
            token = int(cur.ids[i])
            if () in self.breakers.get(token, ()):
                continue                               # a single-token sequence breaker
            repeat_exp = max_repeat[token] - self.allowed_length
            if max_exponent > 0 and repeat_exp > max_exponent:
                repeat_exp = max_exponent
            penalty = f32(float(self.multiplier) * pow_double(float(self.base), float(repeat_exp)))
            cur.logits[i] = cur.logits[i] - penalty
        cur.sorted = False

    def _repetition_limit(self, recent: list[int]) -> int:
        """How far back a repetition may reach: up to the most recent complete sequence breaker."""
        for i, token in enumerate(recent):
            tails = self.breakers.get(token)
            if not tails:
                continue
            longest = -1
            for tail in tails:
                if longest < len(tail) <= i and all(tail[k] == recent[i - k - 1] for k in range(len(tail))):
                    longest = len(tail)
            if longest >= 0:
                return i - longest
        return len(recent)

    def _max_token_repeat(self, recent: list[int], repeats: list[int]) -> dict[int, int]:
        """For each token that would continue a repetition of at least allowed_length: the longest one."""
        n = len(recent)
        best: dict[int, int] = {}
        for i in range(n - 1):
            length = repeats[i]
            if length >= self.allowed_length:
                token = recent[n - 2 - i]
                if best.get(token, -1) < length:
                    best[token] = length
        return best


def _suffix_repeats(recent: list[int], rep_limit: int) -> list[int]:
    """The reverse Z-algorithm: repeats[n-1-k] = length (capped at rep_limit) of the longest suffix of
    the history that also ends k tokens earlier."""
    n = len(recent)
    repeats = [0] * n
    last = n - 1
    lt = rt = 0
    for k in range(1, n):
        if k > rt:
            m = 0
            while m + k < n and recent[m] == recent[m + k]:
                m += 1
            repeats[last - k] = min(m, rep_limit)
            if m > 0:
                lt, rt = k, k + m - 1
        else:
            pair = k - lt
            right_part_len = rt - k + 1
            if repeats[last - pair] < right_part_len:
                repeats[last - k] = min(repeats[last - pair], rep_limit)
            else:
                i = rt + 1
                while i < n and recent[i] == recent[i - k]:
                    i += 1
                repeats[last - k] = min(i - k, rep_limit)
                lt, rt = k, i - 1
    return repeats


def _breaker_bytes(breaker: str | bytes) -> bytes:
    if isinstance(breaker, bytes):
        return breaker
    if isinstance(breaker, str):
        return breaker.encode("utf-8", "surrogatepass")
    raise ValueError(f"Dry: a sequence breaker must be a string, got {breaker!r}")


def _overlapping_token_sequences(vocab: Vocab, words: list[bytes], text: bytes,
                                 out: dict[int, list[tuple[int, ...]]]) -> None:
    """get_overlapping_token_sequences: a token whose text contains the breaker is a breaker on its
    own (empty tail); a token whose text ends with a prefix of it starts one, the tail being the
    tokenization of the rest (at most 20 tokens, each distinct tail once)."""
    head = text[:1]
    for token, word in enumerate(words):
        if text in word:
            out.setdefault(token, []).append(())
            continue
        pos = word.find(head)
        while pos >= 0:
            i = 1
            while i < len(text) and i + pos < len(word) and word[pos + i] == text[i]:
                i += 1
            if i == len(text) or i + pos == len(word):
                tail = tuple(vocab.tokenize(text[i:], add_special=False, parse_special=False)[:_DRY_MAX_SEQ_LEN])
                tails = out.setdefault(token, [])
                if tail not in tails:
                    tails.append(tail)
            pos = word.find(head, pos + 1)
