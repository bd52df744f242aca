"""Vocab against llama.cpp's own tokenizer test vectors (models/ggml-vocab-*.gguf.inp/.out, as
tests/test-tokenizer-0.cpp reads them), hand-worked cases on a tiny SPM vocab, and bad input.
The comparisons with a live llama.cpp are in test_tokenizer_oracle.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tokenizer_fixtures import (
    ALL_VOCABS,
    WITH_VECTORS,
    load_vocab,
    read_vectors,
)

from llamir.frontend.gguf_file import GGUFFile
from llamir.frontend.vocab import Vocab, VocabError
from llamir.frontend.vocab_gguf import read_metadata
from llamir.frontend.vocab_hash_order import hash_bytes


@pytest.mark.parametrize("name", WITH_VECTORS)
def test_llama_cpp_test_vectors(vocab_dir: Path, name: str) -> None:
    path = vocab_dir / f"ggml-vocab-{name}.gguf"
    vocab, vectors = load_vocab(path), read_vectors(path)
    assert len(vectors) >= 40, f"{path.name}.inp/.out hold only {len(vectors)} cases"
    wrong = [(text, want, got) for text, want in vectors
             if (got := vocab.tokenize(text, add_special=False, parse_special=False)) != want]
    assert not wrong, "\n".join(f"{t!r}: want {w}, got {g}" for t, w, g in wrong[:5])


def test_the_vocab_list_is_llama_cpps(vocab_dir: Path) -> None:
    """The tests cover every vocab file of llama.cpp's tree, and every one with vectors."""
    files = sorted(p.name[len("ggml-vocab-"):-len(".gguf")] for p in vocab_dir.glob("ggml-vocab-*.gguf"))
    assert files == ALL_VOCABS and len(files) == 19
    with_vectors = sorted(p.name[len("ggml-vocab-"):-len(".gguf.inp")] for p in vocab_dir.glob("*.gguf.inp"))
    assert with_vectors == sorted(WITH_VECTORS)


def test_fast_metadata_reader_matches_gguf_file(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "kinds.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_string("s", "héllo")
    writer.add_array("tokens", ["<s>", "▁a", "", "\n"])
    array = gguf.GGUFValueType.ARRAY
    writer.add_key_value("ids", [1, -2, 3], array, sub_type=gguf.GGUFValueType.INT32)
    writer.add_key_value("scores", [0.5, -1.25], array, sub_type=gguf.GGUFValueType.FLOAT32)
    writer.add_array("flags", [True, False])
    writer.add_bool("b", True)
    writer.add_uint32("u32", 7)
    writer.add_int64("i64", -9)
    writer.add_float64("f64", 2.5)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    fast, reference = read_metadata(path), GGUFFile(path).metadata
    assert fast.keys() == reference.keys()
    for key, want in reference.items():
        if isinstance(want, np.ndarray):
            assert fast[key].dtype == want.dtype and np.array_equal(fast[key], want), key
        else:
            assert fast[key] == want and type(fast[key]) is type(want), key


# libstdc++'s std::hash<std::string> (64-bit), printed by a C++ program; llama.cpp's choice among
# several EOT candidates follows the unordered_map order these hashes give
LIBSTDCXX_HASHES = {
    b"": 0x553E93901E462A6E, b"a": 0x454DDEE488C1ED6B, b"hello": 0x26553298FDBE39C8,
    b"12345678": 0x8C5B90A33A04DCA5, b"123456789": 0xAAEB28D3D5F165C0,
    b"<|im_end|>": 0x1C4AD163CCD5C545, b"<|endoftext|>": 0x2B34C074254B95F4,
}


def test_string_hash_is_libstdcxx() -> None:
    keys = list(LIBSTDCXX_HASHES)
    assert [int(h) for h in hash_bytes(keys)] == [LIBSTDCXX_HASHES[k] for k in keys]


# --------------------------------------------------------------------------- a hand-made SPM vocab

BYTES0 = 3   # <0x00> is token 3
SPM_TOKENS = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)),
              "\u2581", "a", "b", "ab", "\u2581ab", "\u2581a", "<|user|>"]
SPACE, A, B, AB, SPACE_AB, SPACE_A, USER = range(259, 266)


def spm_meta(**extra: object) -> dict[str, object]:
    types = [2, 3, 3] + [6] * 256 + [1] * 6 + [4]
    scores = [0.0] * 259 + [-1.0, -2.0, -3.0, -1.5, -0.5, -1.0, 0.0]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": list(SPM_TOKENS),
            "tokenizer.ggml.token_type": np.array(types, dtype=np.int32),
            "tokenizer.ggml.scores": np.array(scores, dtype=np.float32), **extra}


