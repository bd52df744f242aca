"""Property tests: vocab metadata with keys dropped, retyped or with bad items either builds a vocab
that tokenizes and detokenizes any text, or is refused with VocabError naming the key; never
another exception (TypeError, AttributeError, IndexError, ...). Plain Python metadata is checked as
strictly as a file's: a token list with a None, a number or a list among its strings is refused."""

from __future__ import annotations

import logging

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llamir.frontend.gguf_meta import GGUFError
from llamir.frontend.unicode import BYTE_TO_UNICODE
from llamir.frontend.vocab import Vocab, VocabError

SPM_TOKENS = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "▁a", "▁b", "ab", "▁ab", "a", "b", "▁"]
BPE_TOKENS = [*BYTE_TO_UNICODE, "ab", "abc", "Ġa", "<|endoftext|>"]


def _spm() -> dict:
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": list(SPM_TOKENS),
            "tokenizer.ggml.scores": [float(-i) for i in range(len(SPM_TOKENS))],
            "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * (len(SPM_TOKENS) - 259),
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0}


def _bpe() -> dict:
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "llama-bpe",
            "tokenizer.ggml.tokens": list(BPE_TOKENS), "tokenizer.ggml.token_type": [1] * (len(BPE_TOKENS) - 1) + [3],
            "tokenizer.ggml.merges": ["a b", "ab c", "Ġ a"],
            "tokenizer.ggml.bos_token_id": len(BPE_TOKENS) - 1, "tokenizer.ggml.eos_token_id": len(BPE_TOKENS) - 1}


KEYS = sorted(set(_spm()) | set(_bpe()) | {"tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token",
                                           "tokenizer.ggml.eot_token_id", "tokenizer.ggml.precompiled_charsmap"})
JUNK = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(), st.text(max_size=6),
                 st.binary(max_size=4), st.lists(st.one_of(st.none(), st.integers(-3, 300), st.text(max_size=3)),
                                                 max_size=3))
ITEMS = st.one_of(JUNK, st.sampled_from(["", "<0xZZ>", "<0x41>", "a", " ", "\x00", "Ġ", "ĠĠ", "<s>", "x y", "a b c"]))


@st.composite
def mutated_metadata(draw) -> dict:
    meta = draw(st.sampled_from([_spm, _bpe]))()
    for _ in range(draw(st.integers(1, 4))):
        key = draw(st.sampled_from(KEYS))
        how = draw(st.sampled_from(["drop", "replace", "item", "truncate"]))
        value = meta.get(key)
        if how == "drop":
            meta.pop(key, None)
        elif how == "replace" or not isinstance(value, list) or not value:
            meta[key] = draw(JUNK)
        elif how == "item":
            value[draw(st.integers(0, len(value) - 1))] = draw(ITEMS)
        else:
            del value[draw(st.integers(0, len(value) - 1)):]
    return meta


FUZZ = settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


@pytest.fixture(autouse=True)
def _quiet():
    logging.getLogger("llamir").setLevel(logging.ERROR)   # bad special ids are logged, as llama.cpp does
    yield
    logging.getLogger("llamir").setLevel(logging.NOTSET)


@FUZZ
@given(meta=mutated_metadata(), text=st.text(max_size=24), ids=st.lists(st.integers(-2, 400), max_size=6))
def test_mutated_vocab_builds_or_is_refused(meta, text, ids):
    try:
        vocab = Vocab.from_metadata(meta)
    except (VocabError, GGUFError):
        return
    for parse_special in (False, True):
        try:
            vocab.detokenize(vocab.tokenize(text, add_special=True, parse_special=parse_special))
        except VocabError:
            pass
    for token in ids:
        try:
            vocab.token_to_piece(token, special=True)
        except VocabError as err:
            assert str(token) in str(err) or "byte" in str(err)


@pytest.mark.parametrize("bad", [None, 7, 1.5, ["a"], b"a"])
def test_a_token_list_with_a_foreign_item_is_refused(bad):
    meta = _spm()
    meta["tokenizer.ggml.tokens"][5] = bad
    with pytest.raises(VocabError, match="tokenizer.ggml.tokens"):
        Vocab.from_metadata(meta)


def test_scores_may_mix_ints_and_floats():
    meta = _spm()
    meta["tokenizer.ggml.scores"][3] = -3
    assert Vocab.from_metadata(meta).score(3) == -3.0


def test_token_ids_out_of_range_are_vocab_errors():
    vocab = Vocab.from_metadata(_spm())
    for token in (-1, len(SPM_TOKENS), 2**40):
        with pytest.raises(VocabError, match=f"token id {token} is out of range"):
            vocab.token_to_piece(token)
