"""Convert a Hugging Face BERT model (safetensors) to GGUF, as llama.cpp's convert_hf_to_gguf.py does.

`convert_hf_to_gguf(hf_dir, out_path, outtype="f32")` reads config.json, model.safetensors, the
tokenizer files (tokenizer.json / vocab.txt, tokenizer_config.json) and sentence-transformers'
modules.json + pooling config, and writes the GGUF that convert's BertModel would: the same
general.* metadata (gguf.Metadata from the model card and config), bert.* hparams, tensor names,
types and order, and the WordPiece vocab in llama.cpp's phantom-space form (convert_vocab.py).

Tensor types follow convert: with outtype f16 only 2-D `.weight` matrices other than the position
and token-type embeddings become F16; 1-D tensors and norms stay F32.

Refused with a ConvertError: a directory without config.json or model.safetensors, a config whose
architecture is not BERT (or that llama.cpp's bert graph would compute wrongly: relative positions,
a non-GELU activation), a missing, unexpected or misshapen tensor, an unsupported pooling mode.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors import safe_open

from llamir.frontend.convert_vocab import VocabConvertError, read_vocab

log = logging.getLogger(__name__)

OUTTYPES = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16}

# the Hugging Face classes convert_hf_to_gguf.py converts as BERT that we convert too (BertFor-
# SequenceClassification would need its classifier head, CamembertModel a SentencePiece vocab)
BERT_ARCHITECTURES = ("BertModel", "BertForMaskedLM")

# transformers' BertConfig defaults: AutoConfig fills these in for keys config.json leaves out
BERT_CONFIG_DEFAULTS: dict[str, Any] = {
    "vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
    "intermediate_size": 3072, "hidden_act": "gelu", "max_position_embeddings": 512, "type_vocab_size": 2,
    "layer_norm_eps": 1e-12, "position_embedding_type": "absolute",
}

# sentence-transformers' pooling modes -> llama.cpp's pooling types (_try_set_pooling_type)
POOLING_FLAGS = {"pooling_mode_mean_tokens": gguf.PoolingType.MEAN, "pooling_mode_cls_token": gguf.PoolingType.CLS,
                 "pooling_mode_lasttoken": gguf.PoolingType.LAST}
POOLING_MODES = {"mean": gguf.PoolingType.MEAN, "cls": gguf.PoolingType.CLS, "lasttoken": gguf.PoolingType.LAST}

T = gguf.MODEL_TENSOR
# Hugging Face module path (after "bert." and gamma/beta renames) -> GGUF tensor
GLOBAL_TENSORS = {
    "embeddings.word_embeddings": T.TOKEN_EMBD,
    "embeddings.token_type_embeddings": T.TOKEN_TYPES,
    "embeddings.position_embeddings": T.POS_EMBD,
    "embeddings.LayerNorm": T.TOKEN_EMBD_NORM,
}
BLOCK_TENSORS = {
    "attention.self.query": T.ATTN_Q,
    "attention.self.key": T.ATTN_K,
    "attention.self.value": T.ATTN_V,
    "attention.output.dense": T.ATTN_OUT,
    "attention.output.LayerNorm": T.ATTN_OUT_NORM,
    "intermediate.dense": T.FFN_UP,
    "output.dense": T.FFN_DOWN,
    "output.LayerNorm": T.LAYER_OUT_NORM,
}
# tensors BertModel.filter_tensors drops: the pooler and the pre-training heads (embeddings only)
_DROPPED = re.compile(r"^(embeddings\.position_ids|pooler\.dense\.(weight|bias)|cls\.predictions\..*"
                      r"|cls\.seq_relationship\..*)$")
_DROPPED_SUFFIXES = (".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")
_BLOCK = re.compile(r"^encoder\.layer\.(\d+)\.(.+)$")
# kept in F32 whatever the outtype, as convert keeps them
_F32_TENSORS = (T.POS_EMBD, T.TOKEN_TYPES)


class ConvertError(ValueError):
    """The directory is not a BERT model we can convert; the message names the file and what is wrong."""


@dataclass(frozen=True)
class BertConfig:
    """The hparams of config.json the GGUF carries (Hugging Face names in the comments)."""

    n_vocab: int        # vocab_size
    n_embd: int         # hidden_size
    n_ff: int           # intermediate_size
    n_head: int         # num_attention_heads
    n_layer: int        # num_hidden_layers
    n_ctx_train: int    # max_position_embeddings
    n_token_types: int  # type_vocab_size
    norm_eps: float     # layer_norm_eps


@dataclass(frozen=True)
class _Tensor:
    name: str            # GGUF name, e.g. blk.0.attn_q.weight
    source: str          # safetensors name
    key: gguf.MODEL_TENSOR
    shape: tuple[int, ...]


def convert_hf_to_gguf(hf_dir: str | Path, out_path: str | Path, outtype: str = "f32") -> Path:
    """Write the GGUF of the BERT model in `hf_dir` to `out_path` (atomically) and return its path."""
    hf_dir, out_path = Path(hf_dir), Path(out_path)
    if outtype not in OUTTYPES:
        raise ConvertError(f"outtype {outtype!r} is not one of {', '.join(OUTTYPES)}")
    if not hf_dir.is_dir():
        raise ConvertError(f"{hf_dir} is not a directory")
    for required in ("config.json", "model.safetensors"):
        if not (hf_dir / required).is_file():
            raise ConvertError(f"{hf_dir} has no {required}: a Hugging Face BERT model directory needs "
                               "config.json and model.safetensors")
    hparams = read_hparams(hf_dir)
    cfg = bert_config(hparams, hf_dir / "config.json")
    tensors = plan_tensors(hf_dir / "model.safetensors", cfg)
    try:
        vocab = read_vocab(hf_dir, cfg.n_vocab)
    except VocabConvertError as err:
        raise ConvertError(str(err)) from None
    pooling = read_pooling_type(hf_dir)

    writer = gguf.GGUFWriter(path=None, arch=gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.BERT])
    _add_tensors(writer, hf_dir / "model.safetensors", tensors, outtype)
    _add_general(writer, hf_dir)
    _add_hparams(writer, cfg, OUTTYPES[outtype], pooling)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    vocab.add_to_gguf(writer, cfg.n_token_types)
    return _write_atomically(writer, out_path)


# ----------------------------------------------------------------------------------------------
# config.json


def read_hparams(hf_dir: Path) -> dict[str, Any]:
    """config.json with transformers' BertConfig defaults for the keys it leaves out."""
    path = hf_dir / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ConvertError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise ConvertError(f"{path} holds a {type(config).__name__}, not a JSON object")
    archs = config.get("architectures")
    if not isinstance(archs, list) or not archs:
        raise ConvertError(f"{path} names no architectures; expected one of {', '.join(BERT_ARCHITECTURES)}")
    if archs[0] not in BERT_ARCHITECTURES:
        raise ConvertError(f"{path}: architecture {archs[0]!r} is not a BERT model this converter handles "
                           f"(one of {', '.join(BERT_ARCHITECTURES)})")
    return BERT_CONFIG_DEFAULTS | config


