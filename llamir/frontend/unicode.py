"""llama.cpp's unicode.cpp in Python: code point flags, lenient UTF-8, GPT-2 byte encoding,
and `regex_split`, the pre-tokenizer that splits text into words.

Exactness over generality: flags come from llama.cpp's own tables (unicode_data.py), invalid
UTF-8 becomes U+FFFD byte by byte as llama.cpp does it, llama.cpp's hand-written splitters
(gpt2, llama3, qwen2/3.5, kimi-k2, newlines, digit groups) are ported line by line, and every
other pattern runs the way llama.cpp runs it through std::regex: on a "collapsed" text where
each non-ASCII code point is replaced by one byte naming its category.
"""

from __future__ import annotations

import base64
import functools
import re
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from llamir.frontend import unicode_data

# unicode_cpt_flags bits (unicode.h); 0 means "outside the text" in the splitters
UNDEFINED, NUMBER, LETTER, SEPARATOR = 0x0001, 0x0002, 0x0004, 0x0008
ACCENT_MARK, PUNCTUATION, SYMBOL, CONTROL = 0x0010, 0x0020, 0x0040, 0x0080
CATEGORIES, WHITESPACE = 0x00FF, 0x0100

MAX_CODEPOINTS = 0x110000
REPLACEMENT = 0xFFFD


def _table(blob: tuple[str, ...]) -> np.ndarray:
    return np.frombuffer(zlib.decompress(base64.b64decode("".join(blob))), dtype="<u4")


@dataclass(frozen=True)
class _Tables:
    flags: np.ndarray            # uint16 per code point, 0..0x10FFFF
    lowercase: dict[int, int]
    nfd_first: np.ndarray        # sorted range starts
    nfd_last: np.ndarray
    nfd_value: np.ndarray
    non_ascii_space: dict[int, int]  # str.translate table: non-ASCII whitespace -> U+000B


@functools.cache
def tables() -> _Tables:
    """The decoded llama.cpp tables, built once per process."""
    ranges = _table(unicode_data.FLAG_RANGES).reshape(-1, 2)
    starts, values = ranges[:, 0].astype(np.int64), ranges[:, 1].astype(np.uint16)
    flags = np.repeat(values[:-1], np.diff(starts))          # last entry is the MAX_CODEPOINTS sentinel
    assert starts[0] == 0 and starts[-1] == MAX_CODEPOINTS and len(flags) == MAX_CODEPOINTS
    whitespace = _table(unicode_data.WHITESPACE)
    flags[whitespace] |= WHITESPACE
    lower = _table(unicode_data.LOWERCASE).reshape(-1, 2)
    nfd = _table(unicode_data.NFD_RANGES).reshape(-1, 3)
    return _Tables(
        flags=flags,
        lowercase={int(u): int(v) for u, v in lower},
        nfd_first=nfd[:, 0].astype(np.int64),
        nfd_last=nfd[:, 1].astype(np.int64),
        nfd_value=nfd[:, 2].astype(np.int64),
        non_ascii_space={int(c): 0x0B for c in whitespace if c > 0x7F},
    )


def codepoints(text: str) -> np.ndarray:
    """The code points of `text` as uint32 (lone surrogates allowed, as llama.cpp decodes them)."""
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")


def cpt_flags(cpts: np.ndarray) -> np.ndarray:
    """unicode_cpt_flags_from_cpt for each code point (UNDEFINED beyond U+10FFFF)."""
    flags = tables().flags
    return flags[np.minimum(cpts, MAX_CODEPOINTS - 1)]


def tolower(cpt: int) -> int:
    return tables().lowercase.get(cpt, cpt)


def normalize_nfd(cpts: np.ndarray) -> np.ndarray:
    """llama.cpp's one-to-one "NFD": a code point maps to the first code point of its decomposition."""
    t = tables()
    idx = np.searchsorted(t.nfd_first, cpts, side="right") - 1
    inside = (idx >= 0) & (cpts <= t.nfd_last[np.maximum(idx, 0)])
    return np.where(inside, t.nfd_value[np.maximum(idx, 0)], cpts).astype(np.uint32)


