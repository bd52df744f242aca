"""The vocab half of the BERT converter: WordPiece tokens, their types, special ids and flags,
read from a Hugging Face directory without transformers, as llama.cpp's convert_hf_to_gguf.py
(BertModel.set_vocab, TextModel.get_vocab_base, gguf-py's SpecialVocab) derives them.

- tokens: the tokenizer's vocab (tokenizer.json's WordPiece model, else vocab.txt) plus its added
  tokens; an id below vocab_size that names no token becomes "[PAD{id}]" (UNUSED). Added tokens
  that are special (or look special) are CONTROL, other added tokens USER_DEFINED, the rest NORMAL.
- llama.cpp's phantom-space form: CONTROL tokens as they are, "##x" -> "x", any other x -> "\u2581x".
- tokenizer.ggml.pre: convert hashes the tokenizer's ids for a fixed check text; we compute those ids
  with a small reimplementation of Hugging Face's BERT tokenizer (BertNormalizer, BertPreTokenizer,
  greedy WordPiece) and look the hash up the way convert does.
"""

from __future__ import annotations

import hashlib
import json
import logging
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf

log = logging.getLogger(__name__)

PHANTOM_SPACE = "\u2581"

# transformers' BertTokenizer defaults, used where tokenizer_config.json does not name a token
_BERT_SPECIAL_DEFAULTS = {"unk": "[UNK]", "sep": "[SEP]", "pad": "[PAD]", "cls": "[CLS]", "mask": "[MASK]"}
_SPECIAL_TYPES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")

# the special-id keys gguf-py's GGUFWriter has handlers for (add_{typ}_token_id): cls has none, so
# convert logs "No handler" and writes no cls id; llama.cpp then takes bos as cls
_ID_KEYS = {
    "bos": gguf.Keys.Tokenizer.BOS_ID, "eos": gguf.Keys.Tokenizer.EOS_ID, "unk": gguf.Keys.Tokenizer.UNK_ID,
    "sep": gguf.Keys.Tokenizer.SEP_ID, "pad": gguf.Keys.Tokenizer.PAD_ID, "mask": gguf.Keys.Tokenizer.MASK_ID,
    "eot": gguf.Keys.Tokenizer.EOT_ID, "eom": gguf.Keys.Tokenizer.EOM_ID,
}
_ADD_KEYS = {"bos": gguf.Keys.Tokenizer.ADD_BOS, "eos": gguf.Keys.Tokenizer.ADD_EOS,
             "sep": gguf.Keys.Tokenizer.ADD_SEP}
NORMALIZER_LOWERCASE = "tokenizer.ggml.normalizer.lowercase"
NORMALIZER_STRIP_ACCENTS = "tokenizer.ggml.normalizer.strip_accents"

# get_vocab_base_pre's check text, and the hashes of its ids that name a WordPiece pre-tokenizer
# (0876d13b is both bge-small-en-v1.5 and jina-embeddings-v2-base-en: convert's later test wins)
CHECK_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n\U0001f680 (normal) \U0001f636\u200d\U0001f32b\ufe0f "
    "(multiple emojis concatenated) \u2705 \U0001f999\U0001f999 3 33 333 3333 33333 333333 3333333 33333333 "
    "3.3 3..3 3...3 \u1780\u17b6\u1793\u17cb\u178f\u17c2\u1796\u17b7\u179f\u17c1\u179f\u17a2\u17b6\u1785"
    "\U0001f601 ?\u6211\u60f3\u5728apple\u5de5\u4f5c1314151\u5929\uff5e ------======= "
    "\u043d\u0435\u0449\u043e \u043d\u0430 \u0411\u044a\u043b\u0433\u0430\u0440\u0441\u043a\u0438 "
    "''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you sure? 'M not sure I'll "
    "make it, 'D you like some tea? We'Ve a'lL"
)
WPM_PRE_BY_HASH = {"0876d13b50744004aa9aeae05e7b0647eac9d801b5ba4668afc01e709c15e19f": "jina-v2-en"}


class VocabConvertError(ValueError):
    """The directory's tokenizer files cannot give a BERT WordPiece vocab."""


