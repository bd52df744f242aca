"""llamir.sampling.Grammar against llama.cpp's own grammar sampler (llama_sampler_init_grammar,
through ctypes) on SmolLM2's vocab: the same allowed candidates after every accepted token; and
SmolLM2's greedy output under a GBNF grammar and a JSON schema is valid text of them."""

from __future__ import annotations

import ctypes
import json
import re
from dataclasses import dataclass

import numpy as np
import pytest

import llamir
from llamir.frontend.default_model import default_model_path
from llamir.sampling.grammar import Grammar, gbnf_to_lark, json_schema_to_grammar
from llamir.testing.llama_cpp import _lib

JSON_GBNF = r'''root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws

object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws

array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws

string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) # escapes
  )* "\"" ws

number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws

# Optional space: by convention, applied in this grammar after literal chars when allowed
ws ::= | " " | "\n" [ \t]{0,20}
'''   # llama.cpp's grammars/json.gbnf

LIST_GBNF = r'''root ::= item+

# Excludes various line break characters
item ::= "- " [^\r\n\x0b\x0c\x85\u2028\u2029]+ "\n"
'''   # llama.cpp's grammars/list.gbnf

CHESS_GBNF = r'''root    ::= "1. " move " " move "\n" ([1-9] [0-9]? ". " move " " move "\n")+
move    ::= (pawn | nonpawn | castle) [+#]?
nonpawn ::= [NBKQR] [a-h]? [1-8]? "x"? [a-h] [1-8]
pawn    ::= ([a-h] "x")? [a-h] [1-8] ("=" [NBKQR])?
castle  ::= "O-O" "-O"?
'''   # llama.cpp's grammars/chess.gbnf, without its comments

# (grammar, root, a text of it, fed one token at a time as SmolLM2 tokenizes it)
AGREEING = {
    "choice": ('root ::= ("yes" | "no" | "maybe") "."', "root", "maybe."),
    "digits": ('root ::= [0-9]{1,3} ("," [0-9]{1,3})*', "root", "12,345,6"),
    "json": (JSON_GBNF, "root", '{"name": "Ann", "tags": ["a", "b\\n"],\n  "n": {"x": -1.5e3, "ok": true}}'),
    "classes": ('root ::= [A-Z] [a-z]+ (" " [A-Za-z]+)* [.!?]', "root", "Hello big World!"),
    "class_escapes": ('root ::= [-+*/^.\\]\\[a-c]+ ";"', "root", "-^]c+;"),
    "negated_class": ('root ::= "\\"" [^"\\\\\\n]* "\\""', "root", '"hé said"'),
    "utf8": ('root ::= ("ü" | "é" | [α-ω] | [一-鿿])+ "🙂"?', "root", "üαβ中文é🙂"),
    "utf8_escapes": ('root ::= ("\\u00e9" | [\\u4e00-\\u9fff] | "\\U0001F642" | "\\xe0")+', "root", "é中🙂à文"),
    "list": ('root ::= ("- " [^\\r\\n]+ "\\n")+', "root", "- milk\n- two eggs \u2014 brown\n"),
    "chess": (CHESS_GBNF, "root", "1. e4 e5\n2. Nf3 Nc6\n3. O-O exd4+\n"),
    "any_char": ('root ::= "<" .{0,4} ">"', "root", "<a\nb>"),
    "root_param": ('root ::= "x"\nexpr ::= "(" expr ")" | "a"', "expr", "((a))"),
    "rule_named_start": ('root ::= start "!"\nstart ::= "a" | "b" start', "root", "bba!"),
}


@dataclass
class Candidates:
    """A stand-in for llamir.sampling's TokenDataArray: one candidate per row."""

    ids: np.ndarray                  # int32 token ids
    logits: np.ndarray               # float32
    p: np.ndarray | None = None      # float32, zeros when not given
    selected: int = -1
    sorted: bool = False

    def __post_init__(self):
        if self.p is None:
            self.p = np.zeros(len(self.ids), dtype=np.float32)

    @classmethod
    def of_logits(cls, logits: np.ndarray) -> Candidates:
        return cls(np.arange(len(logits), dtype=np.int32), np.array(logits, dtype=np.float32))