def test_spm_merges_by_score_with_space_prefix() -> None:
    vocab = Vocab.from_metadata(spm_meta())
    # "▁ab": ▁+a (-1) beats a+b (-1.5), then ▁a+b makes ▁ab
    assert vocab.tokenize("ab") == [1, SPACE_AB]
    assert vocab.tokenize("ab", add_special=False) == [SPACE_AB]
    assert vocab.tokenize("ba", add_special=False) == [SPACE, B, A]                 # no pair is a token
    assert vocab.tokenize("é", add_special=False) == [SPACE, BYTES0 + 0xC3, BYTES0 + 0xA9]   # byte fallback
    assert vocab.tokenize("", add_special=True) == [1]
    assert (vocab.bos, vocab.eos, vocab.unk, vocab.nl) == (1, 2, 0, BYTES0 + 0x0A)


def test_spm_user_defined_tokens_split_the_text_and_restart_the_space_prefix() -> None:
    vocab = Vocab.from_metadata(spm_meta())
    assert vocab.tokenize("a<|user|>b", add_special=False) == [SPACE_A, USER, SPACE, B]
    # control tokens only when parsing special tokens
    assert vocab.tokenize("<s>", add_special=False, parse_special=True) == [1]
    assert 1 not in vocab.tokenize("<s>", add_special=False, parse_special=False)


def test_spm_detokenize_drops_the_prefix_space_once() -> None:
    vocab = Vocab.from_metadata(spm_meta())
    assert vocab.detokenize([SPACE_AB]) == "ab"
    assert vocab.detokenize([1, SPACE_AB]) == " ab"       # the BOS piece took the one lstrip
    assert vocab.detokenize([1, SPACE_AB], remove_special=True) == " ab"
    assert vocab.detokenize([1, SPACE_AB, 2], unparse_special=True) == "<s> ab</s>"
    assert vocab.token_to_piece(BYTES0 + 0x41) == b"A"
    assert vocab.token_to_piece(SPACE_A, lstrip=1) == b"a"
    assert vocab.token_to_piece(1) == b"" and vocab.token_to_piece(1, special=True) == b"<s>"


def test_add_bos_and_add_eos_follow_the_metadata() -> None:
    vocab = Vocab.from_metadata(spm_meta(**{"tokenizer.ggml.add_bos_token": False,
                                            "tokenizer.ggml.add_eos_token": True}))
    assert vocab.tokenize("ab") == [SPACE_AB, 2]
    assert vocab.is_eog(2) and not vocab.is_eog(1)


# --------------------------------------------------------------------------- bad input

def test_bad_token_ids_name_the_id() -> None:
    vocab = Vocab.from_metadata(spm_meta())
    n = vocab.n_tokens
    with pytest.raises(VocabError, match=f"token id {n} "):
        vocab.token_to_piece(n)
    with pytest.raises(VocabError, match="token id -1 "):
        vocab.token_to_piece(-1)
    with pytest.raises(VocabError, match="token id 99999 "):
        vocab.detokenize([SPACE_AB, 99999])
    with pytest.raises(VocabError, match="token id -7 "):
        vocab.text(-7)


@pytest.mark.parametrize("change, message", [
    ({"tokenizer.ggml.model": None}, "no tokenizer.ggml.model"),
    ({"tokenizer.ggml.model": "sentencepiece"}, "unknown tokenizer: 'sentencepiece'"),
    ({"tokenizer.ggml.model": "rwkv"}, "tokenizer model 'rwkv' is known to llama.cpp but not supported"),
    ({"tokenizer.ggml.tokens": None}, "cannot find tokenizer vocab"),
    ({"tokenizer.ggml.tokens": []}, "tokenizer.ggml.tokens is empty"),
    ({"tokenizer.ggml.scores": np.zeros(3, dtype=np.float32)}, "scores has 3 entries for 266 tokens"),
    ({"tokenizer.ggml.token_type": ["x"] * 266}, "invalid gguf type for tokenizer.ggml.token_type"),
    ({"tokenizer.ggml.model": "gpt2"}, "cannot find tokenizer merges"),
    ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.pre": "nope"},
     "unknown pre-tokenizer type: 'nope'"),
    ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.pre": "whitespace"},
     "'whitespace' is known to llama.cpp but not supported"),
])
def test_bad_metadata_is_a_clear_error(change: dict[str, object], message: str) -> None:
    meta = spm_meta()
    for key, value in change.items():
        if value is None:
            del meta[key]
        else:
            meta[key] = value
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        Vocab.from_metadata(meta)


def test_phi3_rstrip_needs_its_tokens() -> None:
    with pytest.raises(ValueError, match="no token '</s>'"):
        Vocab.from_metadata(spm_meta(**{"general.name": "Phi-3 mini"}) | {
            "tokenizer.ggml.tokens": [t.replace("</s>", "<eos>") for t in SPM_TOKENS]})
