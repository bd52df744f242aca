"""Hugging Face BERT directories written by the tests, and an independent numpy forward of the model.

`write_tiny_bert(dir)` writes what a sentence-transformers BERT checkpoint holds (config.json,
model.safetensors with random weights, vocab.txt, tokenizer.json, tokenizer_config.json,
special_tokens_map.json, modules.json, 1_Pooling/config.json), small enough to convert in
milliseconds. `bert_forward` is Hugging Face's BertModel math written from the paper's equations on
the safetensors weights: nothing of llamir or llama.cpp is used.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

# [PAD]=0, [UNK]=1, [CLS]=2, [SEP]=3, [MASK]=4 as in small BERT vocabs; then words and pieces
TINY_VOCAB = [
    "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[unused0]", ".", ",", "!", "?",
    "the", "cat", "sat", "on", "mat", "a", "dog", "run", "##s", "##ing",
    "##ed", "play", "cafe", "1", "2", "##3", "我", "想", "##y", "un",
]
TINY_SPECIAL = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4}


def tiny_config(n_layer: int = 2, n_embd: int = 16, n_head: int = 2, n_ff: int = 32, n_vocab: int = 32,
                n_ctx: int = 64, **extra) -> dict:
    """A config.json of a small BertModel (vocab_size above the vocab's 30 lines: ids 30, 31 unused)."""
    return {
        "architectures": ["BertModel"], "model_type": "bert", "hidden_act": "gelu", "hidden_size": n_embd,
        "intermediate_size": n_ff, "layer_norm_eps": 1e-12, "max_position_embeddings": n_ctx,
        "num_attention_heads": n_head, "num_hidden_layers": n_layer, "pad_token_id": 0,
        "position_embedding_type": "absolute", "type_vocab_size": 2, "vocab_size": n_vocab, **extra,
    }


def tiny_weights(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random f32 weights under Hugging Face's names (incl. position_ids and the pooler, which convert
    drops); linear layers scaled 1/sqrt(fan_in) so activations stay O(1) and attention is not flat."""
    rng = np.random.default_rng(seed)
    d, f, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]

    def normal(*shape: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def norm(prefix: str) -> dict[str, np.ndarray]:
        return {f"{prefix}.weight": 1 + normal(d, scale=0.1), f"{prefix}.bias": normal(d, scale=0.1)}

    def linear(prefix: str, n_out: int, n_in: int) -> dict[str, np.ndarray]:
        return {f"{prefix}.weight": normal(n_out, n_in, scale=1 / math.sqrt(n_in)),
                f"{prefix}.bias": normal(n_out, scale=0.1)}

    w = {
        "embeddings.word_embeddings.weight": normal(cfg["vocab_size"], d),
        "embeddings.position_embeddings.weight": normal(cfg["max_position_embeddings"], d, scale=0.5),
        "embeddings.token_type_embeddings.weight": normal(cfg["type_vocab_size"], d, scale=0.5),
        "embeddings.position_ids": np.arange(cfg["max_position_embeddings"], dtype=np.int64)[None],
        **norm("embeddings.LayerNorm"),
        **linear("pooler.dense", d, d),
    }
    for il in range(L):
        p = f"encoder.layer.{il}"
        w |= linear(f"{p}.attention.self.query", d, d) | linear(f"{p}.attention.self.key", d, d)
        w |= linear(f"{p}.attention.self.value", d, d) | linear(f"{p}.attention.output.dense", d, d)
        w |= norm(f"{p}.attention.output.LayerNorm") | linear(f"{p}.intermediate.dense", f, d)
        w |= linear(f"{p}.output.dense", d, f) | norm(f"{p}.output.LayerNorm")
    return w


def tokenizer_json(vocab: list[str]) -> dict:
    """A BertTokenizerFast tokenizer.json: WordPiece, BertNormalizer (uncased), [CLS] A [SEP] template."""
    added = [{"id": vocab.index(t), "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for t in TINY_SPECIAL]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "BertNormalizer", "clean_text": True, "handle_chinese_chars": True,
                       "strip_accents": None, "lowercase": True},
        "pre_tokenizer": {"type": "BertPreTokenizer"},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                       {"SpecialToken": {"id": "[SEP]", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "[SEP]", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}},
                     {"SpecialToken": {"id": "[SEP]", "type_id": 1}}],
            "special_tokens": {t: {"id": t, "ids": [vocab.index(t)], "tokens": [t]} for t in ("[CLS]", "[SEP]")},
        },
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": True},
        "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
                  "max_input_chars_per_word": 100, "vocab": {t: i for i, t in enumerate(vocab)}},
    }


def write_tiny_bert(directory: Path, cfg: dict | None = None, weights: dict[str, np.ndarray] | None = None,
                    pooling: str | None = "mean", vocab: list[str] | None = None) -> Path:
    """A sentence-transformers BERT directory; `pooling` (mean, cls, max, mean_sqrt) None leaves out
    modules.json."""
    cfg = cfg if cfg is not None else tiny_config()
    vocab = vocab if vocab is not None else TINY_VOCAB
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(weights if weights is not None else tiny_weights(cfg), str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    (directory / "vocab.txt").write_text("".join(t + "\n" for t in vocab), encoding="utf-8")
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer_json(vocab)), encoding="utf-8")
    names = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
             "mask_token": "[MASK]"}
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"do_lower_case": True, **names, "tokenize_chinese_chars": True, "strip_accents": None,
         "tokenizer_class": "BertTokenizer", "model_max_length": 512}))
    (directory / "special_tokens_map.json").write_text(json.dumps(names))
    if pooling is not None:
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                   {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
        (directory / "modules.json").write_text(json.dumps(modules))
        (directory / "1_Pooling").mkdir(exist_ok=True)
        modes = {"cls": "cls_token", "mean": "mean_tokens", "max": "max_tokens", "mean_sqrt": "mean_sqrt_len_tokens"}
        flags = {f"pooling_mode_{flag}": pooling == mode for mode, flag in modes.items()}
        (directory / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": cfg["hidden_size"], **flags}))
    return directory


def write_bf16_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A safetensors file of bf16 tensors (numpy has no bf16: written by hand in the format's layout:
    u64 header length, JSON header, data). Returns the f32 values the file holds."""
    header, blobs, offset, held = {}, [], 0, {}
    for name, value in tensors.items():
        bits = (np.ascontiguousarray(value, dtype=np.float32).view(np.uint32) >> 16).astype("<u2")
        raw = bits.tobytes()
        header[name] = {"dtype": "BF16", "shape": list(value.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
        held[name] = (bits.astype(np.uint32) << 16).view(np.float32).reshape(value.shape)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    return held


# ----------------------------------------------------------------------------------------------
# The reference forward: Hugging Face BertModel, float64.

_erf = np.frompyfunc(math.erf, 1, 1)


def gelu_erf(x: np.ndarray) -> np.ndarray:
    """GELU(x) = x/2 (1 + erf(x / sqrt 2)), the exact form of Hugging Face's "gelu"."""
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)).astype(np.float64))


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def load_weights(hf_dir: Path) -> dict[str, np.ndarray]:
    return {k: v.astype(np.float64) for k, v in load_file(str(hf_dir / "model.safetensors")).items()}


