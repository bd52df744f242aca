"""The three tokenizer algorithms of llama.cpp (llm_tokenizer_{spm,bpe,wpm}_session), one word
or fragment at a time, and the byte-level pieces of detokenizing; `vocab.py` does the
special-token partitioning around them.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from llamir.frontend import unicode as uc

# unicode_len_utf8: sequence length from the lead byte's high nibble (no validation)
_UTF8_LEN = (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4)


class SpmTokenizer:
    """SentencePiece-style: merge the adjacent pair whose merged text is the highest-scoring
    token, until none is left; symbols that are not tokens fall back to <0xXX> byte tokens."""

    def __init__(self, ids: Mapping[bytes, int], scores: Sequence[float], byte_token: Callable[[int], int]):
        self.ids, self.scores, self.byte_token = ids, scores, byte_token

    def tokenize(self, text: bytes, out: list[int]) -> None:
        starts, sizes = [], []
        offset = 0
        while offset < len(text):
            n = min(_UTF8_LEN[text[offset] >> 4], len(text) - offset)
            starts.append(offset)
            sizes.append(n)
            offset += n
        count = len(starts)
        prev = list(range(-1, count - 1))
        nxt = [*range(1, count), -1]
        queue: list[tuple[float, int, int, int]] = []
        rev_merge: dict[bytes, tuple[int, int]] = {}

        def try_add_bigram(left: int, right: int) -> None:
            if left == -1 or right == -1:
                return
            piece = text[starts[left]:starts[left] + sizes[left] + sizes[right]]
            token = self.ids.get(piece)
            if token is None:
                return
            # llm_bigram_spm::comparator: highest score first, then leftmost
            heapq.heappush(queue, (-self.scores[token], left, right, len(piece)))
            rev_merge[piece] = (left, right)

        for i in range(1, count):
            try_add_bigram(i - 1, i)
        while queue:
            _, left, right, size = heapq.heappop(queue)
            if sizes[left] == 0 or sizes[right] == 0 or sizes[left] + sizes[right] != size:
                continue  # one side was merged away since
            sizes[left] += sizes[right]
            sizes[right] = 0
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            try_add_bigram(prev[left], left)
            try_add_bigram(left, nxt[left])

        def resegment(i: int) -> None:
            piece = text[starts[i]:starts[i] + sizes[i]]
            token = self.ids.get(piece)
            if token is not None:
                out.append(token)
            elif piece in rev_merge:
                left, right = rev_merge[piece]
                resegment(left)
                resegment(right)
            else:
                out.extend(self.byte_token(b) for b in piece)

        i = 0 if count else -1
        while i != -1:
            resegment(i)
            i = nxt[i]


class BpeTokenizer:
    """GPT-2 style: split into words, then merge each word's adjacent pairs by merge rank."""

    def __init__(self, ids: Mapping[str, int], ranks: Mapping[str, int], patterns: Sequence[str],
                 byte_level: bool, ignore_merges: bool, newline_words_whole: bool):
        self.ids, self.ranks, self.patterns = ids, ranks, tuple(patterns)
        self.byte_level, self.ignore_merges = byte_level, ignore_merges
        self.newline_words_whole = newline_words_whole   # gemma4: "\n\n" stays one token if it is one
        self._cache: dict[str, tuple[int, ...]] = {}

    def tokenize(self, text: bytes, out: list[int]) -> None:
        words = uc.regex_split(uc.decode_utf8(text), self.patterns, self.byte_level)
        cache = self._cache
        for word in words:
            ids = cache.get(word)
            if ids is None:
                ids = self._word(word)
                if len(cache) > 100_000:
                    cache.clear()
                cache[word] = ids
            out.extend(ids)

    def _word(self, word: str) -> tuple[int, ...]:
        if not word:
            return ()
        whole = self.ids.get(word)
        if whole is not None and (self.ignore_merges or (self.newline_words_whole and not word.strip("\n"))):
            return (whole,)
        symbols = self._merge(list(word))
        ids: list[int] = []
        for piece in symbols:
            token = self.ids.get(piece)
            if token is not None:
                ids.append(token)
            else:
                ids.extend(self._byte_tokens(piece))
        return tuple(ids)

    def _merge(self, sym: list[str]) -> list[str]:
        ranks = self.ranks
        count = len(sym)
        prev = list(range(-1, count - 1))
        nxt = [*range(1, count), -1]
        queue: list[tuple[int, int, int, str]] = []

        def add_bigram(left: int, right: int) -> None:
            if left == -1 or right == -1:
                return
            rank = ranks.get(sym[left] + " " + sym[right])
            if rank is not None:  # llm_bigram_bpe::comparator: lowest rank first, then leftmost
                heapq.heappush(queue, (rank, left, right, sym[left] + sym[right]))

        for i in range(1, count):
            add_bigram(i - 1, i)
        while queue:
            _, left, right, merged = heapq.heappop(queue)
            if not sym[left] or not sym[right] or sym[left] + sym[right] != merged:
                continue  # outdated
            sym[left], sym[right] = merged, ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            add_bigram(prev[left], left)
            add_bigram(left, nxt[left])
        return [s for s in sym if s]

    def _byte_tokens(self, piece: str) -> list[int]:
        """A symbol that is no token: look its bytes up one by one, dropping those that are not
        tokens either (llama.cpp does the same, silently)."""
        ids = []
        for b in uc.encode_utf8(piece):
            if self.byte_level:
                # llama.cpp looks up the raw byte as a one-byte string; only ASCII can match a token
                token = self.ids.get(chr(b)) if b < 0x80 else None
            else:
                token = self.ids.get(f"<0x{b:02X}>")
            if token is not None:
                ids.append(token)
        return ids


