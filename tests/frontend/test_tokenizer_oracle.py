"""Vocab against llama.cpp itself (llama-cpp-python 0.3.36, vocab_only): special ids, EOG set and
token attributes, pieces, and tokenize/detokenize over a corpus of tricky strings, for each vocab
of llama.cpp's tree and for the default SmolLM2 model; and every pre-tokenizer on a synthetic
byte-level vocab whose merges reveal where the text was split.
"""

from __future__ import annotations

import random
from pathlib import Path

import llama_cpp  # noqa: F401  (the oracle: a missing llama-cpp-python fails this module, never skips it)
import pytest
from tokenizer_corpus import BYTE_CORPUS, CORPUS, random_strings
from tokenizer_fixtures import (
    ALL_VOCABS,
    LARGE,
    Oracle,
    load_vocab,
    oracle,
    smollm2_path,
    write_synthetic_bpe,
)

from llamir.frontend.vocab import Vocab
from llamir.frontend.vocab_pre import PRE_TOKENIZERS
from llamir.frontend.vocab_special import ATTR_NORMAL

pytestmark = pytest.mark.llama_cpp

NAMES = [pytest.param(n, marks=pytest.mark.slow) if n in LARGE else n for n in [*ALL_VOCABS, "smollm2"]]
TEXTS = [s.encode("utf-8") for s in CORPUS + random_strings(80)] + BYTE_CORPUS
FLAGS = [(add, parse) for add in (False, True) for parse in (False, True)]


@pytest.fixture
def pair(vocab_dir: Path, request: pytest.FixtureRequest) -> tuple[Vocab, Oracle]:
    name = request.param
    if name == "smollm2":
        path = smollm2_path()
    else:
        path = vocab_dir / f"ggml-vocab-{name}.gguf"
    return load_vocab(path), oracle(path)


def as_ids(vocab: Vocab) -> dict[str, int | bool]:
    names = ["bos", "eos", "eot", "sep", "nl", "pad", "mask",
             "fim_pre", "fim_suf", "fim_mid", "fim_pad", "fim_rep", "fim_sep"]
    ids: dict[str, int | bool] = {n: -1 if getattr(vocab, n) is None else getattr(vocab, n) for n in names}
    ids.update(add_bos=vocab.add_bos, add_eos=vocab.add_eos, add_sep=vocab.add_sep)
    return ids


@pytest.mark.parametrize("pair", NAMES, indirect=True)
def test_special_ids_eog_and_attributes(pair: tuple[Vocab, Oracle]) -> None:
    vocab, llama = pair
    assert vocab.n_tokens == llama.n_tokens
    assert as_ids(vocab) == llama.special_ids()
    assert set(vocab.eog_ids) == llama.eog_ids()
    # every token that is not plain, and a sample of the rest (a ctypes call per token is slow)
    rng = random.Random(0)
    ids = [i for i in range(vocab.n_tokens) if vocab.attr(i) != ATTR_NORMAL]
    ids = sorted({*ids, *rng.sample(range(vocab.n_tokens), min(20_000, vocab.n_tokens))})
    wrong = [(i, vocab.text(i), vocab.attr(i), a) for i in ids if vocab.attr(i) != (a := llama.attr(i))]
    assert not wrong, f"{len(wrong)} attributes differ, first (id, text, ours, llama.cpp): {wrong[:5]}"


@pytest.mark.parametrize("pair", NAMES, indirect=True)
def test_token_to_piece(pair: tuple[Vocab, Oracle]) -> None:
    vocab, llama = pair
    rng = random.Random(0)
    sample = rng.sample(range(vocab.n_tokens), min(3000, vocab.n_tokens))
    ids = sorted({*range(min(400, vocab.n_tokens)), *sample, *vocab.eog_ids})
    wrong = [(t, special, lstrip) for t in ids for special in (False, True) for lstrip in (0, 1)
             if vocab.token_to_piece(t, lstrip, special) != llama.token_to_piece(t, lstrip, special)]
    assert not wrong, f"{len(wrong)} pieces differ, first (id, special, lstrip): {wrong[:5]}"


@pytest.mark.parametrize("pair", NAMES, indirect=True)
def test_tokenize(pair: tuple[Vocab, Oracle]) -> None:
    vocab, llama = pair
    wrong = []
    for text in TEXTS:
        for add, parse in FLAGS:
            want = llama.tokenize(text, add, parse)
            got = vocab.tokenize(text, add_special=add, parse_special=parse)
            if got != want:
                wrong.append(f"{text!r} add_special={add} parse_special={parse}: want {want}, got {got}")
    assert not wrong, f"{len(wrong)} differ:\n" + "\n".join(wrong[:5])


@pytest.mark.parametrize("pair", NAMES, indirect=True)
def test_tokenize_long_text(pair: tuple[Vocab, Oracle]) -> None:
    vocab, llama = pair
    text = "\n".join(CORPUS).encode() * 2
    assert vocab.tokenize(text, parse_special=True) == llama.tokenize(text, True, True)


@pytest.mark.parametrize("pair", NAMES, indirect=True)
def test_detokenize(pair: tuple[Vocab, Oracle]) -> None:
    vocab, llama = pair
    wrong = []
    for text in TEXTS:
        ids = llama.tokenize(text, True, True)
        for remove_special, unparse_special in FLAGS:
            want = llama.detokenize(ids, remove_special, unparse_special)
            got = vocab.detokenize_bytes(ids, remove_special, unparse_special)
            if got != want:
                flags = f"remove_special={remove_special} unparse_special={unparse_special}"
                wrong.append(f"{ids} {flags}: want {want!r}, got {got!r}")
    assert not wrong, f"{len(wrong)} differ:\n" + "\n".join(wrong[:5])
    sample = llama.tokenize(b"Hello world", True, True)
    assert vocab.detokenize(sample) == llama.detokenize(sample, False, False).decode()


PRE_KINDS = {}   # one tokenizer.ggml.pre name per distinct pre-tokenizer
for _name, _spec in PRE_TOKENIZERS.items():
    PRE_KINDS.setdefault(_spec.kind, _name)
SYNTH_TEXTS = [s.encode("utf-8") for s in CORPUS] + BYTE_CORPUS


@pytest.fixture(scope="module")
def synthetic_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("synthetic_vocabs")


@pytest.mark.parametrize("pre", sorted(PRE_KINDS.values()))
def test_pre_tokenizer_splits_like_llama_cpp(synthetic_dir: Path, pre: str) -> None:
    path = write_synthetic_bpe(synthetic_dir / f"{pre}.gguf", pre, SYNTH_TEXTS)
    vocab, llama = Vocab.from_file(path), Oracle(path)
    wrong = [text for text in SYNTH_TEXTS for flags in ((False, False), (True, True))
             if vocab.tokenize(text, *flags) != llama.tokenize(text, *flags)]
    assert not wrong, f"{len(wrong)} texts split differently, first: {wrong[:3]}"