@dataclass
class SpecialVocab:
    """What gguf-py's SpecialVocab would add to the GGUF: special ids, add_* flags, normalizer flags."""

    ids: dict[str, int] = field(default_factory=dict)
    add: dict[str, bool] = field(default_factory=dict)
    lowercase: bool | None = None
    strip_accents: bool | None = None

    def add_to_gguf(self, w: gguf.GGUFWriter) -> None:
        for typ, token in self.ids.items():
            if typ in _ID_KEYS:
                w.add_uint32(_ID_KEYS[typ], token)
            else:
                log.info("no GGUF key for the %s token (%d); convert_hf_to_gguf.py skips it too", typ, token)
        for typ, value in self.add.items():
            if typ in _ADD_KEYS:
                w.add_bool(_ADD_KEYS[typ], value)
        if self.lowercase is not None:
            w.add_bool(NORMALIZER_LOWERCASE, self.lowercase)
        if self.strip_accents is not None:
            w.add_bool(NORMALIZER_STRIP_ACCENTS, self.strip_accents)


@dataclass
class WpmVocab:
    """A converted vocab: tokens in phantom-space form, their gguf.TokenType, the pre-tokenizer name."""

    tokens: list[str]
    types: list[int]
    pre: str
    special: SpecialVocab

    def add_to_gguf(self, w: gguf.GGUFWriter, n_token_types: int) -> None:
        w.add_token_type_count(n_token_types)
        w.add_tokenizer_model("bert")
        w.add_tokenizer_pre(self.pre)
        w.add_token_list(self.tokens)
        w.add_token_types(self.types)
        self.special.add_to_gguf(w)


def read_vocab(hf_dir: Path, vocab_size: int) -> WpmVocab:
    """The WordPiece vocab of `hf_dir`, `vocab_size` entries long, as convert writes it."""
    tokenizer = _read_json(hf_dir / "tokenizer.json")
    config = _read_json(hf_dir / "tokenizer_config.json")
    base = _base_vocab(hf_dir, tokenizer)
    added = _added_tokens(tokenizer, config, _read_json(hf_dir / "special_tokens_map.json"), base)
    vocab = base | {t.content: t.id for t in added.values()}
    if max(vocab.values()) >= vocab_size:
        worst = max(vocab, key=vocab.__getitem__)
        raise VocabConvertError(f"{hf_dir}: token {worst!r} has id {vocab[worst]}, but config.json's vocab_size "
                                f"is {vocab_size}")
    by_id = {i: t for t, i in vocab.items()}
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = by_id[i]
        if i in added and (added[i].special or _looks_special(token)):
            types.append(gguf.TokenType.CONTROL)
        elif i in added:
            types.append(gguf.TokenType.USER_DEFINED)
            token = token.replace(PHANTOM_SPACE, " ")
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    phantom = [_phantom(t, k) for t, k in zip(tokens, types)]
    special = read_special_vocab(hf_dir, vocab_size, tokenizer, config)
    return WpmVocab(phantom, [int(k) for k in types], _pre_name(hf_dir, vocab, tokenizer, config), special)


def _phantom(token: str, toktype: int) -> str:
    """llama.cpp's WPM form: a word start carries U+2581, a continuation loses its '##'."""
    if toktype == gguf.TokenType.CONTROL:
        return token
    if token.startswith("##"):
        return token[2:]
    return PHANTOM_SPACE + token


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise VocabConvertError(f"{path} is not valid JSON: {err}") from None


def _base_vocab(hf_dir: Path, tokenizer: dict | None) -> dict[str, int]:
    """token -> id of the WordPiece model: tokenizer.json's (what AutoTokenizer loads), else vocab.txt."""
    if tokenizer is not None:
        model = tokenizer.get("model") or {}
        if model.get("type") != "WordPiece" or not isinstance(model.get("vocab"), dict):
            raise VocabConvertError(f"{hf_dir / 'tokenizer.json'}: the tokenizer model is {model.get('type')!r}, "
                                    "not WordPiece; a BERT conversion needs a WordPiece vocab")
        return {str(t): int(i) for t, i in model["vocab"].items()}
    path = hf_dir / "vocab.txt"
    if not path.is_file():
        raise VocabConvertError(f"{hf_dir}: no tokenizer (neither tokenizer.json nor vocab.txt)")
    lines = path.read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    vocab: dict[str, int] = {}
    for i, line in enumerate(lines):
        vocab[line] = i   # transformers' load_vocab: a repeated line takes the later id
    if not vocab:
        raise VocabConvertError(f"{path} is empty")
    return vocab


