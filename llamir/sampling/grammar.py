"""llama.cpp's `grammar` sampler: candidates a GBNF grammar (or a JSON schema, `--json-schema`)
does not allow get logit -inf, and accepted tokens advance the grammar.

The engine is llguidance (PyPI `llguidance`), not a parser of our own. Of the two libraries on
PyPI it is the one llama.cpp itself builds in (`LLAMA_LLGUIDANCE`: `%llguidance` grammars and, in
such builds, every `--json-schema`), so `Grammar.from_json_schema` is exactly that build's path; it
ships a GBNF-to-Lark converter; its wheel is ~8 MB with no dependencies; a token mask over a 49k
vocab takes ~0.1 ms. xgrammar 0.2.9 also reads GBNF-like EBNF and JSON schema, but it depends on
torch, transformers and the CUDA wheels (5.6 GB installed), far too heavy for a CPU library.

The library's tokenizer is built from the vocab as llama.cpp's integration builds it
(common/llguidance.cpp): each token's piece, or, for a token whose piece is empty (control and
unknown tokens), 0xFF followed by its text, which keeps those tokens out of text matching. The
piece is `token_to_piece` (llama.cpp detokenizes one token, which would also strip an SPM vocab's
leading space; the native grammar and llguidance's own llama.cpp glue use the piece, as we do).
End-of-generation tokens are allowed exactly when the grammar can end here, as
llama_grammar_apply_impl allows them.

GBNF goes through llguidance's converter, with what it gets wrong for GBNF set right (each case is
checked against llama.cpp's own sampler in tests/sampling/test_grammar.py): `.` matches any
character including a newline; `\\u` (four hex digits), `\\U` (eight) and `\\x80`..`\\xFF`
escapes become the characters they name (the converter writes escapes its Lark side cannot read); a rule named
`start`, and a `root=` other than "root", are renamed around the converter's fixed start rule; and
forcing is off: llguidance otherwise allows only the canonical tokenization of text the grammar
forces (after "((a" with "))" to come, only the token "))", not ")"), which is what llama.cpp's
llguidance build does for `%llguidance` grammars and JSON schemas, and what we keep for those.

Where llguidance and llama.cpp's native GBNF engine still differ:
- GBNF has no lexer, llguidance has one: rules without recursion become Lark terminals, and
  literals are lexemes, matched longest-first. Where a lexeme could both end and go on, llguidance
  only goes on: with `root ::= num "5"` and `num ::= [0-9]+`, "125" cannot end (llama.cpp lets it
  end with num = "12"), and `[a-z]+ "ing"` ends at the first "ing". Grammars whose pieces do not
  overlap that way (choices, JSON, lists with separators) agree token for token. For the lexerless
  reading, write `%llguidance {"no_forcing": true}` Lark with lowercase rules and one-character
  literals.
- A token ending inside a UTF-8 character is allowed when the character could still be one the
  grammar allows; llama.cpp refuses it when the character could also be one a negated class
  excludes (`[^\\u2028]` after " \\xe2\\x80", which may become U+2014 or U+2028).
- Control tokens never match text (llama.cpp's native sampler matches their text, e.g.
  `<|im_start|>` against `[^\\n]*`); GBNF token references (`<[id]>`, `<|name|>`, `!<...>`) are
  not read by the converter and are refused with its error.
- Left-recursive rules, which llama.cpp refuses, are accepted (llguidance parses with Earley).
- A token whose piece starts with a NUL byte is refused, as llama.cpp's C-string decoder does.
"""

from __future__ import annotations

import json
import logging
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import ASTNode, GrammarParser, Position, RegexNode, RuleNode, RuleRefNode, resolve

if TYPE_CHECKING:
    from llamir.frontend.vocab import Vocab

log = logging.getLogger(__name__)