def bert_config(hp: dict[str, Any], path: Path) -> BertConfig:
    """The GGUF hparams of a BERT config, checked for what llama.cpp's bert graph computes."""
    def positive(key: str) -> int:
        value = hp[key]
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConvertError(f"{path}: {key} = {value!r}, expected a positive integer")
        return value

    eps = hp["layer_norm_eps"]
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 < eps < 1:
        raise ConvertError(f"{path}: layer_norm_eps = {eps!r}, expected a small positive number")
    cfg = BertConfig(n_vocab=positive("vocab_size"), n_embd=positive("hidden_size"),
                     n_ff=positive("intermediate_size"), n_head=positive("num_attention_heads"),
                     n_layer=positive("num_hidden_layers"), n_ctx_train=positive("max_position_embeddings"),
                     n_token_types=positive("type_vocab_size"), norm_eps=float(eps))
    if cfg.n_embd % cfg.n_head:
        raise ConvertError(f"{path}: hidden_size {cfg.n_embd} is not a multiple of num_attention_heads {cfg.n_head}")
    if hp["position_embedding_type"] != "absolute":
        raise ConvertError(f"{path}: position_embedding_type {hp['position_embedding_type']!r}; llama.cpp's bert "
                           "graph has absolute position embeddings only")
    if not str(hp["hidden_act"]).startswith("gelu"):
        raise ConvertError(f"{path}: hidden_act {hp['hidden_act']!r}; llama.cpp's bert graph uses GELU")
    return cfg


