"""The UGM (t5 unigram) tokenizer against llama.cpp on small synthetic vocabs that reach what the one
UGM file of llama.cpp's tree (nomic-bert-moe, checked in test_tokenizer_oracle.py) does not: user-
defined tokens and the prefixes of them that pass the normalizer untouched, unused, control and
byte tokens, code points no token covers, and each combination of the charsmap (nomic's real one,
or none), add_space_prefix and remove_extra_whitespaces.
"""

from __future__ import annotations

import random
from pathlib import Path

import llama_cpp  # noqa: F401  (the oracle: a missing llama-cpp-python fails this module, never skips it)
import numpy as np
import pytest
from tokenizer_corpus import BYTE_CORPUS, CORPUS, random_strings
from tokenizer_fixtures import Oracle, VocabFilesUnavailable, vocab_path

from llamir.frontend.gguf_file import read_metadata
from llamir.frontend.vocab import Vocab
from llamir.frontend.vocab_special import ATTR_NORMAL
from llamir.frontend.vocab_ugm import CharsMap, UgmTokenizer

pytestmark = pytest.mark.llama_cpp

USER_DEFINED = ["<mask>", "<|user|>", "\u2581hello", "ab", "x\u2581y"]
CONTROL = ["<pad>", "</s>", "<unk>", "<s>"]
PREFIX_TEXTS = ["<ma", "<mas", "x<mask", "<mask>x<mask", "<|use", "<|user|>hi", "<|", "ab ab", "aab",
                "hello hello", " hello", "x y", "x  y", "<ma\u00e9", "<\xff"]
TEXTS = ([s.encode() for s in CORPUS + PREFIX_TEXTS + random_strings(60, seed=3)] + BYTE_CORPUS
         + [b"<ma\xe2\x82", b"a\x00b", b"\xe2\x96\x81\xe2\x96\x81 x"])


@pytest.fixture(scope="module")
def nomic_charsmap() -> bytes:
    try:
        meta = read_metadata(vocab_path("nomic-bert-moe"))
    except VocabFilesUnavailable as err:   # never skip: CI must fetch them
        pytest.fail(f"llama.cpp vocab files are unavailable: {err}")
    return meta["tokenizer.ggml.precompiled_charsmap"].tobytes()


def ugm_pieces(charsmap: CharsMap | None) -> list[str]:
    """Character 1- to 3-grams of the normalized corpus (spaces as U+2581), less a tenth of the
    single characters so that some code points have no token."""
    rng = random.Random(0)
    grams: set[str] = set()
    for text in CORPUS + random_strings(60, seed=3):
        raw = text.encode()
        norm = bytearray()
        pos = 0
        while pos < len(raw):   # enough of the charsmap to give the vocab pieces the normalizer produces
            n, rep = charsmap.longest_prefix(raw, pos) if charsmap else (0, b"")
            norm += rep if n else raw[pos:pos + 1]
            pos += n or 1
        word = norm.decode("utf-8", "ignore").replace(" ", "\u2581")
        grams.update(word[i:i + n] for n in (1, 2, 3) for i in range(len(word) - n + 1))
    grams.discard("\x00")
    pieces = sorted(grams - set(USER_DEFINED) - set(CONTROL))
    return [p for p in pieces if len(p) > 1 or rng.random() > 0.1]


def write_ugm(path: Path, charsmap: bytes | None, add_space_prefix: bool, remove_extra_ws: bool) -> Path:

    rng = random.Random(1)
    pieces = ugm_pieces(CharsMap(charsmap) if charsmap else None)
    tokens = [*CONTROL, *pieces, *USER_DEFINED, "[unused0]", "[unused1]", "<0x41>", "<0x0A>"]
    types = [3, 3, 2, 3] + [1] * len(pieces) + [4] * len(USER_DEFINED) + [5, 5, 6, 6]
    # user-defined tokens score 0 in the Viterbi pass whatever the file says
    scores = [0.0] * 4 + [-rng.uniform(1.0, 12.0) for _ in pieces] + [-30.0] * len(USER_DEFINED) + [-1.0] * 4
    return write_gguf(path, tokens, types, scores, charsmap, add_space_prefix, remove_extra_ws)


def write_gguf(path: Path, tokens: list[str], types: list[int], scores: list[float], charsmap: bytes | None,
               add_space_prefix: bool, remove_extra_ws: bool) -> Path:
    import gguf

    writer = gguf.GGUFWriter(path, "t5")
    writer.add_tokenizer_model("t5")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores)
    writer.add_add_space_prefix(add_space_prefix)
    writer.add_remove_extra_whitespaces(remove_extra_ws)
    if charsmap:
        writer.add_precompiled_charsmap(charsmap)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(2)
    writer.add_pad_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


VARIANTS = [(charsmap, prefix, merge) for charsmap in (True, False) for prefix in (True, False)
            for merge in (True, False)]


@pytest.mark.parametrize("with_charsmap, add_space_prefix, remove_extra_ws", VARIANTS,
                         ids=[f"charsmap={c}-prefix={p}-merge={m}" for c, p, m in VARIANTS])