class NativeGrammar:
    """llama.cpp's own GBNF sampler (llama-grammar.cpp), over its own copy of the vocab."""

    _DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])   # llama_token_data

    def __init__(self, lib, vocab_ptr, n_vocab: int, text: str, root: str = "root"):
        self._lib, self._n = lib, n_vocab
        self._smpl = lib.llama_sampler_init_grammar(vocab_ptr, text.encode(), root.encode())
        assert self._smpl, f"llama.cpp refused the grammar {text!r}"

    def allowed(self) -> np.ndarray:
        data = np.zeros(self._n, dtype=self._DATA)
        data["id"] = np.arange(self._n)
        lib = self._lib
        arr = lib.llama_token_data_array(data=data.ctypes.data_as(ctypes.POINTER(lib.llama_token_data)),
                                         size=self._n, selected=-1, sorted=False)
        lib.llama_sampler_apply(self._smpl, ctypes.byref(arr))
        return np.isfinite(data["logit"])

    def accept(self, token: int) -> None:
        self._lib.llama_sampler_accept(self._smpl, token)

    def close(self) -> None:
        self._lib.llama_sampler_free(self._smpl)


@pytest.fixture(scope="module")
def model():
    return llamir.load_model(default_model_path(progress=False))


@pytest.fixture(scope="module")
def vocab(model):
    return model.vocab


@pytest.fixture(scope="module")
def native(vocab):
    """make(text, root) -> NativeGrammar on llama.cpp's vocab of SmolLM2."""
    lib = _lib()
    params = lib.llama_model_default_params()
    params.vocab_only = True
    llama_model = lib.llama_model_load_from_file(str(default_model_path(progress=False)).encode(), params)
    assert llama_model, "llama.cpp could not load SmolLM2's vocab"
    made: list[NativeGrammar] = []

    def make(text: str, root: str = "root") -> NativeGrammar:
        made.append(NativeGrammar(lib, lib.llama_model_get_vocab(llama_model), vocab.n_tokens, text, root))
        return made[-1]

    yield make
    for g in made:
        g.close()
    lib.llama_model_free(llama_model)


def _allowed_after_apply(grammar: Grammar, n_vocab: int) -> np.ndarray:
    cur = Candidates.of_logits(np.zeros(n_vocab, dtype=np.float32))
    grammar.apply(cur)
    return np.isfinite(cur.logits)


def _text_control(vocab) -> np.ndarray:
    """Control tokens that do not end generation: llama.cpp's native grammar matches their text."""
    return np.array([vocab.is_control(t) and not vocab.is_eog(t) for t in range(vocab.n_tokens)])


def _pieces(vocab, ids) -> list[bytes]:
    return [vocab.token_to_piece(int(t), special=True) for t in ids[:8]]


@pytest.mark.llama_cpp
@pytest.mark.parametrize("case", sorted(AGREEING))
def test_allowed_candidates_match_llama_cpp_at_every_step(case, vocab, native):
    text, root, sentence = AGREEING[case]
    ours, theirs = Grammar(vocab, text, root), native(text, root)
    control = _text_control(vocab)
    eog = sorted(vocab.eog_ids)
    tokens = vocab.tokenize(sentence, add_special=False)
    for step, token in enumerate([*tokens, None]):
        got, want = _allowed_after_apply(ours, vocab.n_tokens), theirs.allowed()
        assert not got[control].any(), "control tokens never match text"
        diff = (got != want) & ~control
        assert not diff.any(), (f"{case} after {vocab.detokenize(tokens[:step])!r}: only ours "
                                f"{_pieces(vocab, np.nonzero(diff & got)[0])}, only llama.cpp "
                                f"{_pieces(vocab, np.nonzero(diff & want)[0])}")
        if token is None:
            assert got[eog].all(), "the whole sentence may end"
        else:
            ours.accept(token)
            theirs.accept(token)


