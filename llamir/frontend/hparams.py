"""Model hyper-parameters read from GGUF metadata with llama.cpp's keys and defaults
(src/llama-model.cpp, load_hparams)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from llamir.frontend.gguf_file import GGUFError, GGUFFile

ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")
POOLING_TYPES = {-1: "unspecified", 0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}
SWA_TYPES = ("none", "standard", "chunked", "symmetric")


@dataclass
class HParams:
    """llama_hparams, with per-layer arrays as tuples of length n_layer."""

    arch: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_ff_arr: tuple[int, ...]
    n_head_arr: tuple[int, ...]
    n_head_kv_arr: tuple[int, ...]
    n_embd_head_k: int
    n_embd_head_v: int
    n_rot: int
    f_norm_eps: float = 0.0
    f_norm_rms_eps: float = 0.0
    rope_freq_base_train: float = 10000.0
    rope_freq_scale_train: float = 1.0
    rope_scaling_type_train: str = "linear"
    rope_attn_factor: float = 1.0
    rope_finetuned: bool = False
    n_ctx_orig_yarn: int = 0
    yarn_ext_factor: float = -1.0
    yarn_attn_factor: float = 1.0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_log_mul: float = 0.0
    f_attention_scale: float = 0.0
    causal_attn: bool = True
    pooling_type: str = "unspecified"
    n_expert: int = 0
    n_expert_used: int = 0
    n_swa: int = 0
    swa_type: str = "none"
    swa_layers: tuple[bool, ...] = ()
    f_attn_logit_softcapping: float = 0.0
    f_final_logit_softcapping: float = 0.0
    f_max_alibi_bias: float = 0.0
    rope_freq_base_train_swa: float = 10000.0
    rope_freq_scale_train_swa: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)

    def set_swa_pattern(self, n_pattern: int, dense_first: bool = False) -> None:
        """llama_hparams::set_swa_pattern: with dense_first layer 0 is global, else the last of each group."""
        if dense_first:
            self.swa_layers = tuple(n_pattern == 0 or il % n_pattern != 0 for il in range(self.n_layer))
        else:
            self.swa_layers = tuple(n_pattern == 0 or il % n_pattern < n_pattern - 1 for il in range(self.n_layer))

    def n_head(self, il: int = 0) -> int:
        return self.n_head_arr[il]

    def n_head_kv(self, il: int = 0) -> int:
        return self.n_head_kv_arr[il]

    def n_ff(self, il: int = 0) -> int:
        return self.n_ff_arr[il]

    def n_gqa(self, il: int = 0) -> int:
        return self.n_head(il) // max(1, self.n_head_kv(il))

    def n_embd_k_gqa(self, il: int = 0) -> int:
        return self.n_embd_head_k * self.n_head_kv(il)

    def n_embd_v_gqa(self, il: int = 0) -> int:
        return self.n_embd_head_v * self.n_head_kv(il)

    def is_swa(self, il: int) -> bool:
        return bool(self.swa_layers) and self.swa_layers[il]

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out.pop("extra")
        return out


def _per_layer(value: Any, n_layer: int, key: str) -> tuple[int, ...]:
    """get_key_or_arr: a scalar repeated, or an array of exactly n_layer entries."""
    if value is None:
        return (0,) * n_layer
    if isinstance(value, (list, np.ndarray)):
        arr = [int(v) for v in value]
        if len(arr) != n_layer:
            raise GGUFError(f"{key} has {len(arr)} entries for {n_layer} layers")
        return tuple(arr)
    return (int(value),) * n_layer


def load_hparams(f: GGUFFile, arch: str) -> HParams:
    """llama_model::load_hparams for the general keys; arch files refine the rest."""
    def key(name: str) -> str:
        return f"{arch}.{name}"

    def req(name: str) -> Any:
        return f.require(key(name))

    n_layer = int(req("block_count"))
    if not 0 < n_layer <= 512:
        raise GGUFError(f"{f.path}: {key('block_count')} = {n_layer} is out of range")
    n_embd = int(req("embedding_length"))
    n_head_arr = _per_layer(f.get(key("attention.head_count")), n_layer, key("attention.head_count"))
    kv_raw = f.get(key("attention.head_count_kv"))
    n_head_kv_arr = n_head_arr if kv_raw is None else _per_layer(kv_raw, n_layer, key("attention.head_count_kv"))
    n_ff_arr = _per_layer(f.get(key("feed_forward_length")), n_layer, key("feed_forward_length"))
    n_head = n_head_arr[0]
    head_k = head_v = n_rot = 0
    if n_head > 0:
        if n_embd % n_head and key("attention.key_length") not in f.metadata:
            raise GGUFError(f"{f.path}: n_embd {n_embd} is not divisible by n_head {n_head}")
        head_k = int(f.get(key("attention.key_length"), n_embd // n_head))
        head_v = int(f.get(key("attention.value_length"), n_embd // n_head))
        n_rot = int(f.get(key("rope.dimension_count"), head_k))
    for il, (h, hkv) in enumerate(zip(n_head_arr, n_head_kv_arr)):
        if hkv and h % hkv:
            raise GGUFError(f"{f.path}: layer {il}: n_head {h} is not a multiple of n_head_kv {hkv}")

    scaling = str(f.get(key("rope.scaling.type"), "linear"))
    if scaling not in ROPE_SCALING_TYPES:
        raise GGUFError(f"{f.path}: unknown rope scaling type {scaling!r}")
    factor = float(f.get(key("rope.scaling.factor"), f.get(key("rope.scale_linear"), 0.0)) or 0.0)
    n_vocab = f.get(key("vocab_size"))
    if n_vocab is None:
        n_vocab = len(f.get("tokenizer.ggml.tokens") or [])
    n_ctx_train = int(req("context_length"))
    pooling = int(f.get(key("pooling_type"), -1))

    return HParams(
        arch=arch,
        n_vocab=int(n_vocab),
        n_ctx_train=n_ctx_train,
        n_embd=n_embd,
        n_layer=n_layer,
        n_ff_arr=n_ff_arr,
        n_head_arr=n_head_arr,
        n_head_kv_arr=n_head_kv_arr,
        n_embd_head_k=head_k,
        n_embd_head_v=head_v,
        n_rot=n_rot,
        f_norm_eps=float(f.get(key("attention.layer_norm_epsilon"), 0.0)),
        f_norm_rms_eps=float(f.get(key("attention.layer_norm_rms_epsilon"), 0.0)),
        rope_freq_base_train=float(f.get(key("rope.freq_base"), 10000.0)),
        rope_freq_scale_train=1.0 if factor == 0.0 else 1.0 / factor,
        rope_scaling_type_train=scaling,
        rope_attn_factor=float(f.get(key("rope.scaling.attn_factor"), 1.0)),
        rope_finetuned=bool(f.get(key("rope.scaling.finetuned"), False)),
        n_ctx_orig_yarn=int(f.get(key("rope.scaling.original_context_length"), n_ctx_train)),
        yarn_ext_factor=float(f.get(key("rope.scaling.yarn_ext_factor"), -1.0)),
        yarn_attn_factor=float(f.get(key("rope.scaling.yarn_attn_factor"), 1.0)),
        yarn_beta_fast=float(f.get(key("rope.scaling.yarn_beta_fast"), 32.0)),
        yarn_beta_slow=float(f.get(key("rope.scaling.yarn_beta_slow"), 1.0)),
        yarn_log_mul=float(f.get(key("rope.scaling.yarn_log_multiplier"), 0.0)),
        f_attention_scale=float(f.get(key("attention.scale"), 0.0)),
        causal_attn=bool(f.get(key("attention.causal"), True)),
        pooling_type=POOLING_TYPES.get(pooling, "unspecified"),
        n_expert=int(f.get(key("expert_count"), 0)),
        n_expert_used=int(f.get(key("expert_used_count"), 0)),
        n_swa=int(f.get(key("attention.sliding_window"), 0)),
        f_attn_logit_softcapping=float(f.get(key("attn_logit_softcapping"), 0.0)),
        f_final_logit_softcapping=float(f.get(key("final_logit_softcapping"), 0.0)),
        f_max_alibi_bias=float(f.get(key("attention.max_alibi_bias"), 0.0)),
    )