LLGUIDANCE_PREFIX = "%llguidance"   # common_sampler_init sends grammars starting so to llguidance
_SPECIAL_MARKER = b"\xff"           # llguidance's prefix for tokens that match no text
# llguidance allows only the canonical tokens of text the grammar forces; GBNF allows any token
# that fits, so converted grammars turn forcing off
_GBNF_OPTIONS = json.dumps({"no_forcing": True})


# ---------------------------------------------------------------- grammar text

def json_schema_to_grammar(schema: str | dict[str, Any]) -> str:
    """common's json_schema_to_grammar in an LLAMA_LLGUIDANCE build: the schema as Lark `%json`."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict | bool):
        raise ValueError(f"a JSON schema is an object or a boolean, got {type(schema).__name__}")
    return f"{LLGUIDANCE_PREFIX} {{}}\nstart: %json {json.dumps(schema)}"


class _GbnfParser(GrammarParser):
    """llguidance's GBNF parser, reading character escapes the way llama.cpp's parse_char does."""

    def _parse_char(self, pos: Position) -> tuple[str, Position]:
        digits = {"x": 2, "u": 4, "U": 8}.get(pos.peek(2)[1:]) if pos.current() == "\\" else None
        if digits is None:
            return super()._parse_char(pos)
        hex_text = pos.peek(2 + digits)[2:]
        if len(hex_text) != digits or not all(c in "0123456789abcdefABCDEF" for c in hex_text):
            return super()._parse_char(pos)   # its "invalid escape" error, with the position
        code = int(hex_text, 16)
        # ASCII stays an escape (it may be a quote, bracket or control byte); the rest is the
        # character itself, which both Lark strings and regex classes read literally
        text = f"\\x{code:02x}" if code < 0x80 else chr(code)
        return text, pos.advance(2 + digits)


def _walk(node: ASTNode) -> Iterator[ASTNode]:
    yield node
    for child in node.children():
        yield from _walk(child)


def _rename_rules(rules: dict[str, RuleNode], names: dict[str, str]) -> dict[str, RuleNode]:
    """The rules with each old -> new name of `names` applied to definitions and references."""
    for rule in rules.values():
        for node in _walk(rule):
            if isinstance(node, RuleRefNode) and node.name in names:
                node.name = names[node.name]
    renamed = {}
    for name, rule in rules.items():
        rule.name = names.get(name, name)
        renamed[rule.name] = rule
    return renamed


def _spare_name(rules: dict[str, RuleNode], base: str) -> str:
    n = 0
    while f"{base}_{n}" in rules:
        n += 1
    return f"{base}_{n}"


def gbnf_to_lark(text: str, root: str = "root") -> str:
    """A GBNF grammar as llguidance Lark, starting at rule `root` (ValueError naming the place)."""
    try:
        rules = _GbnfParser().parse(text)
    except Exception as e:   # the converter raises bare Exceptions too
        raise ValueError(f"failed to parse grammar: {e}") from None
    if root not in rules:
        raise ValueError(f"grammar does not contain a '{root}' symbol")
    names = {}
    if "start" in rules:                 # the converter's start rule; keep the user's apart
        names["start"] = _spare_name(rules, "start")
    if root != "root":
        if "root" in rules:
            names["root"] = _spare_name(rules, "root")
        names[root] = "root"
    rules = _rename_rules(rules, names)
    for rule in rules.values():
        for node in _walk(rule):
            if isinstance(node, RegexNode) and node.rx == ".":
                node.rx = "(?s:.)"       # GBNF's any-character includes the newline
    try:
        resolve(rules)
    except Exception as e:
        raise ValueError(f"failed to parse grammar: {e}") from None
    ordered = sorted(rules.values(), key=lambda rule: rule.order)
    return f"{LLGUIDANCE_PREFIX} {_GBNF_OPTIONS}\n\n" + "\n\n".join(str(rule) for rule in ordered) + "\n"


def to_llguidance(grammar_str: str, root: str = "root") -> str:
    """The llguidance grammar for a GBNF text or a `%llguidance` Lark text."""
    if grammar_str.startswith(LLGUIDANCE_PREFIX):
        if root != "root":
            raise ValueError(f"root={root!r}: a {LLGUIDANCE_PREFIX} grammar always starts at its 'start' rule")
        return llguidance.LLMatcher.grammar_from_lark(grammar_str)
    return llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(grammar_str, root))


# ---------------------------------------------------------------- the vocab, as llguidance sees it

@dataclass(frozen=True)
class _VocabInfo:
    tokenizer: llguidance.LLTokenizer
    n_vocab: int
    eog: list[int]           # the end-of-generation tokens
    nul_led: list[int]       # the tokens whose piece starts with a NUL byte


class _TokenizerSource:
    """What llguidance.TokenizerWrapper reads: token bytes, EOS/BOS and a tokenize function."""

    def __init__(self, vocab: Vocab, pieces: list[bytes]):
        self.tokens = [piece or _marked_special(vocab, token) for token, piece in enumerate(pieces)]
        eot = vocab.eot
        self.eos_token_id = eot if eot is not None else vocab.eos
        self.bos_token_id = vocab.bos
        self.special_token_ids = [t for t, b in enumerate(self.tokens) if b.startswith(_SPECIAL_MARKER)]
        self._vocab = vocab

    def __call__(self, text: bytes) -> list[int]:
        # llama.cpp's tokenize_fn: llama_tokenize(add_special=false, parse_special=true)
        return self._vocab.tokenize(text, add_special=False, parse_special=True)


def _marked_special(vocab: Vocab, token: int) -> bytes:
    text = vocab.token_to_piece(token, special=True)
    return _SPECIAL_MARKER + text if text else b""


_VOCAB_INFO: weakref.WeakKeyDictionary[Any, _VocabInfo] = weakref.WeakKeyDictionary()


def _vocab_info(vocab: Vocab) -> _VocabInfo:
    """The llguidance tokenizer of a vocab, built once per vocab (it reads every token)."""
    info = _VOCAB_INFO.get(vocab)
    if info is None:
        pieces = [vocab.token_to_piece(t) for t in range(vocab.n_tokens)]
        source = _TokenizerSource(vocab, pieces)
        eog = sorted(vocab.eog_ids)
        tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(source), eos_token=eog or None)
        nul_led = [t for t, piece in enumerate(pieces) if piece[:1] == b"\x00"]
        info = _VocabInfo(tokenizer, vocab.n_tokens, eog, nul_led)
        _VOCAB_INFO[vocab] = info
    return info


def _new_matcher(info: _VocabInfo, grammar: str) -> llguidance.LLMatcher:
    matcher = llguidance.LLMatcher(info.tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise ValueError(f"invalid grammar: {matcher.get_error()}")
    for warning in matcher.get_grammar_warnings():
        log.warning("grammar: %s", warning)
    return matcher


# ---------------------------------------------------------------- the sampler

class Grammar:
    """llama_sampler_init_grammar(vocab, grammar_str, root): an empty grammar constrains nothing."""

    name = "grammar"

    def __init__(self, vocab: Vocab, grammar_str: str, root: str = "root"):
        self.vocab = vocab
        self.grammar_str = grammar_str
        self.root = root
        self._info: _VocabInfo | None = None
        self._initial: llguidance.LLMatcher | None = None   # never advanced: reset copies it
        self._matcher: llguidance.LLMatcher | None = None
        self._allowed: np.ndarray | None = None             # the current state's mask, bool [n_vocab]
        if grammar_str:
            self._info = _vocab_info(vocab)
            self._initial = _new_matcher(self._info, to_llguidance(grammar_str, root))
            self._matcher = self._initial.deep_copy()

    @classmethod
    def from_json_schema(cls, vocab: Vocab, schema: str | dict[str, Any]) -> Grammar:
        """The grammar of a JSON schema, as `--json-schema` gives it (json_schema_to_grammar)."""
        return cls(vocab, json_schema_to_grammar(schema))

    def allowed(self) -> np.ndarray:
        """bool [n_vocab]: which tokens the grammar allows next (EOG exactly when it can end)."""
        if self._matcher is None:
            return np.ones(self.vocab.n_tokens, dtype=bool)
        if self._allowed is None:
            self._allowed = self._compute_allowed()
        return self._allowed

    def _compute_allowed(self) -> np.ndarray:
        assert self._matcher is not None and self._info is not None
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        if self._matcher.is_error():
            raise RuntimeError(f"llguidance failed to compute the token mask: {self._matcher.get_error()}")
        allowed = np.unpackbits(bits, bitorder="little")[: self._info.n_vocab].astype(bool)
        allowed[self._info.eog] = self._matcher.is_accepting()
        allowed[self._info.nul_led] = False
        allowed.flags.writeable = False   # shared with clones in the same state
        return allowed

    def can_end(self) -> bool:
        """Whether the text so far is a whole sentence of the grammar (an EOG token may follow)."""
        return self._matcher is None or self._matcher.is_accepting()

    def apply(self, cur: Any) -> None:
        """Set to -inf, in place, the logits of the candidates the grammar does not allow."""
        if self._matcher is None:
            return
        ids = np.asarray(cur.ids)
        n_vocab = self.vocab.n_tokens
        if ids.size and (ids.min() < 0 or ids.max() >= n_vocab):
            bad = int(ids[(ids < 0) | (ids >= n_vocab)][0])
            raise ValueError(f"candidate token id {bad} is out of range for a vocab of {n_vocab} tokens")
        cur.logits[~self.allowed()[ids]] = -np.inf

    def accept(self, token: int) -> None:
        """Advance the grammar by `token`; ValueError (state unchanged) if the grammar rejects it.

        Any token the text allows is taken, also one a forcing grammar's mask left out for not being
        the canonical tokenization (llama.cpp's llguidance sampler consumes it too)."""
        if self._matcher is None:
            return
        token = int(token)
        if not 0 <= token < self.vocab.n_tokens:
            raise ValueError(f"token id {token} is out of range for a vocab of {self.vocab.n_tokens} tokens")
        if self.vocab.is_eog(token):
            if not self._matcher.is_accepting():
                raise self._rejected(token)
            return   # llama.cpp: an EOG token where the grammar can end leaves the grammar as it is
        if token in self._info.nul_led or self._matcher.validate_tokens([token]) != 1:
            raise self._rejected(token)
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"llguidance refused token {token} it had validated: {self._matcher.get_error()}")
        self._allowed = None

    def _rejected(self, token: int) -> ValueError:
        return ValueError(f"Unexpected empty grammar stack after accepting piece: "
                          f"the grammar does not allow token {token} {self._describe(token)} here")

    def _describe(self, token: int) -> str:
        if self.vocab.is_eog(token):
            return f"({self.vocab.text(token)!r}, end of generation: the grammar cannot end yet)"
        piece = self.vocab.token_to_piece(token, special=True).decode("utf-8", errors="replace")
        return f"({piece!r})"

    def reset(self) -> None:
        """Back to the grammar's start, as if no token had been accepted."""
        if self._initial is not None:
            self._matcher = self._initial.deep_copy()
            self._allowed = None

    def clone(self) -> Grammar:
        """An independent copy in the same state."""
        other = object.__new__(Grammar)
        other.vocab, other.grammar_str, other.root = self.vocab, self.grammar_str, self.root
        other._info, other._initial, other._allowed = self._info, self._initial, self._allowed
        other._matcher = self._matcher.deep_copy() if self._matcher is not None else None
        return other

    def __repr__(self) -> str:
        return f"Grammar({self.grammar_str[:40]!r}{'...' if len(self.grammar_str) > 40 else ''})"