@pytest.mark.llama_cpp
def test_whole_vocab_json_walk_matches_llama_cpp(vocab, native):
    """Beyond one tokenization: 40 steps, each picking a random token both allow."""
    ours, theirs = Grammar(vocab, JSON_GBNF), native(JSON_GBNF)
    rng = np.random.default_rng(15)
    control = _text_control(vocab)
    for _ in range(40):
        got, want = _allowed_after_apply(ours, vocab.n_tokens), theirs.allowed()
        assert np.array_equal(got & ~control, want & ~control)
        choices = np.nonzero(got & ~np.isin(np.arange(vocab.n_tokens), list(vocab.eog_ids)))[0]
        token = int(rng.choice(choices))
        ours.accept(token)
        theirs.accept(token)


def test_apply_masks_only_the_given_candidates_in_place(vocab):
    grammar = Grammar(vocab, 'root ::= "yes" | "no"')
    yes, no, cat = (vocab.tokenize(w, add_special=False)[0] for w in ("yes", "no", "cat"))
    cur = Candidates(np.array([cat, yes, no], dtype=np.int32), np.array([3.0, 2.0, 1.0], dtype=np.float32))
    logits = cur.logits
    grammar.apply(cur)
    assert cur.logits is logits
    assert cur.logits.tolist() == [-np.inf, 2.0, 1.0]


def test_llguidance_lark_grammar_forces_canonical_tokens(vocab):
    """A `%llguidance` grammar goes to llguidance as written, as in llama.cpp's LLAMA_LLGUIDANCE
    build: text the grammar forces may only come as its canonical tokens, one by one."""
    grammar = Grammar(vocab, '%llguidance {}\nstart: "((a))" " " ("yes" | "no")')
    for token in vocab.tokenize("((a))", add_special=False):      # "((", "a", "))"
        assert np.nonzero(_allowed_after_apply(grammar, vocab.n_tokens))[0].tolist() == [token]
        grammar.accept(token)
    allowed = np.nonzero(_allowed_after_apply(grammar, vocab.n_tokens))[0]   # " " may join "yes"
    assert sorted(vocab.token_to_piece(int(t)) for t in allowed) == [b" ", b" n", b" no", b" y", b" ye", b" yes"]
    other = Grammar(vocab, '%llguidance {}\nstart: "((a))"')
    paren = vocab.byte_to_token(ord("("))
    assert not other.allowed()[paren]
    other.accept(paren)             # not canonical, but text of the grammar: accept takes it
    other.accept(paren)
    assert other.allowed()[vocab.byte_to_token(ord("a"))]


def test_empty_grammar_constrains_nothing(vocab):
    grammar = Grammar(vocab, "")
    cur = Candidates.of_logits(np.linspace(-1, 1, vocab.n_tokens))
    grammar.apply(cur)
    assert np.isfinite(cur.logits).all()
    grammar.accept(vocab.eos)
    assert grammar.name == "grammar"


def test_reset_and_clone(vocab):
    grammar = Grammar(vocab, 'root ::= "ab" | "ac"')
    a, b, c = (vocab.byte_to_token(ord(ch)) for ch in "abc")
    start = _allowed_after_apply(grammar, vocab.n_tokens).copy()
    grammar.accept(a)
    twin = grammar.clone()
    grammar.accept(b)
    assert _allowed_after_apply(twin, vocab.n_tokens)[[b, c]].all()   # the clone did not move
    twin.accept(c)
    assert twin.can_end() and grammar.can_end()
    grammar.reset()
    assert np.array_equal(_allowed_after_apply(grammar, vocab.n_tokens), start)
    assert not grammar.can_end()


def test_eog_accepted_only_where_the_grammar_can_end(vocab):
    grammar = Grammar(vocab, 'root ::= "a" "b"?')
    with pytest.raises(ValueError, match=r"token 2 .*end of generation"):
        grammar.accept(vocab.eos)
    grammar.accept(vocab.byte_to_token(ord("a")))
    grammar.accept(vocab.eos)                         # leaves the grammar where it was
    grammar.accept(vocab.byte_to_token(ord("b")))