def read_pooling_type(hf_dir: Path) -> gguf.PoolingType | None:
    """The pooling of the sentence-transformers Pooling module named in modules.json, if any."""
    modules_path = hf_dir / "modules.json"
    if not modules_path.is_file():
        return None
    try:
        modules = json.loads(modules_path.read_text(encoding="utf-8"))
        pooling_dir = next((m["path"] for m in modules if str(m["type"]).endswith("Pooling")), None)
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise ConvertError(f"{modules_path} is not a sentence-transformers module list: {err}") from None
    if pooling_dir is None:
        return None
    path = hf_dir / pooling_dir / "config.json"
    try:
        pooling = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ConvertError(f"{path} (the pooling config modules.json names) cannot be read: {err}") from None
    for flag, kind in POOLING_FLAGS.items():
        if pooling.get(flag):
            return kind
    if pooling.get("pooling_mode") in POOLING_MODES:
        return POOLING_MODES[pooling["pooling_mode"]]
    raise ConvertError(f"{path}: pooling {pooling!r} is none of mean, cls, lasttoken (the pooling types "
                       "llama.cpp has)")


# ----------------------------------------------------------------------------------------------
# tensors


def expected_tensors(cfg: BertConfig) -> dict[str, tuple[int, ...]]:
    """GGUF name -> numpy shape of every tensor a BERT GGUF must have."""
    d, f = cfg.n_embd, cfg.n_ff
    names = gguf.TENSOR_NAMES
    shapes = {
        names[T.TOKEN_EMBD] + ".weight": (cfg.n_vocab, d),
        names[T.TOKEN_TYPES] + ".weight": (cfg.n_token_types, d),
        names[T.POS_EMBD] + ".weight": (cfg.n_ctx_train, d),
        names[T.TOKEN_EMBD_NORM] + ".weight": (d,), names[T.TOKEN_EMBD_NORM] + ".bias": (d,),
    }
    block = {T.ATTN_Q: (d, d), T.ATTN_K: (d, d), T.ATTN_V: (d, d), T.ATTN_OUT: (d, d), T.ATTN_OUT_NORM: None,
             T.FFN_UP: (f, d), T.FFN_DOWN: (d, f), T.LAYER_OUT_NORM: None}
    for il in range(cfg.n_layer):
        for key, weight in block.items():
            base = names[key].format(bid=il)
            shapes[base + ".weight"] = weight or (d,)
            shapes[base + ".bias"] = (weight[0],) if weight else (d,)
    return shapes


def gguf_name(source: str) -> tuple[str, gguf.MODEL_TENSOR] | None:
    """The GGUF name of a safetensors tensor, None for one convert drops; ConvertError if unknown."""
    name = source.removeprefix("bert.")
    if name.endswith(".gamma"):
        name = name.removesuffix(".gamma") + ".weight"
    elif name.endswith(".beta"):
        name = name.removesuffix(".beta") + ".bias"
    if _DROPPED.match(name) or name.endswith(_DROPPED_SUFFIXES):
        return None
    module, dot, suffix = name.rpartition(".")
    if dot and suffix in ("weight", "bias"):
        if module in GLOBAL_TENSORS:
            key = GLOBAL_TENSORS[module]
            return f"{gguf.TENSOR_NAMES[key]}.{suffix}", key
        if (m := _BLOCK.match(module)) and m.group(2) in BLOCK_TENSORS:
            key = BLOCK_TENSORS[m.group(2)]
            return f"{gguf.TENSOR_NAMES[key].format(bid=int(m.group(1)))}.{suffix}", key
    raise ConvertError(f"cannot map tensor {source!r} to a BERT GGUF tensor")