class WpmTokenizer:
    """BERT WordPiece as llama.cpp does it: normalize, split on spaces and punctuation, then
    greedy longest match of "▁word" against the vocab; a word with no full match becomes UNK."""

    def __init__(self, ids: Mapping[bytes, int], max_token_len: int, unk: int | None,
                 lowercase: bool, strip_accents: bool):
        self.ids, self.max_token_len, self.unk = ids, max_token_len, unk
        self.lowercase, self.strip_accents = lowercase, strip_accents

    def tokenize(self, text: bytes, out: list[int]) -> None:
        for word in self.preprocess(text):
            word1 = "\u2581".encode() + word
            n, start, i = len(word1), len(out), 0
            while i < n:
                for j in range(min(n, i + self.max_token_len + 1), i, -1):
                    token = self.ids.get(word1[i:j])
                    if token is not None:
                        out.append(token)
                        i = j
                        break
                else:
                    del out[start:]  # no piece starts here: the whole word becomes UNK
                    break
            if len(out) == start:
                out.append(self.unk if self.unk is not None else -1)

    def preprocess(self, text: bytes) -> list[bytes]:
        cpts = uc.codepoints(uc.decode_utf8(text)).astype(np.int64)
        if self.strip_accents:
            cpts = uc.normalize_nfd(cpts).astype(np.int64)
        flags = uc.cpt_flags(cpts).tolist()
        words: list[list[int]] = [[]]
        for cpt, f in zip(cpts.tolist(), flags, strict=True):
            if f & uc.WHITESPACE:
                if words[-1]:
                    words.append([])
                continue
            if cpt == 0 or cpt == uc.REPLACEMENT or f & uc.CONTROL:
                continue
            if self.strip_accents and f & uc.ACCENT_MARK:
                continue
            c = uc.tolower(cpt) if self.lowercase else cpt
            if f & uc.PUNCTUATION or (cpt < 0x7F and f & uc.SYMBOL) or _is_chinese_char(cpt):
                if words[-1]:
                    words.append([])
                words[-1].append(c)   # a word of its own
                words.append([])
            else:
                words[-1].append(c)
        return [uc.encode_utf8("".join(map(chr, w))) for w in words if w]


def _is_chinese_char(cpt: int) -> bool:
    return (0x4E00 <= cpt <= 0x9FFF or 0x3400 <= cpt <= 0x4DBF or 0x20000 <= cpt <= 0x2A6DF
            or 0x2A700 <= cpt <= 0x2B73F or 0x2B740 <= cpt <= 0x2B81F
            or 0x2B920 <= cpt <= 0x2CEAF  # 0x2B820 in Unicode; llama.cpp follows HF's rust code
            or 0xF900 <= cpt <= 0xFAFF or 0x2F800 <= cpt <= 0x2FA1F)


def hex_prefix(s: str) -> int:
    """strtol(s, NULL, 16) for a two-character string: the leading hex digits, else 0."""
    digits = ""
    for c in s:
        if c not in "0123456789abcdefABCDEF":
            break
        digits += c
    return int(digits, 16) if digits else 0


def decode_byte_level(text: str) -> bytes:
    """llama_decode_text: GPT-2 byte characters back to bytes; a character outside the byte
    alphabet becomes "[UNK_BYTE_0x<hex>" + the whole token text + "]", as in llama.cpp."""
    out = bytearray()
    for ch in text:
        byte = uc.UNICODE_TO_BYTE.get(ch)
        if byte is not None:
            out.append(byte)
        else:
            out += b"[UNK_BYTE_0x" + uc.encode_utf8(ch).hex().encode() + uc.encode_utf8(text) + b"]"
    return bytes(out)


def clean_spaces(text: bytes) -> bytes:
    """clean_up_tokenization_spaces, ported pass by pass from llama_vocab::impl::detokenize."""
    buf = bytearray(text)
    # 1: drop the space before ? ! . ,
    total = 1 if buf else 0
    for i in range(1, len(buf)):
        x = buf[i]
        if buf[i - 1] == 0x20 and x in b"?!.,":
            total -= 1
        buf[total] = x
        total += 1
    del buf[total:]
    # 2: " ' " -> "'" (the next space is blanked in place and skipped)
    n, total, i = len(buf), 1 if buf else 0, 1
    while i < n:
        x = buf[i]
        if x == 0x27 and i + 1 < n and buf[i - 1] == 0x20 and buf[i + 1] == 0x20:
            total -= 1
            i += 1
            buf[i] = 0
        buf[total] = x
        total += 1
        i += 1
    del buf[total:]
    # 3: " 's" " 'm" " 're" " 've" lose their space (" 't" " 'd" " 'll" keep it)
    n, total = len(buf), 1 if buf else 0
    for i in range(1, n):
        x = buf[i]
        if buf[i - 1] == 0x20 and x == 0x27 and i + 1 < n:
            x1 = buf[i + 1]
            if x1 in b"sm" or (x1 in b"rv" and i + 2 < n and buf[i + 2] == 0x65):
                total -= 1
        buf[total] = x
        total += 1
    del buf[total:]
    return bytes(buf)