def test_rejected_token_names_it_and_keeps_the_state(vocab):
    grammar = Grammar(vocab, 'root ::= "yes" | "no"')
    cat = vocab.tokenize("cat", add_special=False)[0]
    with pytest.raises(ValueError, match=rf"Unexpected empty grammar stack.*token {cat} \('cat'\)"):
        grammar.accept(cat)
    grammar.accept(vocab.tokenize("yes", add_special=False)[0])
    assert grammar.can_end()
    with pytest.raises(ValueError, match=r"out of range"):
        grammar.accept(vocab.n_tokens)
    im_start = vocab.token_id("<|im_start|>")
    with pytest.raises(ValueError, match=r"<\|im_start\|>"):
        Grammar(vocab, "root ::= [^\\n]*").accept(im_start)


@pytest.mark.parametrize("text, message", [
    ('root ::= "abc', "failed to parse grammar: Unexpected end of input"),
    ("root ::= [a-z", "failed to parse grammar: Unexpected end of input"),
    ('root ::= "a" \\q', "failed to parse grammar"),
    ('root ::= expr', "failed to parse grammar: Rule 'expr' not found"),
    ('expr ::= "a"', "grammar does not contain a 'root' symbol"),
    ('root ::= <|im_end|>', "failed to parse grammar: Expected name at line 1"),
    ('root ::= "\\u12"', "Invalid \\\\u escape sequence"),
    ("root ::= [z-a]", "invalid grammar: .*z-a"),
    ('%llguidance {}\nstart: foo', 'invalid grammar: .*unknown name: "foo"'),
])
def test_malformed_grammar_raises_the_library_message(vocab, text, message):
    with pytest.raises(ValueError, match=message):
        Grammar(vocab, text)


def test_root_must_exist_and_lark_has_its_own_start(vocab):
    with pytest.raises(ValueError, match="grammar does not contain a 'expr' symbol"):
        Grammar(vocab, 'root ::= "a"', root="expr")
    with pytest.raises(ValueError, match="always starts at its 'start' rule"):
        Grammar(vocab, '%llguidance {}\nstart: "a"', root="expr")


@pytest.mark.parametrize("schema, message", [
    ('{"type": "object",', "not valid JSON"),
    ("[1, 2]", "a JSON schema is an object or a boolean, got list"),
    ({"type": "frobnicate"}, "Invalid type: frobnicate"),
    ({"$ref": "#/$defs/missing"}, "does not exist"),
    ({"type": "string", "minLength": "x"}, "minLength"),
])
def test_bad_json_schema_raises(vocab, schema, message):
    with pytest.raises(ValueError, match=message):
        Grammar.from_json_schema(vocab, schema)


def test_json_schema_text_is_the_llguidance_build_of_common():
    """common/json-schema-to-grammar.cpp with LLAMA_LLGUIDANCE: `%llguidance {}\\nstart: %json <schema>`."""
    assert json_schema_to_grammar('{"type": "integer"}') == '%llguidance {}\nstart: %json {"type": "integer"}'


# ---------------------------------------------------------------- documented differences

@pytest.mark.llama_cpp
def test_known_difference_lexemes_are_matched_longest_first(vocab, native):
    """GBNF has no lexer; llguidance turns `num` into a lexeme that cannot stop before a "5" it
    could also take. llama.cpp may end "125" as num = "12"; llguidance cannot."""
    text = 'root ::= num "5"\nnum ::= [0-9]+'
    assert "NUM: /[0-9]/+" in gbnf_to_lark(text)
    ours, theirs = Grammar(vocab, text), native(text)
    for ch in "125":
        ours.accept(vocab.byte_to_token(ord(ch)))
        theirs.accept(vocab.byte_to_token(ord(ch)))
    assert theirs.allowed()[vocab.eos] and not ours.can_end()