@dataclass(frozen=True)
class _Added:
    id: int
    content: str
    special: bool


def _added_tokens(tokenizer: dict | None, config: dict | None, special_map: dict | None,
                  base: dict[str, int]) -> dict[int, _Added]:
    """id -> added token, as transformers' added_tokens_decoder holds them: tokenizer.json's added
    tokens, tokenizer_config's added_tokens_decoder, and every named special token of the vocab."""
    added: dict[int, _Added] = {}
    for entry in (tokenizer or {}).get("added_tokens", []):
        added[int(entry["id"])] = _Added(int(entry["id"]), entry["content"], bool(entry.get("special")))
    for key, entry in ((config or {}).get("added_tokens_decoder") or {}).items():
        added.setdefault(int(key), _Added(int(key), entry["content"], bool(entry.get("special"))))
    named = [_token_text(v) for src in (config or {}, special_map or {})
             for k, v in src.items() if k.endswith("_token")]
    named += [_token_text(v) for src in (config or {}, special_map or {})
              for v in src.get("additional_special_tokens") or []]
    if config is None and special_map is None:
        named += list(_BERT_SPECIAL_DEFAULTS.values())
    known = {a.content for a in added.values()}
    for text in named:
        if text is not None and text not in known and text in base:
            added[base[text]] = _Added(base[text], text, True)
            known.add(text)
    return added


def _token_text(entry: Any) -> str | None:
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict) and isinstance(entry.get("content"), str):
        return entry["content"]
    return None


