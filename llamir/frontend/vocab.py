"""A model's vocabulary and llama.cpp's tokenizer over it: `Vocab` mirrors llama_vocab
(src/llama-vocab.cpp), so `tokenize`, `token_to_piece` and `detokenize` give llama.cpp's results.

Supported: SPM ("llama"), BPE ("gpt2", "gemma4", with the pre-tokenizers of vocab_pre.py),
WPM ("bert") and UGM ("t5", unigram, in vocab_ugm.py). Where llama.cpp's choices are quirky we keep
them, and say so in a comment.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from llamir.frontend import unicode as uc
from llamir.frontend.gguf_meta import GGUFType, Metadata, MetadataError
from llamir.frontend.vocab_algos import (
    BpeTokenizer,
    SpmTokenizer,
    WpmTokenizer,
    clean_spaces,
    decode_byte_level,
    hex_prefix,
)
from llamir.frontend.vocab_gguf import read_metadata
from llamir.frontend.vocab_hash_order import iteration_order
from llamir.frontend.vocab_pre import PRE_TOKENIZERS, UNSUPPORTED_PRE, PreTokenizer
from llamir.frontend.vocab_special import (
    ALWAYS_RENDERED,
    ATTR_BYTE,
    ATTR_CONTROL,
    ATTR_LSTRIP,
    ATTR_NORMAL,
    ATTR_RSTRIP,
    ATTR_UNKNOWN,
    ATTR_UNUSED,
    ATTR_USER_DEFINED,
    BY_TEXT,
    EOG_TEXTS,
    ID_KEYS,
    TYPE_TO_ATTR,
    VocabError,
)
from llamir.frontend.vocab_ugm import CharsMap, UgmTokenizer

log = logging.getLogger(__name__)

SPM, BPE, WPM, UGM = "spm", "bpe", "wpm", "ugm"
_MODEL_TYPES = {"llama": SPM, "bert": WPM, "gpt2": BPE, "gemma4": BPE, "t5": UGM}
_NOT_PORTED = {"no_vocab", "none", "rwkv", "test", "plamo2", "hybriddna", "whitespace"}
_DEFAULT_IDS = {  # llama.cpp's default special ids per tokenizer type; -1 is LLAMA_TOKEN_NULL
    "llama": {"bos": 1, "eos": 2, "unk": 0},
    "bert": {"bos": 101, "unk": 100, "sep": 102, "pad": 0, "mask": 103},
    "gpt2": {"bos": 11, "eos": 11},
    "t5": {"eos": 1, "unk": 2, "pad": 0},
    "gemma4": {},
}
_C_SPACE = frozenset(b" \t\n\v\f\r")   # isspace() in the C locale
_SPECIAL = ATTR_CONTROL | ATTR_UNKNOWN
_ESCAPED_SPACE = "\u2581".encode()


def _typed_array(meta: Metadata, key: str, items: tuple[GGUFType, ...]) -> Any:
    """An array value of `key` with one of the item types llama.cpp's vocab loader accepts (None if
    missing), or its "invalid gguf type for <key>" error."""
    try:
        return meta.get_arr(key, items)
    except MetadataError:
        wanted = " or ".join(f"arr[{t.label}]" for t in items)
        raise VocabError(f"invalid gguf type for {key}: {meta.value_type(key)}, expected {wanted}") from None


class Vocab:
    """Token texts, scores and attributes, the special ids, and llama.cpp's tokenizer flags."""

    model: str            # tokenizer.ggml.model: "llama", "gpt2", "bert", "gemma4", "t5"
    pre: str              # tokenizer.ggml.pre as llama.cpp resolved it ("" for SPM/WPM)
    type: str             # SPM, BPE, WPM or UGM
    chat_template: str | None
    add_bos: bool
    add_eos: bool
    add_sep: bool
    add_space_prefix: bool
    clean_spaces: bool

    @classmethod
    def from_file(cls, path: str | Path) -> Vocab:
        """The vocab of a GGUF file, reading only its metadata."""
        return cls.from_metadata(read_metadata(path))

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> Vocab:
        """Build the vocab from GGUF metadata, as llama_vocab::impl::load does."""
        return cls(meta)

    # ------------------------------------------------------------------ loading

    def __init__(self, meta: Mapping[str, Any]):
        meta = Metadata.of(meta)   # every value is read with the type llama.cpp reads it as
        if "tokenizer.ggml.model" not in meta:
            raise VocabError("GGUF metadata has no tokenizer.ggml.model: the file has no vocabulary")
        model = meta.get_str("tokenizer.ggml.model")
        meta.get_u32("tokenizer.ggml.token_type_count")
        if model in _NOT_PORTED:
            raise VocabError(f"tokenizer model {model!r} is known to llama.cpp but not supported by llamir")
        if model not in _MODEL_TYPES:
            raise VocabError(f"unknown tokenizer: {model!r} (tokenizer.ggml.model)")
        self.model, self.type = model, _MODEL_TYPES[model]
        pre = meta.get_str("tokenizer.ggml.pre", "")
        self.pre = "gemma4" if model == "gemma4" else pre
        template = meta.get("tokenizer.chat_template")   # llama.cpp reads it untyped, as text
        self.chat_template = template if isinstance(template, str) else None
        self._ids = dict.fromkeys(ID_KEYS, -1) | _DEFAULT_IDS[model]
        self._read_flags(meta)
        self._ranks = self._read_merges(meta) if self.type == BPE else {}
        self._read_tokens(meta)
        self._tokenizer = self._make_tokenizer(meta)
        self._ids["nl"] = self._find_linefeed()
        self._read_special_ids(meta)
        self._detect_specials_by_text()
        self._build_eog()
        # tokenizer_st_partition tries longer special tokens first (llama.cpp's std::sort is not
        # stable; ties only matter for overlapping special tokens of equal length)
        special_attrs = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN
        special = [i for i, a in enumerate(self._attrs) if a & special_attrs]
        self._special_tokens = sorted(special, key=lambda i: -len(self._token_bytes[i]))
        self._set_strip_attrs(meta)
        self._pieces: dict[int, bytes] = {}

    def _read_merges(self, meta: Metadata) -> dict[str, int]:
        merges = _typed_array(meta, "tokenizer.ggml.merges", (GGUFType.STRING,))
        if merges is None and self.pre == "kimi-k2":
            return {}   # llama.cpp lets Kimi-K2 go without merges
        if merges is None:
            raise VocabError("cannot find tokenizer merges (tokenizer.ggml.merges) in a BPE vocab")
        # keyed "left right": llama.cpp splits at the first space after the first byte, and the
        # symbols it looks up never hold a space, so the joined text is an exact key; the first
        # of two equal merges wins (unordered_map::emplace), hence the reversed fill
        ranks = dict(zip(reversed(merges), range(len(merges) - 1, -1, -1), strict=True))
        return ranks

    def _read_flags(self, meta: Metadata) -> None:
        self.add_space_prefix, self.add_bos, self.add_eos, self.add_sep = False, False, False, False
        self.ignore_merges, self.clean_spaces, self.escape_whitespaces = False, False, True
        self.lowercase = True
        self.pre_tokenizer: PreTokenizer | None = None
        if self.type == BPE:
            self.pre_tokenizer = self._pre_tokenizer()
            spec = self.pre_tokenizer
            self.escape_whitespaces, self.clean_spaces = spec.escape_whitespaces, spec.clean_spaces
            self.ignore_merges, self.add_bos, self.add_sep = spec.ignore_merges, spec.add_bos, spec.add_sep
            if spec.no_bos:
                self._ids["bos"] = -1
        elif self.type == SPM:
            self.add_space_prefix, self.add_bos = True, True
        elif self.type == UGM:
            self.add_eos = True
        else:  # WPM
            self.clean_spaces, self.add_bos, self.add_sep = True, True, True
        self.add_space_prefix = meta.get_bool("tokenizer.ggml.add_space_prefix", self.add_space_prefix)
        self.remove_extra_whitespaces = meta.get_bool("tokenizer.ggml.remove_extra_whitespaces", False)

    def _pre_tokenizer(self) -> PreTokenizer:
        if not self.pre:
            log.warning("vocab has no tokenizer.ggml.pre; using 'default' (generation quality will suffer)")
            return PRE_TOKENIZERS["default"]
        if self.pre in UNSUPPORTED_PRE:
            raise VocabError(f"pre-tokenizer {self.pre!r} is known to llama.cpp but not supported by llamir")
        if self.pre not in PRE_TOKENIZERS:
            raise VocabError(f"unknown pre-tokenizer type: {self.pre!r} (tokenizer.ggml.pre)")
        return PRE_TOKENIZERS[self.pre]

    def _read_tokens(self, meta: Metadata) -> None:
        tokens = _typed_array(meta, "tokenizer.ggml.tokens", (GGUFType.STRING,))
        if tokens is None:
            raise VocabError("cannot find tokenizer vocab (tokenizer.ggml.tokens) in the metadata")
        n = len(tokens)
        if n == 0:
            raise VocabError("tokenizer.ggml.tokens is empty")
        scores = self._array(meta, "tokenizer.ggml.scores", (GGUFType.INT32, GGUFType.FLOAT32), n, np.float32)
        types = self._array(meta, "tokenizer.ggml.token_type", (GGUFType.INT32,), n, np.int64)
        # llama.cpp reads each text as a C string (gguf_get_arr_str), so a NUL ends it, and renames
        # empty tokens so that no special token can match the empty string
        texts = [t.partition("\0")[0] if "\0" in t else t for t in tokens]
        self._texts: list[str] = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(texts)]
        self._token_bytes = [t.encode("utf-8", "surrogatepass") for t in self._texts]
        self._token_to_id = {t: i for i, t in enumerate(self._texts)}   # a later duplicate wins
        self._scores = scores.tolist() if scores is not None else [0.0] * n
        if types is None:
            self._attrs = [ATTR_NORMAL] * n
        else:
            self._attrs = [TYPE_TO_ATTR.get(t, 0) for t in types.tolist()]
        self._max_token_len = max(len(b) for b in self._token_bytes)

    @staticmethod
    def _array(meta: Metadata, key: str, items: tuple[GGUFType, ...], n: int, dtype: type) -> np.ndarray | None:
        values = _typed_array(meta, key, items)
        if values is None:
            return None
        try:
            values = np.asarray(values, dtype=dtype)
        except (TypeError, ValueError, OverflowError):
            raise VocabError(f"invalid gguf type for {key}: expected a numeric array") from None
        if values.ndim != 1 or len(values) < n:
            raise VocabError(f"{key} has {values.size} entries for {n} tokens")
        return values[:n]

    def _make_tokenizer(self, meta: Metadata) -> SpmTokenizer | BpeTokenizer | WpmTokenizer | UgmTokenizer:
        if self.type == UGM:
            return UgmTokenizer(self._token_bytes, self._scores, self._attrs, self._charsmap(meta), self._ids["unk"],
                                escape_whitespaces=self.escape_whitespaces, add_space_prefix=self.add_space_prefix,
                                remove_extra_whitespaces=self.remove_extra_whitespaces)
        if self.type == SPM:
            ids = {b: i for i, b in enumerate(self._token_bytes)}
            return SpmTokenizer(ids, self._scores, self.byte_to_token)
        if self.type == WPM:
            ids = {b: i for i, b in enumerate(self._token_bytes)}
            return WpmTokenizer(ids, self._max_token_len, None, True, True)   # finished in _read_special_ids
        spec = self.pre_tokenizer
        assert spec is not None
        return BpeTokenizer(self._token_to_id, self._ranks, spec.patterns, spec.byte_level,
                            self.ignore_merges, newline_words_whole=spec.kind == "gemma4")

    @staticmethod
    def _charsmap(meta: Metadata) -> CharsMap | None:
        blob = _typed_array(meta, "tokenizer.ggml.precompiled_charsmap", (GGUFType.INT8, GGUFType.UINT8))
        if blob is None:
            return None
        return CharsMap(np.asarray(blob).astype(np.uint8).tobytes())   # an empty one is refused, as in llama.cpp

    def _find_linefeed(self) -> int:
        if self.type == SPM:
            for text in ("<0x0A>", "\n"):
                if text in self._token_to_id:
                    return self._token_to_id[text]
            return self._ids["pad"]
        if self.type == WPM:
            return self._ids["pad"]
        ids: list[int] = []
        self._tokenizer.tokenize(b"\n", ids)   # no special tokens are known yet, as in llama.cpp
        return ids[0] if ids else self._ids["pad"]

    def _read_special_ids(self, meta: Metadata) -> None:
        n = self.n_tokens
        for name, keys in ID_KEYS.items():
            for key in keys:
                if self._ids[name] >= n:
                    log.warning("default %s token %d is out of range; disabled", name, self._ids[name])
                    self._ids[name] = -1
                new_id = meta.get_u32(key)
                if new_id is None:
                    continue
                if 0 <= new_id < n:
                    self._ids[name] = new_id
                else:
                    log.warning("bad special token %s = %d; keeping %d", key, new_id, self._ids[name])
        for flag in ("add_bos", "add_eos", "add_sep"):
            setattr(self, flag, meta.get_bool(f"tokenizer.ggml.{flag}_token", getattr(self, flag)))
        if self.pre_tokenizer is not None and self.pre_tokenizer.kind == "gemma4":
            self.add_bos = True   # llama.cpp forces BOS for Gemma 4
        lowercase = self.lowercase
        self.lowercase = meta.get_bool("tokenizer.ggml.normalizer.lowercase", lowercase)
        self.strip_accents = meta.get_bool("tokenizer.ggml.normalizer.strip_accents", self.lowercase)
        _typed_array(meta, "tokenizer.ggml.suppress_tokens", (GGUFType.INT32,))   # checked, as llama.cpp
        if isinstance(self._tokenizer, WpmTokenizer):
            tok = self._tokenizer
            tok.unk, tok.lowercase, tok.strip_accents = self.unk, self.lowercase, self.strip_accents
        elif isinstance(self._tokenizer, UgmTokenizer):
            self._tokenizer.unk = self._ids["unk"]   # read when tokenizing, as vocab.token_unk()

    def _detect_specials_by_text(self) -> None:
        """EOT/EOM/FIM tokens the GGUF does not name are found by their text. With several
        candidates llama.cpp takes whichever its unordered_map yields first: we compute that order."""
        order: dict[str, int] | None = None
        for name, texts in BY_TEXT.items():
            if self._ids[name] != -1:
                continue
            found = [t for t in texts if t in self._token_to_id]
            if len(found) > 1:
                if order is None:
                    order = self._map_order(t for names in BY_TEXT.values() for t in names)
                found.sort(key=order.__getitem__)
            if found:
                token = self._token_to_id[found[0]]
                self._ids[name] = token
                self._attrs[token] |= ATTR_CONTROL

    def _map_order(self, texts: Any) -> dict[str, int]:
        wanted = {t for t in texts if t in self._token_to_id}
        ranks: dict[str, int] = {}
        for rank, i in enumerate(iteration_order(self._token_bytes)):
            if self._texts[i] in wanted:
                ranks[self._texts[i]] = rank
                if len(ranks) == len(wanted):
                    break
        return ranks

    def _build_eog(self) -> None:
        by_text = self._token_to_id
        for text, token in by_text.items():
            # control tokens named "unused" are unused (only the last id of a duplicated text)
            if self._attrs[token] & ATTR_CONTROL and "unused" in text:
                self._attrs[token] |= ATTR_UNUSED
        eog = {self._ids[k] for k in ("fim_pad", "fim_rep", "fim_sep") if self._ids[k] != -1}
        for text in EOG_TEXTS & by_text.keys():
            eog.add(by_text[text])
            self._attrs[by_text[text]] |= ATTR_CONTROL
        for text in ALWAYS_RENDERED:
            if text in by_text:
                self._attrs[by_text[text]] = ATTR_USER_DEFINED
        eog |= {self._ids[k] for k in ("eos", "eot", "eom") if self._ids[k] != -1}
        texts = {t: self._texts[t] for t in sorted(eog)}
        ends = [t for t, s in texts.items() if s == "<|end|>"]
        has = set(texts.values())
        has_call = "<|call|>" in has or "<|calls|>" in has
        if ends and has_call and ("<|return|>" in has or "<|flush|>" in has):
            eog.discard(ends[-1])     # harmony/solar-open: <|end|> ends a message, not generation
            self._attrs[ends[-1]] = ATTR_USER_DEFINED
        plain_s = [t for t, s in texts.items() if s == "</s>"]
        if plain_s and has & {"<|tool_response>", "<|plamo:eos|>"}:
            eog.discard(plain_s[-1])  # gemma4/plamo: </s> is an ordinary token there
            self._attrs[plain_s[-1]] = ATTR_NORMAL
        self._eog = frozenset(eog)

    def _set_strip_attrs(self, meta: Metadata) -> None:
        """Per-model lstrip/rstrip of special tokens, keyed on names as in llama.cpp."""
        name = meta.get_str("general.name", "").encode().lower().decode(errors="replace")
        pre = meta.get_str("tokenizer.ggml.pre", "")
        arch = meta.get_str("general.architecture", "")

        def require(text: str) -> int:
            if text not in self._token_to_id:
                raise VocabError(f"vocab of {name!r} has no token {text!r}, which llama.cpp requires for it")
            return self._token_to_id[text]

        if any(s in pre for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or \
                any(s in arch for s in ("nomic-bert-moe", "jina-bert-v3")):
            if "<mask>" in self._token_to_id:
                self._attrs[self._token_to_id["<mask>"]] |= ATTR_LSTRIP
        elif "phi-3" in name or "phi3" in name:
            for token in self._special_tokens:
                self._attrs[token] |= ATTR_RSTRIP
            self._attrs[require("</s>")] |= ATTR_RSTRIP
            for text in ("<unk>", "<s>", "<|endoftext|>"):
                self._attrs[require(text)] &= ~ATTR_RSTRIP
        elif "modern-bert" in name and "[MASK]" in self._token_to_id:
            self._attrs[self._token_to_id["[MASK]"]] |= ATTR_LSTRIP

    # ------------------------------------------------------------------ accessors

    @property
    def n_tokens(self) -> int:
        return len(self._texts)

    def __len__(self) -> int:
        return len(self._texts)

    def _special_id(self, name: str) -> int | None:
        token = self._ids[name]
        return None if token < 0 else token

    bos = property(lambda self: self._special_id("bos"), doc="beginning of sequence (also CLS)")
    eos = property(lambda self: self._special_id("eos"))
    eot = property(lambda self: self._special_id("eot"), doc="end of turn")
    eom = property(lambda self: self._special_id("eom"), doc="end of message")
    unk = property(lambda self: self._special_id("unk"))
    sep = property(lambda self: self._special_id("sep"))
    pad = property(lambda self: self._special_id("pad"))
    mask = property(lambda self: self._special_id("mask"))
    nl = property(lambda self: self._special_id("nl"), doc="newline")
    cls = bos
    fim_pre = property(lambda self: self._special_id("fim_pre"))
    fim_suf = property(lambda self: self._special_id("fim_suf"))
    fim_mid = property(lambda self: self._special_id("fim_mid"))
    fim_pad = property(lambda self: self._special_id("fim_pad"))
    fim_rep = property(lambda self: self._special_id("fim_rep"))
    fim_sep = property(lambda self: self._special_id("fim_sep"))

    @property
    def eog_ids(self) -> frozenset[int]:
        """Every token that ends generation."""
        return self._eog

    def _check(self, token: int) -> int:
        if not 0 <= token < len(self._texts):
            raise VocabError(f"token id {token} is out of range for a vocab of {len(self._texts)} tokens")
        return token

    def text(self, token: int) -> str:
        """The token's text as stored in the GGUF (llama_vocab_get_text)."""
        return self._texts[self._check(token)]

    def score(self, token: int) -> float:
        return self._scores[self._check(token)]

    def attr(self, token: int) -> int:
        """llama_token_attr bits (vocab_special.ATTR_*)."""
        return self._attrs[self._check(token)]

    def token_id(self, text: str) -> int | None:
        """The id of the token with exactly this text, if any."""
        return self._token_to_id.get(text)

    def is_eog(self, token: int) -> bool:
        return token in self._eog

    def is_control(self, token: int) -> bool:
        return bool(self.attr(token) & ATTR_CONTROL)

    def is_byte(self, token: int) -> bool:
        return bool(self.attr(token) & ATTR_BYTE)

    def is_user_defined(self, token: int) -> bool:
        return bool(self.attr(token) & ATTR_USER_DEFINED)

    def is_unknown(self, token: int) -> bool:
        return bool(self.attr(token) & ATTR_UNKNOWN)

    def is_unused(self, token: int) -> bool:
        return bool(self.attr(token) & ATTR_UNUSED)

    def is_normal(self, token: int) -> bool:
        return bool(self.attr(token) & ATTR_NORMAL)

    def byte_to_token(self, byte: int) -> int:
        """The token for one raw byte (llama_vocab::byte_to_token)."""
        if self.type in (SPM, UGM):
            for text in (f"<0x{byte:02X}>", chr(byte) if byte < 0x80 else None):
                if text in self._token_to_id:
                    return self._token_to_id[text]
        else:
            text = uc.BYTE_TO_UNICODE[byte]
            if text in self._token_to_id:
                return self._token_to_id[text]
        raise VocabError(f"the vocab has no token for byte 0x{byte:02X}")

    def __repr__(self) -> str:
        return f"Vocab(model={self.model!r}, pre={self.pre!r}, n_tokens={self.n_tokens})"

    # ------------------------------------------------------------------ tokenize

    def tokenize(self, text: str | bytes, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """llama_tokenize: token ids of `text` (str, or UTF-8 bytes which may be invalid).

        add_special adds BOS/EOS/SEP as the vocab asks; parse_special lets control tokens written
        in the text (like "<|im_start|>") become those tokens. User-defined tokens always match."""
        raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
        fragments = self._partition(raw, parse_special) if raw else []
        out: list[int] = []
        if self.type == SPM:
            if add_special and self.add_bos:
                out.append(self._required("bos"))
            prev_special = True  # a space is prefixed to text at the start or after a special token
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                    prev_special = True
                    continue
                piece = raw[frag[0]:frag[1]]
                if self.add_space_prefix and prev_special:
                    piece = b" " + piece
                self._tokenizer.tokenize(piece.replace(b" ", _ESCAPED_SPACE), out)
                prev_special = False
            if add_special and self.add_eos:
                out.append(self._required("eos"))
            return out
        if add_special and (self.type == WPM or self.add_bos):
            out.append(self._required("bos"))
        for frag in fragments:
            if isinstance(frag, int):
                out.append(frag)
                continue
            piece = raw[frag[0]:frag[1]]
            if self.type == BPE and self.escape_whitespaces:
                piece = piece.replace(b" ", _ESCAPED_SPACE)
            self._tokenizer.tokenize(piece, out)
        if add_special and self.type == WPM:
            out.append(self._required("sep"))
        elif add_special and self.add_eos:
            out.append(self._required("eos"))
        return out

    def _required(self, name: str) -> int:
        token = self._ids[name]
        if token < 0:
            raise VocabError(f"the vocab asks for a {name.upper()} token but has none")
        return token

    def _partition(self, raw: bytes, parse_special: bool) -> list[int | tuple[int, int]]:
        """tokenizer_st_partition: cut special-token texts out of the raw text, longest first.

        Fragments are token ids or (start, end) byte ranges of text still to tokenize; a special
        token with lstrip/rstrip also swallows the C-locale whitespace beside it."""
        fragments: list[int | tuple[int, int]] = [(0, len(raw))]
        texts, attrs = self._token_bytes, self._attrs
        for token in [t for t in self._special_tokens if texts[t] in raw]:
            attr = attrs[token]
            if not parse_special and attr & _SPECIAL:
                continue  # only user-defined tokens match when not parsing special tokens
            needle = texts[token]
            result: list[int | tuple[int, int]] = []
            for frag in fragments:
                if isinstance(frag, int):
                    result.append(frag)
                    continue
                start, end = frag
                while (match := raw.find(needle, start, end)) >= 0:
                    left_end = match
                    if attr & ATTR_LSTRIP:
                        while left_end > start and raw[left_end - 1] in _C_SPACE:
                            left_end -= 1
                    if left_end > start:
                        result.append((start, left_end))
                    result.append(token)
                    start = match + len(needle)
                    if attr & ATTR_RSTRIP:
                        while start < end and raw[start] in _C_SPACE:
                            start += 1
                if start < end:
                    result.append((start, end))
            fragments = result
        return fragments

    # ------------------------------------------------------------------ detokenize

    def token_to_piece(self, token: int, lstrip: int = 0, special: bool = False) -> bytes:
        """llama_token_to_piece: the bytes a token stands for. Control and unknown tokens give b""
        unless `special`; up to `lstrip` leading spaces are dropped."""
        attr = self._attrs[self._check(token)]
        if not special and attr & _SPECIAL:
            return b""
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self._piece(token, attr)
        n = 0
        while n < lstrip and n < len(piece) and piece[n] == 0x20:
            n += 1
        return piece[n:]

    def _piece(self, token: int, attr: int) -> bytes:
        text = self._texts[token]
        if attr & (_SPECIAL | ATTR_USER_DEFINED):
            return self._token_bytes[token]
        if attr & ATTR_NORMAL:
            if self.type != BPE or self.escape_whitespaces:
                return text.replace("\u2581", " ").encode("utf-8", "surrogatepass")
            return decode_byte_level(text)
        if attr & ATTR_BYTE:
            if self.type == WPM:
                raise VocabError(f"token {token} is a byte token, which a WPM vocab cannot have")
            return bytes([hex_prefix(text[3:5])])
        return b""  # unused and undefined tokens have no text

    def detokenize_bytes(self, tokens: Sequence[int], remove_special: bool = False,
                         unparse_special: bool = False) -> bytes:
        """llama_detokenize: the text of `tokens` as bytes (possibly cut inside a UTF-8 sequence)."""
        tokens = [int(t) for t in tokens]
        for t in tokens:
            self._check(t)
        remove_space = self.add_space_prefix
        if remove_special and self.add_bos and tokens and tokens[0] == self._ids["bos"]:
            remove_space = False
            tokens = tokens[1:]
        if remove_special and self.add_eos and tokens and tokens[-1] == self._ids["eos"]:
            tokens = tokens[:-1]
        text = b"".join(self.token_to_piece(t, int(remove_space and i == 0), unparse_special)
                        for i, t in enumerate(tokens))
        return clean_spaces(text) if self.clean_spaces else text

    def detokenize(self, tokens: Sequence[int], remove_special: bool = False,
                   unparse_special: bool = False) -> str:
        """llama_detokenize as a str (invalid UTF-8 becomes U+FFFD)."""
        text = self.detokenize_bytes(tokens, remove_special, unparse_special)
        return text.decode("utf-8", errors="replace")

