"""The safetensors-to-GGUF BERT converter (llamir convert), against llama.cpp and a numpy BERT.

A tiny random BERT directory (hf_bert.py) checks names, metadata, vocab, types, refusals; the real
all-MiniLM-L6-v2 (the embedding default, converted in the user cache) checks that llama.cpp loads our
GGUF and embeds sentences as Hugging Face's BertModel math does (cosine >= 0.9999), with the
similarities sentence-transformers publishes for the model, and that llamir's tokenizer gives
llama.cpp's ids on it.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import llama_cpp  # noqa: F401  (the oracle: a missing llama-cpp-python fails this module, never skips it)
import numpy as np
import pytest
from hf_bert import (
    TINY_VOCAB,
    bert_forward,
    load_weights,
    sentence_embedding,
    tiny_config,
    tiny_weights,
    write_bf16_safetensors,
    write_tiny_bert,
)
from safetensors.numpy import save_file

import llamir
from llamir.cli import main as cli_main
from llamir.frontend import default_model as dm
from llamir.frontend.convert import ConvertError, convert_hf_to_gguf
from llamir.testing.llama_cpp import LlamaCppOracle

F32, F16 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16
CONTROL, NORMAL, UNUSED = int(gguf.TokenType.CONTROL), int(gguf.TokenType.NORMAL), int(gguf.TokenType.UNUSED)

# The engines the embedding checks run on. The lead adds "llamir" here once the bert architecture
# is in: embeddings() below already drives it through the public API.
ENGINES = ["llama.cpp", "llamir"]


def embeddings(engine: str, path: Path, token_lists: list[list[int]], pooling: str | None = None) -> np.ndarray:
    """[n, n_embd] L2-normalised pooled embeddings, one sequence per token list, encoded one at a time.
    pooling None: the model's own pooling_type."""
    rows = []
    if engine == "llama.cpp":
        with LlamaCppOracle(path, n_ctx=512, embeddings=True, pooling=pooling) as o:
            for tokens in token_lists:
                o.clear()
                n = len(tokens)
                assert o.decode_batch(tokens, list(range(n)), [(0,)] * n, [True] * n) == 0
                rows.append(o.embeddings_seq(0))
    elif engine == "llamir":
        model = llamir.load_model(path)
        for tokens in token_lists:
            ctx = llamir.Context(model, n_ctx=512, embeddings=True, pooling_type=pooling or "unspecified")
            assert ctx.encode(llamir.Batch.from_tokens(tokens, logits="all")) == 0, ctx.last_error
            rows.append(np.array(ctx.get_embeddings_seq(0)))
    else:
        raise ValueError(f"unknown engine {engine!r}")
    out = np.stack(rows).astype(np.float64)
    return out / np.linalg.norm(out, axis=1, keepdims=True)


def read_gguf(path: Path) -> tuple[dict, dict[str, gguf.ReaderTensor]]:
    reader = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return fields, {t.name: t for t in reader.tensors}


# ----------------------------------------------------------------------------------------------
# the tiny synthetic model


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return write_tiny_bert(tmp_path / "tiny-bert")


def _block_names(il: int) -> list[str]:
    # sorted Hugging Face names: attention.output.{LayerNorm,dense}, attention.self.{key,query,value},
    # intermediate.dense, output.{LayerNorm,dense}, bias before weight
    parts = ["attn_output_norm", "attn_output", "attn_k", "attn_q", "attn_v", "ffn_up", "layer_output_norm",
             "ffn_down"]
    return [f"blk.{il}.{p}.{s}" for p in parts for s in ("bias", "weight")]


EXPECTED_ORDER = ["token_embd_norm.bias", "token_embd_norm.weight", "position_embd.weight", "token_types.weight",
                  "token_embd.weight", *_block_names(0), *_block_names(1)]