def plan_tensors(path: Path, cfg: BertConfig) -> list[_Tensor]:
    """The tensors to write, in convert's order (sorted safetensors names), each checked for shape."""
    expected = expected_tensors(cfg)
    try:
        with safe_open(str(path), framework="np") as f:
            shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except Exception as err:   # safetensors raises its own SafetensorError, and OSError
        raise ConvertError(f"{path} is not a readable safetensors file: {err}") from None
    plan: list[_Tensor] = []
    seen: dict[str, str] = {}
    for source in sorted(shapes):
        mapped = gguf_name(source)
        if mapped is None:
            continue
        name, key = mapped
        if name not in expected:
            raise ConvertError(f"{path}: tensor {source!r} ({name}) is not part of a BERT model with "
                               f"{cfg.n_layer} layers")
        if name in seen:
            raise ConvertError(f"{path}: tensors {seen[name]!r} and {source!r} both map to {name}")
        if shapes[source] != expected[name]:
            raise ConvertError(f"{path}: tensor {source!r} ({name}) has shape {list(shapes[source])}, expected "
                               f"{list(expected[name])} from config.json")
        seen[name] = source
        plan.append(_Tensor(name, source, key, shapes[source]))
    missing = [n for n in expected if n not in seen]
    if missing:
        raise ConvertError(f"{path} lacks {len(missing)} tensor(s) a BERT model needs: {', '.join(missing[:6])}"
                           + (" ..." if len(missing) > 6 else ""))
    return plan


def _out_type(t: _Tensor, outtype: str) -> gguf.GGMLQuantizationType:
    """convert's choice: F32 for 1-D tensors, norms, position/token-type embeddings and non-weights."""
    keep_f32 = (outtype == "f32" or len(t.shape) <= 1 or t.name.endswith("_norm.weight")
                or t.key in _F32_TENSORS or not t.name.endswith(".weight"))
    return gguf.GGMLQuantizationType.F32 if keep_f32 else gguf.GGMLQuantizationType.F16


def _add_tensors(w: gguf.GGUFWriter, path: Path, plan: list[_Tensor], outtype: str) -> None:
    with safe_open(str(path), framework="np") as f:
        for t in plan:
            if f.get_slice(t.source).get_dtype() == "BF16":
                data = _read_bf16(path, t.source)   # numpy has no bfloat16
            else:
                data = f.get_tensor(t.source)
            qtype = _out_type(t, outtype)
            dtype = np.float32 if qtype == gguf.GGMLQuantizationType.F32 else np.float16
            w.add_tensor(t.name, np.ascontiguousarray(data, dtype=dtype), raw_dtype=qtype)


def _read_bf16(path: Path, name: str) -> np.ndarray:
    """A BF16 tensor of a safetensors file, widened to float32 (bf16 is the top half of an f32)."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        info = json.loads(f.read(header_len))[name]
        begin, end = info["data_offsets"]
        f.seek(8 + header_len + begin)
        raw = np.frombuffer(f.read(end - begin), dtype="<u2")
    return (raw.astype(np.uint32) << 16).view(np.float32).reshape(info["shape"])


# ----------------------------------------------------------------------------------------------
# metadata


def _add_general(w: gguf.GGUFWriter, hf_dir: Path) -> None:
    """general.*: gguf.Metadata from the model card and config, the size label from the tensors."""
    total, shared, expert, n_expert = w.get_total_parameter_count()
    meta = gguf.Metadata.load(None, hf_dir, None, total)
    if meta.name is None:
        meta.name = hf_dir.name
    if meta.size_label is None and total > 0:
        meta.size_label = gguf.size_label(total, shared, expert, n_expert)
    w.add_type(gguf.GGUFType.MODEL)
    meta.set_gguf_meta_model(w)


def _add_hparams(w: gguf.GGUFWriter, cfg: BertConfig, ftype: gguf.LlamaFileType,
                 pooling: gguf.PoolingType | None) -> None:
    w.add_block_count(cfg.n_layer)
    w.add_context_length(cfg.n_ctx_train)
    w.add_embedding_length(cfg.n_embd)
    w.add_feed_forward_length(cfg.n_ff)
    w.add_head_count(cfg.n_head)
    w.add_layer_norm_eps(cfg.norm_eps)
    w.add_file_type(ftype)
    w.add_causal_attention(False)
    if pooling is not None:
        w.add_pooling_type(pooling)


def _write_atomically(w: gguf.GGUFWriter, out_path: Path) -> Path:
    """Write to a temporary name beside `out_path`, then rename: a failed run leaves no partial file."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    # a plain open (not mkstemp) so the file gets the umask's permissions, not 0600
    tmp = out_path.with_name(f".{out_path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        w.write_header_to_file(path=tmp)
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, out_path)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    return out_path


__all__ = ["BERT_ARCHITECTURES", "OUTTYPES", "BertConfig", "ConvertError", "bert_config", "convert_hf_to_gguf",
           "expected_tensors", "gguf_name", "plan_tensors", "read_hparams", "read_pooling_type"]