@pytest.mark.llama_cpp
def test_known_difference_partial_utf8_in_a_negated_class(vocab, native):
    """llama.cpp refuses a token ending inside a UTF-8 character when that character could be one
    a negated class excludes, though it could also be one it allows; llguidance allows it. In
    llama.cpp's list.gbnf, " \\xe2\\x80" may become U+2028 (excluded) or U+2014 (not)."""
    ours, theirs = Grammar(vocab, LIST_GBNF), native(LIST_GBNF)
    sentence = "- milk\n- two eggs \u2014 brown\n"
    partial = np.array([_ends_inside_a_character(vocab.token_to_piece(t)) for t in range(vocab.n_tokens)])
    control = _text_control(vocab)
    seen = 0
    for token in vocab.tokenize(sentence, add_special=False):
        got, want = _allowed_after_apply(ours, vocab.n_tokens), theirs.allowed()
        diff = (got != want) & ~control
        assert not (diff & ~partial).any() and not (diff & want).any()   # only partial ones, only ours
        seen += int(diff.sum())
        ours.accept(token)
        theirs.accept(token)
    assert seen > 0


def _ends_inside_a_character(piece: bytes) -> bool:
    try:
        piece.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.reason == "unexpected end of data"
    return False


@pytest.mark.llama_cpp
def test_known_difference_control_tokens_match_no_text(vocab, native):
    text = "root ::= [^\\n]*"
    im_start = vocab.token_id("<|im_start|>")
    assert native(text).allowed()[im_start]
    assert not _allowed_after_apply(Grammar(vocab, text), vocab.n_tokens)[im_start]


# ---------------------------------------------------------------- SmolLM2 under a grammar

def _constrained_greedy(model, grammar: Grammar, prompt: str, n_max: int) -> tuple[str, bool]:
    """Argmax over what the grammar allows, each pick accepted; (text, whether it stopped on EOG)."""
    vocab = model.vocab
    ctx = llamir.Context(model, n_ctx=512, flash_attn="off", backend="llvm")
    tokens = vocab.tokenize(prompt, add_special=True, parse_special=True)
    assert ctx.decode(llamir.Batch.from_tokens(tokens, logits="last")) == 0
    out: list[int] = []
    for _ in range(n_max):
        cur = Candidates.of_logits(ctx.get_logits_ith(-1))
        grammar.apply(cur)
        token = int(cur.ids[np.argmax(cur.logits)])
        grammar.accept(token)
        if vocab.is_eog(token):
            return vocab.detokenize(out), True
        out.append(token)
        assert ctx.decode(llamir.Batch.from_tokens([token], pos0=len(tokens) + len(out) - 1)) == 0
    return vocab.detokenize(out), False


def _chat(user: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


CAT_GBNF = r'''root   ::= "{" ws "\"name\":" ws name "," ws "\"age\":" ws age ws "}"
name   ::= "\"" [A-Z] [a-z]{1,12} "\""
age    ::= [1-9] [0-9]?
ws     ::= " "?
'''
CAT_RE = re.compile(r'\{ ?"name": ?"[A-Z][a-z]{1,12}", ?"age": ?[1-9][0-9]? ?\}')


def test_smollm2_greedy_output_follows_a_gbnf_grammar(model):
    text, ended = _constrained_greedy(model, Grammar(model.vocab, CAT_GBNF),
                                      _chat("Describe a cat as JSON with its name and age."), 48)
    assert ended, f"no end of generation after {text!r}"
    assert CAT_RE.fullmatch(text), text
    assert set(json.loads(text)) == {"name", "age"}


PET_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "colors": {"type": "array", "items": {"enum": ["black", "white", "orange"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "colors"],
    "additionalProperties": False,
}


def _check_pet(value) -> None:
    """The checks PET_SCHEMA asks for, written out."""
    assert isinstance(value, dict) and set(value) == {"name", "age", "colors"}, value
    assert isinstance(value["name"], str) and len(value["name"]) <= 16
    assert isinstance(value["age"], int) and not isinstance(value["age"], bool) and 0 <= value["age"] <= 30
    assert isinstance(value["colors"], list) and 1 <= len(value["colors"]) <= 3
    assert set(value["colors"]) <= {"black", "white", "orange"}


def test_smollm2_greedy_output_follows_a_json_schema(model):
    text, ended = _constrained_greedy(model, Grammar.from_json_schema(model.vocab, json.dumps(PET_SCHEMA)),
                                      _chat("Describe a cat as JSON: name, age and colors."), 96)
    assert ended, f"no end of generation after {text!r}"
    _check_pet(json.loads(text))