def _looks_special(token: str) -> bool:
    """TextModel.does_token_look_special: added tokens some models forget to mark special."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
            or (token.startswith("<unused") and token.endswith(">")))


# ----------------------------------------------------------------------------------------------
# Special ids and add_* flags: gguf-py's SpecialVocab, for the tokenizer files a BERT model has.


def read_special_vocab(hf_dir: Path, n_vocab: int, tokenizer: dict | None = None,
                       config: dict | None = None) -> SpecialVocab:
    """Special ids from tokenizer_config.json (resolved through tokenizer.json's added tokens) and
    config.json's *_token_id; add_bos/eos/sep from the post-processor template."""
    sv = SpecialVocab()
    config = dict(config) if config is not None else None   # SpecialVocab fills in bos/eos/... in place
    types = list(_SPECIAL_TYPES)
    added_tokens = []
    if tokenizer is not None:
        if normalizer := tokenizer.get("normalizer"):
            _parse_normalizer(sv, normalizer)
        added_tokens = tokenizer.get("added_tokens", [])
        _read_post_processor(sv, tokenizer, config, types)
    if config:
        for typ in types:
            add_entry = config.get(f"add_{typ}_token")
            if isinstance(add_entry, bool):
                sv.add.setdefault(typ, add_entry)   # a post-processor's choice wins, as in SpecialVocab
            text = _token_text(config.get(f"{typ}_token"))
            if text is not None:
                token = next((a.get("id") for a in added_tokens if a.get("content") == text), None)
                _set_special(sv, typ, token, n_vocab)
    model_config = _read_json(hf_dir / "config.json") or {}
    for typ in types:
        _set_special(sv, typ, model_config.get(f"{typ}_token_id"), n_vocab)
    return sv


def _set_special(sv: SpecialVocab, typ: str, token: Any, n_vocab: int) -> None:
    if not isinstance(token, int) or isinstance(token, bool):
        return
    if token < 0:
        raise VocabConvertError(f"invalid id for the {typ} token: {token}")
    if token >= n_vocab:
        log.warning("the %s token id %d is out of range (vocab of %d); skipped", typ, token, n_vocab)
        return
    sv.ids.setdefault(typ, token)


def _parse_normalizer(sv: SpecialVocab, normalizer: dict) -> None:
    kind = normalizer.get("type")
    if kind == "Lowercase":
        sv.lowercase = True
    elif kind == "StripAccents":
        sv.strip_accents = True
    elif kind == "BertNormalizer":
        if "lowercase" in normalizer:
            sv.lowercase = normalizer["lowercase"]
        if "strip_accents" in normalizer:
            sv.strip_accents = normalizer["strip_accents"]
    elif kind == "Sequence":
        for inner in normalizer.get("normalizers", []):
            _parse_normalizer(sv, inner)


def _read_post_processor(sv: SpecialVocab, tokenizer: dict, config: dict | None, types: list[str]) -> None:
    """add_bos/add_eos/add_sep from a ByteLevel, RobertaProcessing or TemplateProcessing post-processor.

    `names` holds the bos/cls/eos/sep texts as SpecialVocab's locals do; like SpecialVocab, a
    template may fill missing ones into tokenizer_config (`config`, a copy), where the ids are read."""
    tc = config if config is not None else {}
    names = {t: _token_text(tc.get(f"{t}_token")) for t in ("bos", "cls", "eos", "sep")}
    if not names["bos"] and names["cls"] and config:
        tc["bos_token"] = names["bos"] = names["cls"]
    if not names["eos"] and names["sep"] and config:
        tc["eos_token"] = names["eos"] = names["sep"]
    post = tokenizer.get("post_processor") or {}
    for proc in post.get("processors", [post]) if post else []:
        kind = proc.get("type")
        if kind == "ByteLevel":
            sv.add.setdefault("bos", False)
            sv.add.setdefault("eos", False)
        elif kind == "RobertaProcessing":
            sv.add.update(bos=True, eos=True, sep=True)
            if not names["cls"] and config:
                tc["cls_token"] = names["cls"] = proc.get("cls", [names["bos"]])[0]
            if not names["sep"] and config:
                tc["sep_token"] = names["sep"] = proc.get("sep", [names["eos"]])[0]
        elif kind == "TemplateProcessing":
            first, last = _template_ends(sv, proc.get("single", []), tc, bool(config), types, names)
            _template_pair(sv, proc.get("pair", []), tc, bool(config), first, last, names)


def _special_id(item: dict) -> str | None:
    return item.get("SpecialToken", {}).get("id")


def _template_ends(sv: SpecialVocab, single: list[dict], tc: dict, has_config: bool, types: list[str],
                   names: dict[str, str | None]) -> tuple[str | None, str | None]:
    """The leading and trailing special tokens of the single-sequence template: add_bos, add_eos."""
    if len(single) <= 1:
        return None, None
    if first := _special_id(single[0]):
        if not has_config:
            names["bos"] = first
        elif first not in (names["bos"], names["cls"]):
            if not names["bos"]:
                tc["bos_token"] = names["bos"] = first
            if not names["cls"]:
                tc["cls_token"] = names["cls"] = first
        sv.add["bos"] = first in (names["bos"], names["cls"])
    if last := _special_id(single[-1]):
        if not has_config:
            names["eos"] = last
        elif last != names["eos"]:
            for extra in ("eot", "eom"):   # the old eos is kept as end of turn (or of message)
                if extra not in types:
                    types.append(extra)
                    tc[f"{extra}_token"] = names["eos"]
                    break
            tc["eos_token"] = names["eos"] = last
        sv.add["eos"] = last == names["eos"]
    return first, last


def _template_pair(sv: SpecialVocab, pair: list[dict], tc: dict, has_config: bool, first: str | None,
                   last: str | None, names: dict[str, str | None]) -> None:
    """add_sep: whether the pair template puts its own separator between A and B."""
    start = 1 if first and pair and _special_id(pair[0]) == first else 0
    stop = -1 if last and pair and _special_id(pair[-1]) == last else None
    pair = pair[slice(start, stop)]
    if not pair or pair[0].get("Sequence", {}).get("id") != "A" or pair[-1].get("Sequence", {}).get("id") != "B":
        return
    middle = pair[1:-1]
    if not middle:
        return
    separators = (names["sep"], names["eos"])
    entry = _special_id(middle[0])
    add_sep = bool(entry) and entry in separators and not last
    if len(middle) == 2:
        second = _special_id(middle[1])
        add_sep = add_sep or (bool(second) and second in separators)
    sv.add["sep"] = add_sep
    if add_sep and not names["sep"] and has_config:
        tc["sep_token"] = names["eos"]


# ----------------------------------------------------------------------------------------------
# tokenizer.ggml.pre: the sha256 of str(ids) of the check text, as Hugging Face's BERT tokenizer
# encodes it ([CLS] ... [SEP]).


def _pre_name(hf_dir: Path, vocab: dict[str, int], tokenizer: dict | None, config: dict | None) -> str:
    lowercase, strip_accents, chinese = _normalizer_options(tokenizer, config)
    cls_text = _token_text((config or {}).get("cls_token")) or _BERT_SPECIAL_DEFAULTS["cls"]
    sep_text = _token_text((config or {}).get("sep_token")) or _BERT_SPECIAL_DEFAULTS["sep"]
    unk_text = _token_text((config or {}).get("unk_token")) or _BERT_SPECIAL_DEFAULTS["unk"]
    if not all(t in vocab for t in (cls_text, sep_text, unk_text)):
        digest = None
    else:
        words = bert_basic_split(CHECK_TEXT, lowercase, strip_accents, chinese)
        ids = [vocab[cls_text], *wordpiece(words, vocab, vocab[unk_text]), vocab[sep_text]]
        digest = hashlib.sha256(str(ids).encode()).hexdigest()
    if digest in WPM_PRE_BY_HASH:
        return WPM_PRE_BY_HASH[digest]
    # llama.cpp ignores tokenizer.ggml.pre for WPM vocabs, so an unknown hash costs nothing at run time
    log.warning("%s: the tokenizer's check hash %s is not one convert_hf_to_gguf.py knows (it would refuse "
                "the model); writing tokenizer.ggml.pre = 'default', which llama.cpp's WPM tokenizer ignores",
                hf_dir, digest)
    return "default"


def _normalizer_options(tokenizer: dict | None, config: dict | None) -> tuple[bool, bool, bool]:
    """(lowercase, strip_accents, handle_chinese_chars) of the tokenizer's BERT normalizer."""
    norm = (tokenizer or {}).get("normalizer") or {}
    if norm.get("type") == "BertNormalizer":
        lowercase = bool(norm.get("lowercase", True))
        strip = norm.get("strip_accents")
        return lowercase, lowercase if strip is None else bool(strip), bool(norm.get("handle_chinese_chars", True))
    tc = config or {}
    lowercase = bool(tc.get("do_lower_case", True))
    strip = tc.get("strip_accents")
    return lowercase, lowercase if strip is None else bool(strip), bool(tc.get("tokenize_chinese_chars", True))


def _is_cjk(cp: int) -> bool:
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF
            or 0x2A700 <= cp <= 0x2B73F or 0x2B740 <= cp <= 0x2B81F or 0x2B820 <= cp <= 0x2CEAF
            or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


def _is_punctuation(c: str) -> bool:
    cp = ord(c)
    return 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126 or \
        unicodedata.category(c).startswith("P")


def bert_basic_split(text: str, lowercase: bool, strip_accents: bool, chinese: bool) -> list[str]:
    """Hugging Face's BERT normalizer + pre-tokenizer: drop controls, split on whitespace and
    punctuation (each its own word), CJK characters as single words, optional lowercase/NFD strip."""
    chars = []
    for c in text:
        if c in "\t\n\r" or c == " " or unicodedata.category(c) == "Zs":
            chars.append(" ")
        elif ord(c) not in (0, 0xFFFD) and not unicodedata.category(c).startswith("C"):
            chars.append(f" {c} " if chinese and _is_cjk(ord(c)) else c)
    words: list[str] = []
    for chunk in "".join(chars).split():
        if lowercase:
            chunk = chunk.lower()
        if strip_accents:
            chunk = "".join(c for c in unicodedata.normalize("NFD", chunk) if unicodedata.category(c) != "Mn")
        word = ""
        for c in chunk:
            if _is_punctuation(c):
                words += [word, c] if word else [c]
                word = ""
            else:
                word += c
        if word:
            words.append(word)
    return words


def wordpiece(words: list[str], vocab: dict[str, int], unk: int, max_chars: int = 100) -> list[int]:
    """Greedy longest-match-first WordPiece; a word with an unmatched piece becomes [UNK]."""
    ids: list[int] = []
    for word in words:
        pieces: list[int] | None = [] if len(word) <= max_chars else None
        start = 0
        while pieces is not None and start < len(word):
            end = len(word)
            while end > start and (("##" if start else "") + word[start:end]) not in vocab:
                end -= 1
            if end == start:
                pieces = None
            else:
                pieces.append(vocab[("##" if start else "") + word[start:end]])
                start = end
        ids += [unk] if pieces is None else pieces
    return ids


__all__ = ["CHECK_TEXT", "SpecialVocab", "VocabConvertError", "WpmVocab", "bert_basic_split", "read_special_vocab",
           "read_vocab", "wordpiece"]