def decode_utf8(data: bytes) -> str:
    """unicode_cpts_from_utf8: like UTF-8 decoding, but each bad byte becomes one U+FFFD and
    overlong forms and surrogates decode instead of failing."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        pass
    out: list[int] = []
    n, i = len(data), 0
    while i < n:
        b = data[i]
        need = 0 if b < 0x80 else 1 if b >= 0xC0 and b < 0xE0 else 2 if 0xE0 <= b < 0xF0 else \
            3 if 0xF0 <= b < 0xF8 else -1
        tail = data[i + 1:i + 1 + need] if need > 0 else b""
        if need < 0 or len(tail) < need or any(c & 0xC0 != 0x80 for c in tail):
            out.append(REPLACEMENT)
            i += 1
            continue
        cpt = b & (0x7F, 0x1F, 0x0F, 0x07)[need]
        for c in tail:
            cpt = (cpt << 6) | (c & 0x3F)
        if cpt >= MAX_CODEPOINTS:
            # llama.cpp decodes it, then throws when re-encoding it (unicode_cpt_to_utf8)
            raise ValueError(f"byte {i}: sequence {data[i:i + 1 + need].hex()} decodes to U+{cpt:X}, "
                             "beyond U+10FFFF; llama.cpp cannot tokenize it")
        out.append(cpt)
        i += 1 + need
    return "".join(map(chr, out))


def encode_utf8(text: str) -> bytes:
    """unicode_cpt_to_utf8 over a string: surrogates encode as three bytes, like llama.cpp."""
    return text.encode("utf-8", "surrogatepass")


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character map (unicode_byte_to_utf8_map)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


BYTE_TO_UNICODE: list[str] = _bytes_to_unicode()
UNICODE_TO_BYTE: dict[str, int] = {ch: b for b, ch in enumerate(BYTE_TO_UNICODE)}
_BYTE_ENCODE_TABLE = {b: ch for b, ch in enumerate(BYTE_TO_UNICODE)}  # for str.translate on latin-1


def byte_encode(word: str) -> str:
    """The GPT-2 byte-level spelling of a word: one printable character per UTF-8 byte."""
    return encode_utf8(word).decode("latin-1").translate(_BYTE_ENCODE_TABLE)


# ---------------------------------------------------------------------------------------------
# the hand-written splitters (unicode_regex_split_custom_*); each returns word lengths

Splitter = Callable[[list[int], list[int], int, int, list[int]], None]
_SPACE, _CR, _LF, _APOS = 0x20, 0x0D, 0x0A, 0x27


def _contraction_len(cpts: list[int], pos: int, end: int, fold: bool) -> int:
    """Length of 's 't 're 've 'm 'll 'd at pos (0 if none); `fold` lowercases like (?i:...)."""
    if cpts[pos] != _APOS or pos + 1 >= end:
        return 0
    low = tolower if fold else (lambda c: c)
    c1 = low(cpts[pos + 1])
    if c1 in (0x73, 0x74, 0x6D, 0x64):  # s t m d
        return 2
    if pos + 2 < end:
        c2 = low(cpts[pos + 2])
        if (c1, c2) in ((0x72, 0x65), (0x76, 0x65), (0x6C, 0x6C)):  # re ve ll
            return 3
    return 0


def _split_gpt2(cpts: list[int], flags: list[int], ini: int, end: int, out: list[int]) -> None:
    """'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"""
    def fl(p: int) -> int:
        return flags[p] if p < end else 0

    pos = prev = ini
    while pos < end:
        cpt = cpts[pos]
        n = _contraction_len(cpts, pos, end, fold=False)
        if n:
            pos += n
        else:
            f2 = fl(pos + 1) if cpt == _SPACE else flags[pos]
            run = LETTER if f2 & LETTER else NUMBER if f2 & NUMBER else 0
            if run:
                pos += cpt == _SPACE
                while fl(pos) & run:
                    pos += 1
            elif f2 and not f2 & (WHITESPACE | LETTER | NUMBER):
                pos += cpt == _SPACE
                while (f := fl(pos)) and not f & (WHITESPACE | LETTER | NUMBER):
                    pos += 1
            else:
                pos = _whitespace_end(cpts, flags, pos, end, newline_runs=False)
        out.append(pos - prev)
        prev = pos


