"""The UGM (unigram, `tokenizer.ggml.model = t5`) tokenizer of llama.cpp: llm_tokenizer_ugm and its
session (src/llama-vocab.cpp), ported step for step.

Text is first normalized: user-defined tokens pass through untouched, then the longest prefix in
SentencePiece's precompiled charsmap (an XOR-compressed double array trie over bytes, pointing into
NUL-terminated replacement strings) is replaced, spaces are escaped as U+2581 and optionally merged,
and a dummy space is put before (or after) the text. Then a Viterbi pass finds the tokenization with
the highest sum of token scores; a code point no token covers costs the lowest normal score minus 10
as the unknown token, and a run of unknown tokens becomes one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from llamir.frontend.vocab_special import ATTR_NORMAL, ATTR_UNUSED, ATTR_USER_DEFINED, VocabError

# unicode_len_utf8: sequence length from the lead byte's high nibble (no validation)
_UTF8_LEN = (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4)
_REPLACEMENT = "\ufffd".encode()
_ESCAPED_SPACE = "\u2581".encode()
UNKNOWN_TOKEN_SCORE_PENALTY = np.float32(10.0)


def _valid_utf8_len(data: bytes, pos: int) -> int:
    """The length of the code point at `pos` as unicode_cpt_from_utf8 accepts it, or 0 where it
    throws (a bad lead byte, or continuation bytes missing; overlongs and surrogates pass)."""
    lead, n = data[pos], len(data)
    if lead < 0x80:
        return 1
    if lead < 0xC0:
        return 0
    size = 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4 if lead < 0xF8 else 0
    if size == 0 or pos + size - 1 >= n:
        return 0
    if any(data[pos + i] & 0xC0 != 0x80 for i in range(1, size)):
        return 0
    return size


class CharsMap:
    """SentencePiece's precompiled charsmap: the XCDA trie and its replacement strings.

    Each 32-bit XCDA entry packs BASE in bits 10-30 (shifted left by 8 more when bit 9 is set),
    LCHECK in bits 0-7 (bit 31 marks a value entry, which never matches a byte) and LEAF in bit 8."""

    def __init__(self, blob: bytes):
        if len(blob) < 4:
            raise VocabError("precompiled_charsmap too small for xcda_blob_size header!")
        xcda_size = int.from_bytes(blob[:4], "little")
        if xcda_size + 4 >= len(blob):
            raise VocabError("Index out of array bounds in precompiled charsmap!")
        n_entries = xcda_size // 4
        self.xcda: list[int] = np.frombuffer(blob, dtype="<u4", count=n_entries, offset=4).tolist()
        self.replacements = bytes(blob[4 + xcda_size:])

    def _node(self, index: int) -> int:
        if index >= len(self.xcda):
            raise VocabError("Index out of array bounds in XCDA array!")
        return self.xcda[index]

    def _base(self, index: int) -> int:
        packed = self._node(index)
        return (packed >> 10) << ((packed & (1 << 9)) >> 6)

    def longest_prefix(self, text: bytes, start: int) -> tuple[int, bytes]:
        """(length, replacement) of the longest charsmap key at text[start:]; (0, b"") if none.
        The walk stops at a NUL byte, as the C string it was written for does."""
        length, value = 0, 0
        node = self._base(0)
        for pos in range(start, len(text)):
            c = text[pos]
            if c == 0:
                break
            node ^= c
            packed = self._node(node)
            if packed & ((1 << 31) | 0xFF) != c:   # LCHECK: not a child of the previous node
                break
            is_leaf = (packed >> 8) & 1
            node ^= (packed >> 10) << ((packed & (1 << 9)) >> 6)
            if is_leaf:   # the BASE of a leaf points at the entry holding the replacement's offset
                length = pos - start + 1
                value = self._node(node) & ((1 << 31) - 1)
        if length == 0:
            return 0, b""
        if value >= len(self.replacements):
            raise VocabError("Index out of array bounds in precompiled charsmap!")
        end = self.replacements.find(b"\0", value)
        if end < 0:
            raise VocabError("Unterminated string in precompiled charsmap!")
        return length, self.replacements[value:end]


class UgmTokenizer:
    """llm_tokenizer_ugm: the token matcher (normal, user-defined and unused tokens), the
    user-defined matcher that protects those tokens from normalization, and the scores.

    `attrs` is the vocab's own attribute list: llama.cpp builds the matchers from the attributes
    the file gives, but asks whether a matched token is user-defined when it tokenizes. No GGUF key
    sets treat_whitespace_as_suffix in llama.cpp (it is always false there), so Vocab never does."""

    def __init__(self, token_bytes: Sequence[bytes], scores: Sequence[float], attrs: list[int],
                 charsmap: CharsMap | None, unk: int, *, escape_whitespaces: bool, add_space_prefix: bool,
                 remove_extra_whitespaces: bool, treat_whitespace_as_suffix: bool = False):
        self.attrs, self.charsmap, self.unk = attrs, charsmap, unk
        self.space = _ESCAPED_SPACE if escape_whitespaces else b" "
        self.prepend_space = not treat_whitespace_as_suffix and add_space_prefix
        self.append_space = treat_whitespace_as_suffix and add_space_prefix
        self.merge_spaces = remove_extra_whitespaces
        matched = ATTR_NORMAL | ATTR_USER_DEFINED | ATTR_UNUSED
        self.ids: dict[bytes, int] = {}        # naive_trie::insert: a later duplicate overwrites
        self.scores: list[float] = list(scores)
        self.max_len = [0] * 256               # the longest token per first byte bounds the search
        user_prefixes: set[bytes] = set()      # every path of the user-defined token trie
        normal = [s for s, a in zip(self.scores, attrs) if a & ATTR_NORMAL]
        for token, (text, attr) in enumerate(zip(token_bytes, attrs)):
            if attr & matched and text:
                self.ids[text] = token
                self.max_len[text[0]] = max(self.max_len[text[0]], len(text))
            if attr & ATTR_USER_DEFINED:
                user_prefixes.update(text[:n] for n in range(1, len(text) + 1))
        self.user_prefixes = user_prefixes
        self.max_user_len = max(map(len, user_prefixes), default=0)
        # float arithmetic, as llama.cpp's `float unknown_token_score`; FLT_MAX with no normal token
        min_score = np.float32(min(normal)) if normal else np.float32(np.finfo(np.float32).max)
        with np.errstate(over="ignore"):
            self.unknown_score = float(min_score - UNKNOWN_TOKEN_SCORE_PENALTY)

    # ------------------------------------------------------------------ normalize

    def _normalize_prefix(self, text: bytes, pos: int) -> tuple[bytes, int]:
        """(normalized bytes, bytes consumed) for the text at `pos`."""
        if self.user_prefixes:
            # naive_trie::get_longest_prefix walks as deep as the trie goes, whether or not a
            # token ends there: "<ma" passes through untouched when "<mask>" is user-defined
            n = 0
            while n < self.max_user_len and pos + n < len(text) and text[pos:pos + n + 1] in self.user_prefixes:
                n += 1
            if n:
                return text[pos:pos + n], n
        if self.charsmap is not None:
            length, replacement = self.charsmap.longest_prefix(text, pos)
            if length:
                return replacement, length
        size = _valid_utf8_len(text, pos)
        if size == 0:
            return _REPLACEMENT, 1
        return text[pos:pos + size], size

    def normalize(self, text: bytes) -> bytes:
        """llm_tokenizer_ugm_session::normalize."""
        out = bytearray()
        space, merge = self.space, self.merge_spaces
        space_prepended = in_word = False
        pos = 0
        while pos < len(text):
            piece, consumed = self._normalize_prefix(text, pos)
            for c in piece:
                if c != 0x20:
                    if not in_word:
                        in_word = True
                        if (self.prepend_space and not space_prepended) or merge:
                            out += space
                            space_prepended = True
                    out.append(c)
                else:
                    in_word = False
                    if not merge:
                        out += space
            pos += consumed
        if self.append_space:
            out += space
        return bytes(out)

    # ------------------------------------------------------------------ tokenize

    def tokenize(self, text: bytes, out: list[int]) -> None:
        """Append the best-scoring tokenization of `text` (one raw fragment) to `out`."""
        norm = self.normalize(text)
        n = len(norm)
        if n == 0:
            return
        unk, ids, scores, attrs = self.unk, self.ids, self.scores, self.attrs
        neg = -float(np.finfo(np.float64).max)   # -DBL_MAX: below any sum of scores
        best_score = [neg] * (n + 1)
        best_token = [unk] * (n + 1)
        best_start = [0] * (n + 1)
        best_score[0] = 0.0
        pos = 0
        while pos < n:
            size = min(_UTF8_LEN[norm[pos] >> 4], n - pos)
            base = best_score[pos]
            whole_codepoint = False
            for end in range(pos + 1, min(n, pos + self.max_len[norm[pos]]) + 1):
                token = ids.get(norm[pos:end])
                if token is None:
                    continue
                if end - pos == size:
                    whole_codepoint = True
                # user-defined tokens score 0 so that they win; sums are in double, as in HF's
                score = base + (0.0 if attrs[token] & ATTR_USER_DEFINED else scores[token])
                if score > best_score[end]:
                    best_score[end], best_token[end], best_start[end] = score, token, pos
            if not whole_codepoint:
                score = base + self.unknown_score
                end = pos + size
                if score > best_score[end]:
                    best_score[end], best_token[end], best_start[end] = score, unk, pos
            pos += size
        # backtrack from the end; consecutive unknown tokens become one
        tokens: list[int] = []
        prev_unknown, at = False, n
        while True:
            token = best_token[at]
            is_unknown = token == unk
            if not (prev_unknown and is_unknown):
                tokens.append(token)
            if best_start[at] == 0:
                break
            prev_unknown = is_unknown
            at = best_start[at]
        out.extend(reversed(tokens))