def test_tiny_bert_metadata_names_and_vocab(tiny, tmp_path):
    out = convert_hf_to_gguf(tiny, tmp_path / "tiny.gguf")
    fields, tensors = read_gguf(out)
    expected = {
        "general.architecture": "bert", "general.type": "model", "general.file_type": 0,
        "general.quantization_version": 2,
        "bert.block_count": 2, "bert.context_length": 64, "bert.embedding_length": 16,
        "bert.feed_forward_length": 32, "bert.attention.head_count": 2, "bert.attention.causal": False,
        "bert.pooling_type": 1, "tokenizer.ggml.token_type_count": 2,
        "tokenizer.ggml.model": "bert", "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 3, "tokenizer.ggml.unknown_token_id": 1,
        "tokenizer.ggml.seperator_token_id": 3, "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.mask_token_id": 4, "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": True, "tokenizer.ggml.add_sep_token": False,
        "tokenizer.ggml.normalizer.lowercase": True,
    }
    assert {k: fields.get(k) for k in expected} == expected
    assert fields["bert.attention.layer_norm_epsilon"] == pytest.approx(1e-12)
    assert fields["general.name"] == "Tiny Bert"       # gguf.Metadata's title of the directory name
    assert "tokenizer.ggml.cls_token_id" not in fields   # gguf-py has no cls writer: convert drops it
    # phantom-space vocab: word starts get U+2581, ## continuations lose the ##, specials stay
    assert fields["tokenizer.ggml.tokens"] == [
        "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "▁[unused0]", "▁.", "▁,", "▁!", "▁?",
        "▁the", "▁cat", "▁sat", "▁on", "▁mat", "▁a", "▁dog", "▁run", "s", "ing",
        "ed", "▁play", "▁cafe", "▁1", "▁2", "3", "▁我", "▁想", "y", "▁un", "▁[PAD30]", "▁[PAD31]"]
    assert fields["tokenizer.ggml.token_type"] == [CONTROL] * 5 + [NORMAL] * 25 + [UNUSED] * 2
    assert list(tensors) == EXPECTED_ORDER
    weights = tiny_weights(tiny_config())
    source = {"token_embd.weight": "embeddings.word_embeddings.weight",
              "blk.1.attn_q.weight": "encoder.layer.1.attention.self.query.weight",
              "blk.0.ffn_up.bias": "encoder.layer.0.intermediate.dense.bias",
              "blk.1.ffn_down.weight": "encoder.layer.1.output.dense.weight",
              "blk.0.layer_output_norm.weight": "encoder.layer.0.output.LayerNorm.weight"}
    for name, hf_name in source.items():
        t = tensors[name]
        assert t.tensor_type == F32
        assert np.array_equal(np.asarray(t.data).reshape(weights[hf_name].shape), weights[hf_name]), name
    assert list(tensors["blk.0.ffn_down.weight"].shape) == [32, 16]   # ggml ne order: [n_ff, n_embd]