def _whitespace_end(cpts: list[int], flags: list[int], pos: int, end: int, newline_runs: bool) -> int:
    """End of \\s*[\\r\\n]+ (when newline_runs), else \\s+(?!\\S), else \\s+, else one code point."""
    n, last_newline_end = 0, 0
    while pos + n < end and flags[pos + n] & WHITESPACE:
        if newline_runs and cpts[pos + n] in (_CR, _LF):
            last_newline_end = pos + n + 1
        n += 1
    if last_newline_end > 0:
        return last_newline_end
    if n > 1 and pos + n < end:  # leave the last space to prefix the next word
        return pos + n - 1
    return pos + max(n, 1)


def _digit_groups(flags: list[int], pos: int, prev: int, end: int, max_digits: int, out: list[int]) -> tuple[int, int]:
    """\\p{N}{1,max_digits}, repeated over a run of digits: every full group but the last is
    emitted here; returns (pos, prev) with the last group for the caller to emit."""
    start = pos
    while pos < end and flags[pos] & NUMBER:
        pos += 1
        if pos - start >= max_digits:
            out.append(pos - prev)
            prev = start = pos
    return pos, prev


def _symbols_or_whitespace(cpts: list[int], flags: list[int], pos: int, end: int, other: int,
                           test_current: bool) -> int:
    """The end of ` ?[^\\s{other}]+[\\r\\n]*` at pos, else of the whitespace rules. llama.cpp's
    llama3 splitter tests the current flag (not the next one) for "inside the text"
    (`test_current`): a lone trailing space then becomes its own word, which \\s+ would also give."""
    def fl(p: int) -> int:
        return flags[p] if p < end else 0

    cpt, f = cpts[pos], flags[pos]
    f2 = fl(pos + 1) if cpt == _SPACE else f
    if (f if test_current else f2) and not f2 & other:
        pos += cpt == _SPACE
        while (f2 := fl(pos)) and not f2 & other:
            pos += 1
        while pos < end and cpts[pos] in (_CR, _LF):
            pos += 1
        return pos
    return _whitespace_end(cpts, flags, pos, end, newline_runs=True)


def _llama3_family(max_digits: int, letter: int) -> Splitter:
    """The llama3 (digits in threes), qwen2 (single digits) and qwen35 (letters take \\p{M}) splitters,
    with L the letter class: (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?L+|\\p{N}{1,max}
    | ?[^\\s L \\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"""
    other = WHITESPACE | letter | NUMBER

    def split(cpts: list[int], flags: list[int], ini: int, end: int, out: list[int]) -> None:
        def fl(p: int) -> int:
            return flags[p] if p < end else 0

        pos = prev = ini
        while pos < end:
            cpt, f = cpts[pos], flags[pos]
            n = _contraction_len(cpts, pos, end, fold=True)
            if n:
                pos += n
            elif cpt != _CR and cpt != _LF and not f & NUMBER and (f & letter or fl(pos + 1) & letter):
                pos += 1
                while fl(pos) & letter:
                    pos += 1
            elif f & NUMBER:
                pos, prev = _digit_groups(flags, pos, prev, end, max_digits, out)
            else:
                pos = _symbols_or_whitespace(cpts, flags, pos, end, other, test_current=True)
            if pos > prev:
                out.append(pos - prev)
            prev = pos

    return split


def is_han(cpt: int) -> bool:
    """unicode_cpt_is_han: CJK unified ideographs, extensions A-F, compatibility ideographs."""
    return (0x4E00 <= cpt <= 0x9FFF or 0x3400 <= cpt <= 0x4DBF or 0x20000 <= cpt <= 0x2A6DF
            or 0x2A700 <= cpt <= 0x2EBEF or 0xF900 <= cpt <= 0xFAFF or 0x2F800 <= cpt <= 0x2FA1F)


def _split_kimi_k2(cpts: list[int], flags: list[int], ini: int, end: int, out: list[int]) -> None:
    """Kimi-K2: [\\p{Han}]+, then words of non-Han letters with an optional leading character and
    an optional trailing contraction, then llama3's digits, punctuation and whitespace rules."""
    def fl(p: int) -> int:
        return flags[p] if p < end else 0

    def letter(p: int) -> bool:
        return p < end and bool(flags[p] & LETTER) and not is_han(cpts[p])

    pos = prev = ini
    while pos < end:
        cpt, f = cpts[pos], flags[pos]
        if is_han(cpt):
            while pos < end and is_han(cpts[pos]):
                pos += 1
        elif letter(pos) or (cpt != _CR and cpt != _LF and not f & (LETTER | NUMBER) and letter(pos + 1)):
            pos += not f & LETTER   # the optional leading character
            while letter(pos):
                pos += 1
            if pos < end:
                pos += _contraction_len(cpts, pos, end, fold=True)
        elif f & NUMBER:
            pos, prev = _digit_groups(flags, pos, prev, end, 3, out)
        else:
            pos = _symbols_or_whitespace(cpts, flags, pos, end, WHITESPACE | LETTER | NUMBER, test_current=False)
        if pos > prev:
            out.append(pos - prev)
        prev = pos