def bert_forward(w: dict[str, np.ndarray], cfg: dict, tokens: list[int]) -> np.ndarray:
    """[T, n_embd] last hidden states: embeddings (token + position + type 0) + LayerNorm, then
    post-LN blocks x = LN(x + Attn(x)), x = LN(x + W2 gelu(W1 x)), bidirectional softmax attention."""
    d, n_head, eps = cfg["hidden_size"], cfg["num_attention_heads"], cfg["layer_norm_eps"]
    n_tok, hd = len(tokens), d // n_head
    x = (w["embeddings.word_embeddings.weight"][tokens] + w["embeddings.position_embeddings.weight"][:n_tok]
         + w["embeddings.token_type_embeddings.weight"][0])                               # [T, d]
    x = layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
    for il in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{il}."

        def lin(h: np.ndarray, name: str, p: str = p) -> np.ndarray:
            return h @ w[p + name + ".weight"].T + w[p + name + ".bias"]

        def heads(h: np.ndarray) -> np.ndarray:
            return h.reshape(n_tok, n_head, hd).transpose(1, 0, 2)                       # [H, T, hd]

        q, k, v = (heads(lin(x, f"attention.self.{n}")) for n in ("query", "key", "value"))
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(hd)                                # [H, T, T]
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = (probs @ v).transpose(1, 0, 2).reshape(n_tok, d)                          # [T, d]
        x = layer_norm(x + lin(attn, "attention.output.dense"), w[p + "attention.output.LayerNorm.weight"],
                       w[p + "attention.output.LayerNorm.bias"], eps)
        h = gelu_erf(lin(x, "intermediate.dense"))                                        # [T, n_ff]
        x = layer_norm(x + lin(h, "output.dense"), w[p + "output.LayerNorm.weight"],
                       w[p + "output.LayerNorm.bias"], eps)
    return x


def sentence_embedding(hidden: np.ndarray, pooling: str = "mean") -> np.ndarray:
    """sentence-transformers: mean over the (all-ones) attention mask, or the [CLS] row; then L2-normalised."""
    e = hidden.mean(0) if pooling == "mean" else hidden[0]
    return e / np.linalg.norm(e)