def test_f16_keeps_vectors_norms_and_small_embeddings_in_f32(tiny, tmp_path):
    out = convert_hf_to_gguf(tiny, tmp_path / "tiny-f16.gguf", outtype="f16")
    fields, tensors = read_gguf(out)
    assert fields["general.file_type"] == 1
    f16 = {n for n, t in tensors.items() if t.tensor_type == F16}
    assert f16 == {"token_embd.weight"} | {f"blk.{il}.{p}.weight" for il in (0, 1)
                                          for p in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_up", "ffn_down")}
    assert all(t.tensor_type == F32 for n, t in tensors.items() if n not in f16)
    w = tiny_weights(tiny_config())["encoder.layer.0.attention.self.key.weight"]
    assert np.array_equal(np.asarray(tensors["blk.0.attn_k.weight"].data).reshape(w.shape), w.astype(np.float16))


@pytest.mark.llama_cpp
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("outtype", ["f32", "f16"])
@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_tiny_bert_embeddings_match_numpy_bert(tmp_path, engine, outtype, pooling):
    """llama.cpp runs our file with the pooling it declares; it agrees with Hugging Face's math."""
    hf_dir = write_tiny_bert(tmp_path / "tiny", pooling=pooling)
    out = convert_hf_to_gguf(hf_dir, tmp_path / "tiny.gguf", outtype=outtype)
    token_lists = [[2, 10, 11, 12, 13, 10, 14, 6, 3], [2, 16, 17, 19, 3], [2, 3], [2, *range(5, 30), 3]]
    ours = embeddings(engine, out, token_lists)
    cfg, w = tiny_config(), load_weights(hf_dir)
    ref = np.stack([sentence_embedding(bert_forward(w, cfg, t), pooling) for t in token_lists])
    cosines = np.sum(ours * ref, axis=1)
    assert cosines.min() >= 0.9999, cosines


@pytest.mark.llama_cpp
def test_llamir_tokenizes_the_tiny_vocab_as_llama_cpp(tiny, tmp_path):
    out = convert_hf_to_gguf(tiny, tmp_path / "tiny.gguf")
    vocab = llamir.load_model(out, vocab_only=True).vocab
    texts = ["The cats sat on the mat.", "A dog running, playing!", "CAFÉ 123 我想 unplayed?", "zebra [MASK] [CLS]x",
             "", "the  \t dogs"]
    with LlamaCppOracle(out, n_ctx=64) as o:
        for text in texts:
            for add_special, parse_special in ((True, False), (True, True), (False, False)):
                theirs = o.tokenize(text, add_special=add_special, parse_special=parse_special)
                assert vocab.tokenize(text.encode(), add_special=add_special, parse_special=parse_special) == theirs
    # [CLS] the cat ##s sat on the mat . [SEP], as Hugging Face's WordPiece splits it
    assert vocab.tokenize(b"The cats sat on the mat.", add_special=True) == [2, 10, 11, 18, 12, 13, 10, 14, 6, 3]


def test_bert_prefix_and_gamma_beta_names_convert_like_plain_ones(tmp_path):
    """Old BertForMaskedLM checkpoints: "bert." prefixes, LayerNorm gamma/beta, an MLM head to drop."""
    cfg = tiny_config(architectures=["BertForMaskedLM"])
    plain = tiny_weights(cfg)
    old = {}
    for name, value in plain.items():
        if ".LayerNorm." in name:
            name = name.replace(".weight", ".gamma").replace(".bias", ".beta")
        old["bert." + name] = value
    old["cls.predictions.bias"] = np.zeros(cfg["vocab_size"], np.float32)
    old["cls.predictions.transform.dense.weight"] = np.zeros((16, 16), np.float32)
    a = convert_hf_to_gguf(write_tiny_bert(tmp_path / "plain", cfg, plain), tmp_path / "a.gguf")
    b = convert_hf_to_gguf(write_tiny_bert(tmp_path / "old", cfg, old), tmp_path / "b.gguf")
    ta, tb = read_gguf(a)[1], read_gguf(b)[1]
    assert list(ta) == list(tb) == EXPECTED_ORDER
    assert all(np.array_equal(np.asarray(ta[n].data), np.asarray(tb[n].data)) for n in ta)


def test_bf16_weights_are_widened_to_f32(tmp_path):
    cfg = tiny_config()
    hf_dir = write_tiny_bert(tmp_path / "bf16", cfg)
    floats = {k: v for k, v in tiny_weights(cfg).items() if v.dtype == np.float32}
    held = write_bf16_safetensors(hf_dir / "model.safetensors", floats)
    tensors = read_gguf(convert_hf_to_gguf(hf_dir, tmp_path / "bf16.gguf"))[1]
    w = held["encoder.layer.1.intermediate.dense.weight"]
    assert tensors["blk.1.ffn_up.weight"].tensor_type == F32
    assert np.array_equal(np.asarray(tensors["blk.1.ffn_up.weight"].data).reshape(w.shape), w)


def test_a_model_without_modules_json_has_no_pooling_type(tmp_path):
    out = convert_hf_to_gguf(write_tiny_bert(tmp_path / "raw", pooling=None), tmp_path / "raw.gguf")
    assert "bert.pooling_type" not in read_gguf(out)[0]


# -- refusals -----------------------------------------------------------------------------------


def _edit_config(hf_dir: Path, **changes) -> None:
    cfg = json.loads((hf_dir / "config.json").read_text()) | changes
    (hf_dir / "config.json").write_text(json.dumps(cfg))


def _edit_weights(hf_dir: Path, drop: str | None = None, **replace: np.ndarray) -> None:
    w = tiny_weights(tiny_config())
    if drop:
        del w[drop]
    w |= replace
    save_file(w, str(hf_dir / "model.safetensors"))


REFUSALS = {
    "no config": (lambda d: (d / "config.json").unlink(), "no config.json"),
    "no safetensors": (lambda d: (d / "model.safetensors").unlink(), "no model.safetensors"),
    "gpt2": (lambda d: _edit_config(d, architectures=["GPT2LMHeadModel"]), "'GPT2LMHeadModel' is not a BERT"),
    "no architectures": (lambda d: _edit_config(d, architectures=[]), "names no architectures"),
    "classifier": (lambda d: _edit_config(d, architectures=["BertForSequenceClassification"]),
                   "BertForSequenceClassification"),
    "relative positions": (lambda d: _edit_config(d, position_embedding_type="relative_key"), "relative_key"),
    "heads": (lambda d: _edit_config(d, num_attention_heads=3), "not a multiple of num_attention_heads 3"),
    "eps": (lambda d: _edit_config(d, layer_norm_eps=None), "layer_norm_eps = None"),
    "layers": (lambda d: _edit_config(d, num_hidden_layers=0), "num_hidden_layers = 0, expected a positive"),
    "missing tensor": (lambda d: _edit_weights(d, drop="encoder.layer.1.output.dense.bias"),
                       "lacks 1 tensor.*blk.1.ffn_down.bias"),
    "wrong shape": (lambda d: _edit_weights(d, **{"encoder.layer.0.attention.self.query.weight":
                                                  np.zeros((16, 8), np.float32)}),
                    r"'encoder.layer.0.attention.self.query.weight' \(blk.0.attn_q.weight\) has shape \[16, 8\], "
                    r"expected \[16, 16\]"),
    "extra layer": (lambda d: _edit_weights(d, **{"encoder.layer.2.output.dense.bias": np.zeros(16, np.float32)}),
                    "not part of a BERT model with 2 layers"),
    "unknown tensor": (lambda d: _edit_weights(d, **{"embeddings.foo.weight": np.zeros(3, np.float32)}),
                       "cannot map tensor 'embeddings.foo.weight'"),
    "max pooling": (lambda d: write_tiny_bert(d, pooling="max"), "none of mean, cls, lasttoken"),
    "vocab too long": (lambda d: write_tiny_bert(d, vocab=TINY_VOCAB + [f"w{i}" for i in range(10)]),
                       "token 'w9' has id 39, but config.json's vocab_size is 32"),
    "bpe tokenizer": (lambda d: (d / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE"}})),
                      "'BPE', not WordPiece"),
    "no tokenizer": (lambda d: [(d / n).unlink() for n in ("tokenizer.json", "vocab.txt")],
                     "neither tokenizer.json nor vocab.txt"),
    "broken safetensors": (lambda d: (d / "model.safetensors").write_bytes(b"\x10\0\0\0\0\0\0\0{not json"),
                           "not a readable safetensors file"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_refuses_what_it_cannot_convert(tiny, tmp_path, case):
    damage, message = REFUSALS[case]
    damage(tiny)
    out = tmp_path / "out" / "x.gguf"
    with pytest.raises(ConvertError, match=message):
        convert_hf_to_gguf(tiny, out)
    assert not out.exists() and not (out.parent.exists() and any(out.parent.iterdir()))


def test_refuses_an_unknown_outtype(tiny, tmp_path):
    with pytest.raises(ConvertError, match="outtype 'q8_0' is not one of f32, f16"):
        convert_hf_to_gguf(tiny, tmp_path / "x.gguf", outtype="q8_0")


def test_cli_convert(tiny, tmp_path, capsys):
    out = tmp_path / "cli.gguf"
    assert cli_main(["convert", str(tiny), str(out), "--outtype", "f16"]) == 0
    assert read_gguf(out)[0]["general.file_type"] == 1
    assert cli_main(["convert", str(tmp_path / "nowhere"), str(out)]) == 1
    assert "is not a directory" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# all-MiniLM-L6-v2, the embedding default

SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.", "A man is riding a horse.",
             "The weather is lovely today.", "It's so sunny outside!", "He drove to the stadium."]


@pytest.fixture(scope="module")
def minilm() -> tuple[Path, Path]:
    """(the converted f32 GGUF, the Hugging Face directory it came from), both in the user cache."""
    return dm.default_embedding_model_path(progress=False), dm.default_embedding_hf_dir(progress=False)


@pytest.fixture(scope="module")
def minilm_tokens(minilm) -> list[list[int]]:
    with LlamaCppOracle(minilm[0], n_ctx=512) as o:
        return [o.tokenize(s) for s in SENTENCES]


def test_minilm_metadata_is_what_convert_writes(minilm):
    fields, tensors = read_gguf(minilm[0])
    expected = {
        "general.architecture": "bert", "general.name": "MiniLM L6 H384 Uncased", "general.basename": "all-MiniLM-L6",
        "general.version": "v2", "general.size_label": "23M", "general.license": "apache-2.0",
        "bert.block_count": 6, "bert.context_length": 512, "bert.embedding_length": 384,
        "bert.feed_forward_length": 1536, "bert.attention.head_count": 12, "bert.attention.causal": False,
        "bert.pooling_type": 1, "general.file_type": 0, "tokenizer.ggml.token_type_count": 2,
        "tokenizer.ggml.model": "bert", "tokenizer.ggml.pre": "jina-v2-en",   # bge-small's check hash
        "tokenizer.ggml.bos_token_id": 101, "tokenizer.ggml.eos_token_id": 102,
        "tokenizer.ggml.unknown_token_id": 100, "tokenizer.ggml.seperator_token_id": 102,
        "tokenizer.ggml.padding_token_id": 0, "tokenizer.ggml.mask_token_id": 103,
        "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": True,
        "tokenizer.ggml.add_sep_token": False, "tokenizer.ggml.normalizer.lowercase": True,
    }
    assert {k: fields.get(k) for k in expected} == expected
    lines = (minilm[1] / "vocab.txt").read_text(encoding="utf-8").splitlines()
    special = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"}
    assert fields["tokenizer.ggml.tokens"] == [t if t in special else t[2:] if t.startswith("##") else "▁" + t
                                               for t in lines]
    types = fields["tokenizer.ggml.token_type"]
    assert [i for i, k in enumerate(types) if k == CONTROL] == [0, 100, 101, 102, 103]
    assert len(tensors) == 5 + 16 * 6 and all(t.tensor_type == F32 for t in tensors.values())


@pytest.mark.llama_cpp
@pytest.mark.parametrize("engine", ENGINES)
def test_minilm_embeddings_match_numpy_bert(minilm, minilm_tokens, engine):
    path, hf_dir = minilm
    ours = embeddings(engine, path, minilm_tokens)
    cfg, w = json.loads((hf_dir / "config.json").read_text()), load_weights(hf_dir)
    ref = np.stack([sentence_embedding(bert_forward(w, cfg, t)) for t in minilm_tokens])
    cosines = np.sum(ours * ref, axis=1)
    assert cosines.min() >= 0.9999, cosines


@pytest.mark.llama_cpp
def test_minilm_f16_embeddings_match_numpy_bert(minilm, minilm_tokens, tmp_path):
    path = convert_hf_to_gguf(minilm[1], tmp_path / "minilm-f16.gguf", outtype="f16")
    ours = embeddings("llama.cpp", path, minilm_tokens)
    assert np.sum(ours * embeddings("llama.cpp", minilm[0], minilm_tokens), axis=1).min() >= 0.9999


# sentence-transformers' published cosine similarities for all-MiniLM-L6-v2: its quickstart
# (weather/sunny/stadium) and its semantic-search example (queries against a corpus)
PUBLISHED = [("The weather is lovely today.", "It's so sunny outside!", 0.6660),
             ("The weather is lovely today.", "He drove to the stadium.", 0.1046),
             ("It's so sunny outside!", "He drove to the stadium.", 0.1411),
             ("A man is eating pasta.", "A man is eating food.", 0.7035),
             ("A man is eating pasta.", "A man is eating a piece of bread.", 0.5272),
             ("A man is eating pasta.", "A man is riding a horse.", 0.1889),
             ("Someone in a gorilla costume is playing a set of drums.", "A monkey is playing drums.", 0.6433),
             ("A cheetah chases prey on across a field.", "A cheetah is running behind its prey.", 0.8253)]
# (anchor, closer, farther)
TRIPLES = [("A man is eating food.", "A man is eating a piece of bread.", "A man is riding a horse."),
           ("The weather is lovely today.", "It's so sunny outside!", "He drove to the stadium."),
           ("A monkey is playing drums.", "Someone in a gorilla costume is playing a set of drums.",
            "A woman is playing violin."),
           ("A cheetah is running behind its prey.", "A cheetah chases prey on across a field.",
            "Two men pushed carts through the woods.")]


@pytest.mark.llama_cpp
@pytest.mark.parametrize("engine", ENGINES)
def test_minilm_similarities_are_the_published_ones(minilm, engine):
    texts = sorted({s for row in PUBLISHED for s in row[:2]} | {s for row in TRIPLES for s in row})
    with LlamaCppOracle(minilm[0], n_ctx=512) as o:
        tokens = [o.tokenize(s) for s in texts]
    e = dict(zip(texts, embeddings(engine, minilm[0], tokens)))
    got = [round(float(e[a] @ e[b]), 4) for a, b, _ in PUBLISHED]
    assert np.allclose(got, [s for *_, s in PUBLISHED], atol=2e-3), got
    for anchor, closer, farther in TRIPLES:
        assert e[anchor] @ e[closer] > e[anchor] @ e[farther] + 0.2, (anchor, closer, farther)


TOKENIZER_TEXTS = [
    "A man is eating food.", "Hello, world! How's it going?", "Don't stop -- e-mail me @ 3:45pm (today).",
    "Héllo wörld, café naïve façade Ångström", "ÀÉÎÕÜ çñ ß İstanbul", "我想在apple工作1314151天～",
    "東京は日本の首都です。", "한국어 텍스트", "нещо на Български", "The year 2024: 3.14159 + 42 = 45.14159",
    "1,000,000 $5.99 50% #1", "supercalifragilisticexpialidocious xyzzyqqqw zzzzzzzzzzzz",
    "🚀 emoji ✅ here 🦙🦙", "", "   ", "  multiple   spaces\tand\nnew\r\nlines  ",
    "[CLS] [MASK] [SEP] [PAD] [UNK]", "x" * 120, "a\u200bb\u00adc\u0301", "ﬁ ǅ ẞ Ω K",
]


@pytest.mark.llama_cpp
def test_llamir_tokenizes_minilm_as_llama_cpp(minilm):
    vocab = llamir.load_model(minilm[0], vocab_only=True).vocab
    with LlamaCppOracle(minilm[0], n_ctx=512) as o:
        for text in TOKENIZER_TEXTS:
            for add_special in (True, False):
                for parse_special in (False, True):
                    theirs = o.tokenize(text, add_special=add_special, parse_special=parse_special)
                    ours = vocab.tokenize(text.encode(), add_special=add_special, parse_special=parse_special)
                    assert ours == theirs, (text, add_special, parse_special)
    # the ids Hugging Face's tokenizer gives (bert-base-uncased vocab)
    assert vocab.tokenize(b"A man is eating food.", add_special=True) == [101, 1037, 2158, 2003, 5983, 2833, 1012, 102]