def _split_newlines(cpts: list[int], flags: list[int], ini: int, end: int, out: list[int]) -> None:
    """[^\\n]+|[\\n]+"""
    pos = ini
    while pos < end:
        start, is_newline = pos, cpts[pos] == _LF
        while pos < end and (cpts[pos] == _LF) == is_newline:
            pos += 1
        out.append(pos - start)


def _split_digit_groups(cpts: list[int], flags: list[int], ini: int, end: int, out: list[int]) -> None:
    """AFMoE / tiny_aya digits: a run of n digits splits as n % 3 leading digits, then threes.
    As in llama.cpp, text before a digit run joins the run's first group."""
    pos = prev = ini
    while pos < end:
        if not flags[pos] & NUMBER:
            pos += 1
            continue
        start = pos
        while pos < end and flags[pos] & NUMBER:
            pos += 1
        cut = start + ((pos - start) % 3 or 3)
        while cut <= pos:
            out.append(cut - prev)
            prev = cut
            cut += 3
    if prev < end:
        out.append(end - prev)


GPT2_PATTERN = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"
LLAMA3_PATTERN = ("(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+"
                  "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
QWEN2_PATTERN = ("(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+"
                 "|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
QWEN35_PATTERN = ("(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
                  "|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*"
                  "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
NEWLINES_PATTERN = "[^\\n]+|[\\n]+"

CUSTOM_SPLITTERS: dict[str, Splitter] = {  # unicode_regex_split_custom: pattern text -> splitter
    GPT2_PATTERN: _split_gpt2,
    LLAMA3_PATTERN: _llama3_family(3, LETTER),
    QWEN2_PATTERN: _llama3_family(1, LETTER),
    QWEN35_PATTERN: _llama3_family(1, LETTER | ACCENT_MARK),
    NEWLINES_PATTERN: _split_newlines,
    "\\p{Han}+": _split_kimi_k2,   # llama.cpp's trigger for the whole Kimi-K2 pattern
    "\\p{AFMoE_digits}": _split_digit_groups,
    "\\d{1,3}(?=(?:\\d{3})*\\b)": _split_digit_groups,
}


# ---------------------------------------------------------------------------------------------
# every other pattern: llama.cpp's std::regex fallback

_UCAT = {  # \p{..} in a pattern -> category flag; llama.cpp collapses the letter subclasses
    "\\p{N}": NUMBER, "\\p{L}": LETTER, "\\p{P}": PUNCTUATION, "\\p{M}": ACCENT_MARK, "\\p{S}": SYMBOL,
    "\\p{Lu}": LETTER, "\\p{Ll}": LETTER, "\\p{Lt}": LETTER, "\\p{Lm}": LETTER, "\\p{Lo}": LETTER,
}
_UCAT_BYTE = {NUMBER: 0xD1, LETTER: 0xD2, PUNCTUATION: 0xD3, ACCENT_MARK: 0xD4, SYMBOL: 0xD5}
_UCAT_ASCII = {  # the ASCII members of each category, as a bracket-expression body
    NUMBER: "0-9",
    LETTER: "A-Za-z",
    PUNCTUATION: "!-#%-*,-/:-;?-@\\[-\\]_\\{\\}",
    ACCENT_MARK: "",
    SYMBOL: "\\$\\+<->^`\\|\\~",
}


def _category_bytes() -> np.ndarray:
    """Category bits -> collapsed byte: a known category its 0xD1..0xD5, anything else 0xD0."""
    table = np.full(CATEGORIES + 1, 0xD0, dtype=np.uint8)
    for flag, byte in _UCAT_BYTE.items():
        table[flag] = byte
    return table


_CATEGORY_BYTE = _category_bytes()


def collapse_text(cpts: np.ndarray, flags: np.ndarray) -> bytes:
    """One byte per code point: ASCII kept, whitespace 0x0B (std::regex's \\s misses non-ASCII
    spaces), the rest replaced by their category byte."""
    other = np.where(flags & WHITESPACE, 0x0B, _CATEGORY_BYTE[flags & CATEGORIES])
    return np.where(cpts < 0x80, cpts, other).astype(np.uint8).tobytes()


def collapse_pattern(pattern: str) -> str:
    """llama.cpp's rewrite of a \\p{..} pattern for the collapsed text (same quirks: no nesting,
    a '[' or ']' preceded by a backslash is taken as escaped)."""
    if any(ord(c) >= 0x80 for c in pattern):
        raise ValueError(f"pattern {pattern!r} mixes unicode categories and non-ASCII characters; "
                         "llama.cpp does not support that")
    out: list[str] = []
    inside, i = False, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "[" and (i == 0 or pattern[i - 1] != "\\"):
            out.append("[")
            inside = True
        elif inside and c == "]" and pattern[i - 1] != "\\":
            out.append("]")
            inside = False
        elif c == "\\" and i + 3 < len(pattern) and pattern[i + 1:i + 3] == "p{":
            close = pattern.find("}", i + 3)
            name = pattern[i:close + 1] if close != -1 and close <= i + 10 else ""
            if name not in _UCAT:
                out.append(c)
                i += 1
                continue
            flag = _UCAT[name]
            body = chr(_UCAT_BYTE[flag]) + _UCAT_ASCII[flag]
            out.append(body if inside else f"[{body}]")
            i = close
        else:
            out.append(c)
        i += 1
    return "".join(out)


def _to_python_regex(pattern: str) -> str:
    """ECMAScript -> Python `re`: only `$` differs for these patterns (end of input, never before a
    final newline), so it becomes \\Z outside brackets."""
    out, inside, escaped = [], False, False
    for c in pattern:
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = True
        elif c == "[":
            inside = True
        elif c == "]":
            inside = False
        elif c == "$" and not inside:
            c = "\\Z"
        out.append(c)
    return "".join(out)


@functools.cache
def _compiled(pattern: str) -> tuple[re.Pattern, bool]:
    """The pattern as llama.cpp runs it, and whether it runs on the collapsed bytes."""
    if any(name in pattern for name in _UCAT):
        return re.compile(_to_python_regex(collapse_pattern(pattern)).encode("latin-1")), True
    # std::wregex on code points; \s, \d and \w are ASCII-only in the C locale
    return re.compile(_to_python_regex(pattern), re.ASCII), False


def _split_stl(subject: str | bytes, regex: re.Pattern, offsets: list[int]) -> list[int]:
    """unicode_regex_split_stl: matches and the gaps between them become words, per chunk."""
    out: list[int] = []
    start = 0
    for length in offsets:
        chunk = subject[start:start + length]
        prev = 0
        for m in regex.finditer(chunk):
            if m.start() > prev:
                out.append(m.start() - prev)
            out.append(m.end() - m.start())
            prev = m.end()
        if prev < length:
            out.append(length - prev)
        start += length
    return out


def regex_split(text: str, patterns: Sequence[str], byte_level: bool = True) -> list[str]:
    """unicode_regex_split: apply each pattern to the words left by the previous ones.

    Words come back GPT-2 byte-encoded when `byte_level`, else as plain text."""
    cpt_array = codepoints(text)
    flag_array = cpt_flags(cpt_array)
    cpts, flags = cpt_array.tolist(), flag_array.tolist()
    offsets = [len(cpts)]
    for pattern in patterns:
        splitter = CUSTOM_SPLITTERS.get(pattern)
        if splitter is not None:
            new_offsets: list[int] = []
            start = 0
            for length in offsets:
                splitter(cpts, flags, start, start + length, new_offsets)
                start += length
            offsets = new_offsets
            continue
        regex, on_collapsed = _compiled(pattern)
        if on_collapsed:
            subject: str | bytes = collapse_text(cpt_array, flag_array)
        else:
            subject = text.translate(tables().non_ascii_space)
        offsets = _split_stl(subject, regex, offsets)
    words, start = [], 0
    for length in offsets:
        words.append(text[start:start + length])
        start += length
    return [byte_encode(w) for w in words] if byte_level else words