def test_synthetic_ugm_vocab_is_llama_cpps(tmp_path: Path, nomic_charsmap: bytes, with_charsmap: bool,
                                           add_space_prefix: bool, remove_extra_ws: bool) -> None:
    path = write_ugm(tmp_path / "ugm.gguf", nomic_charsmap if with_charsmap else None, add_space_prefix,
                     remove_extra_ws)
    vocab, llama = Vocab.from_file(path), Oracle(path)
    assert vocab.type == "ugm" and vocab.n_tokens == llama.n_tokens
    assert (vocab.nl if vocab.nl is not None else -1) == llama.special_ids()["nl"]
    wrong = []
    for text in TEXTS:
        for add, parse in ((False, False), (True, True), (False, True)):
            want, got = llama.tokenize(text, add, parse), vocab.tokenize(text, add, parse)
            if got != want:
                wrong.append(f"tokenize {text!r} add={add} parse={parse}: want {want}, got {got}")
        ids = llama.tokenize(text, True, True)
        for remove, unparse in ((False, False), (True, True)):
            want_text = llama.detokenize(ids, remove, unparse)
            got_text = vocab.detokenize_bytes(ids, remove, unparse)
            if got_text != want_text:
                wrong.append(f"detokenize {ids} remove={remove} unparse={unparse}: want {want_text!r}, "
                             f"got {got_text!r}")
    assert not wrong, f"{len(wrong)} differ:\n" + "\n".join(wrong[:6])
    pieces = [(t, s) for t in range(vocab.n_tokens) for s in (False, True)
              if vocab.token_to_piece(t, 1, s) != llama.token_to_piece(t, 1, s)]
    assert not pieces, f"pieces differ (id, special): {pieces[:5]}"


def test_unknown_code_points_merge_into_one_unknown_token(tmp_path: Path, nomic_charsmap: bytes) -> None:
    path = write_ugm(tmp_path / "ugm.gguf", nomic_charsmap, True, True)
    vocab, llama = Vocab.from_file(path), Oracle(path)
    text = "\U0001f680\U0001f6f8\u2603 a \U0001f680"            # no token covers these code points
    want = llama.tokenize(text.encode(), False, False)
    assert vocab.tokenize(text, add_special=False) == want
    assert want.count(2) == 2                                   # two runs of unknown code points


@pytest.mark.parametrize("unused_score, want", [(10.25, [2, 3]), (9.75, [4])])
def test_an_unknown_code_point_costs_the_lowest_normal_score_minus_10(tmp_path: Path, unused_score: float,
                                                                       want: list[int]) -> None:
    """"☃a": the token "☃a" (the lowest normal score, -7) against UNK (-7 - 10) plus the unused
    token "a", whose score llama.cpp takes as it is: UNK wins by 0.25 or loses by 0.25."""
    tokens = ["<pad>", "</s>", "<unk>", "a", "\u2603a", "b"]
    path = write_gguf(tmp_path / "unk.gguf", tokens, [3, 3, 2, 5, 1, 1], [0.0, 0.0, 0.0, unused_score, -7.0, -2.0],
                      None, False, False)
    vocab, llama = Vocab.from_file(path), Oracle(path)
    assert llama.tokenize("\u2603a".encode(), False, False) == want
    assert vocab.tokenize("\u2603a", add_special=False) == want


@pytest.mark.parametrize("blob, message", [
    (bytes(3), "precompiled_charsmap too small for xcda_blob_size header"),
    ((100).to_bytes(4, "little") + bytes(8), "Index out of array bounds in precompiled charsmap"),
])
def test_a_charsmap_llama_cpp_refuses_is_a_clear_error(tmp_path: Path, blob: bytes, message: str) -> None:
    path = write_gguf(tmp_path / "bad.gguf", ["<pad>", "</s>", "<unk>", "a"], [3, 3, 2, 1], [0.0] * 4, blob,
                      True, True)
    with pytest.raises(ValueError, match="Failed to load model"):
        Oracle(path)
    with pytest.raises(ValueError, match=message):
        Vocab.from_file(path)


def test_a_charsmap_of_the_wrong_type_is_a_clear_error() -> None:
    meta = {"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["<pad>", "</s>", "<unk>", "a"]}
    with pytest.raises(ValueError, match="too small for xcda_blob_size"):
        Vocab.from_metadata(meta | {"tokenizer.ggml.precompiled_charsmap": np.zeros(0, np.uint8)})
    with pytest.raises(ValueError, match="invalid gguf type for tokenizer.ggml.precompiled_charsmap"):
        Vocab.from_metadata(meta | {"tokenizer.ggml.precompiled_charsmap": np.zeros(8, np.float32)})


@pytest.mark.parametrize("suffix, prefix, merge, want", [
    (False, True, False, "\u2581a\u2581\u2581b\u2581"),
    (True, True, False, "a\u2581\u2581b\u2581\u2581"),      # the dummy space goes after the text
    (True, False, False, "a\u2581\u2581b\u2581"),
    (True, True, True, "\u2581a\u2581b\u2581"),             # merging puts a space before every word
    (False, False, True, "\u2581a\u2581b"),
])
def test_whitespace_options_as_llama_cpps_normalize(suffix: bool, prefix: bool, merge: bool, want: str) -> None:
    """llm_tokenizer_ugm_session::normalize by hand on "a  b ", with no charsmap."""
    tok = UgmTokenizer([b"a", b"b"], [-1.0, -1.0], [ATTR_NORMAL] * 2, None, 0, escape_whitespaces=True,
                       add_space_prefix=prefix, remove_extra_whitespaces=merge, treat_whitespace_as_suffix=suffix)
    assert tok.normalize(b"a  b ") == want.encode()
