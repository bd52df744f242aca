"""Model hyper-parameters read from GGUF metadata with llama.cpp's keys and defaults
(src/llama-model.cpp, load_hparams)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from llamir.frontend.gguf_file import GGUFFile
from llamir.frontend.gguf_meta import LLAMA_MAX_LAYERS, GGUFType, MetadataError

ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")
POOLING_TYPES = {-1: "unspecified", 0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}
SWA_TYPES = ("none", "standard", "chunked", "symmetric")
LLAMA_MAX_EXPERTS = 1024


@dataclass(frozen=True)
class ArchHParams:
    """The hyper-parameters only one architecture has (hp.extra): the architecture defines a frozen
    subclass, sets it in its load_hparams and writes its keys for synth (synth_metadata)."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class HParams:
    """llama_hparams, with per-layer arrays as tuples of length n_layer: what every architecture
    has, the sliding-window layout the KV cache reads included; the rest is in `extra`."""

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
    n_ff_exp: int = 0      # an expert's ffn width ({arch}.expert_feed_forward_length; 0 = unset)
    n_ff_shexp: int = 0    # the shared expert's ({arch}.expert_shared_feed_forward_length; 0 = unset)
    n_swa: int = 0
    swa_type: str = "none"
    swa_layers: tuple[bool, ...] = ()
    f_attn_logit_softcapping: float = 0.0
    f_max_alibi_bias: float = 0.0
    extra: ArchHParams = field(default_factory=ArchHParams)

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
        return out | self.extra.to_dict()

    def load_sliding_window(self, meta, n_pattern: int, swa_type: str = "standard") -> bool:
        """{arch}.attention.sliding_window and, when it is set, the layers that use it
        ({arch}.attention.sliding_window_pattern, a period or per-layer flags); False when unset."""
        key = f"{self.arch}.attention.sliding_window"
        n_swa = meta.get_u32(key)
        if n_swa:
            self.n_swa, self.swa_type = n_swa, swa_type
            self.load_swa_pattern(meta, key + "_pattern", n_pattern)
        return bool(n_swa)

    def load_swa_pattern(self, meta, key: str, n_pattern: int, dense_first: bool = False) -> None:
        """load_swa_pattern: a per-layer array under `key` (layers past its end are dense), or a u32
        period (n_pattern when absent)."""
        layers = meta.get_u32_arr(key)
        if layers is not None:
            self.swa_layers = (tuple(bool(x) for x in layers[:self.n_layer])
                               + (False,) * (self.n_layer - len(layers)))
        else:
            self.set_swa_pattern(meta.get_u32(key, n_pattern), dense_first)


def load_hparams(f: GGUFFile, arch: str) -> HParams:
    """llama_model_base::load_hparams: the keys every architecture reads, with llama.cpp's types
    (gguf_meta) and its asserts as errors; arch files read the rest (load_arch_hparams)."""
    meta = f.metadata

    def key(name: str) -> str:
        return f"{arch}.{name}"

    meta.get_str("general.name")
    n_ctx_train = meta.get_u32(key("context_length"), required=True)
    n_embd = meta.get_u32(key("embedding_length"), required=True)
    meta.get_u32(key("embedding_length_out"))
    causal_attn = meta.get_bool(key("attention.causal"), True)
    pooling = meta.get_u32(key("pooling_type"), -1)
    meta.get_u32(key("classifier.pooling_type"))
    n_layer_all = meta.get_u32(key("block_count"), required=True)
    _require(f, 0 < n_layer_all <= LLAMA_MAX_LAYERS, f"{key('block_count')} = {n_layer_all}: llama.cpp needs "
             f"0 < n_layer <= {LLAMA_MAX_LAYERS}")
    n_layer_nextn = meta.get_u32(key("nextn_predict_layers"), 0)
    _require(f, n_layer_nextn <= n_layer_all, f"{key('nextn_predict_layers')} = {n_layer_nextn} is more than "
             f"the {n_layer_all} layers")
    n_expert, n_expert_used = _load_experts(f, arch, n_layer_all)

    n_ff_arr = meta.get_u32_or_arr(key("feed_forward_length"), n_layer_all, (0,) * n_layer_all)
    n_head_arr = meta.get_u32_or_arr(key("attention.head_count"), n_layer_all, (0,) * n_layer_all)
    n_head_kv_arr = meta.get_u32_or_arr(key("attention.head_count_kv"), n_layer_all, n_head_arr)
    rope_finetuned = meta.get_bool(key("rope.scaling.finetuned"), False)
    n_ctx_orig_yarn = meta.get_u32(key("rope.scaling.original_context_length"), n_ctx_train)
    rope_freq_base = meta.get_f32(key("rope.freq_base"), 10000.0)
    scaling = meta.get_str(key("rope.scaling.type"), "linear")
    _require(f, scaling in ROPE_SCALING_TYPES, f"{key('rope.scaling.type')} = {scaling!r} is not one of "
             f"{', '.join(ROPE_SCALING_TYPES)}")
    factor = meta.get_f32(key("rope.scaling.factor"))
    if factor is None:
        factor = meta.get_f32(key("rope.scale_linear"), 0.0)
    rope_attn_factor = meta.get_f32(key("rope.scaling.attn_factor"), 1.0)
    meta.get_f32(key("rope.scaling.alpha"))

    head_k, head_v, n_rot = _load_head_sizes(f, arch, n_embd, n_head_arr, n_head_kv_arr)
    meta.get_arr(key("classifier.output_labels"), (GGUFType.STRING,), non_array_missing=True)
    n_layer = n_layer_all - n_layer_nextn
    return HParams(
        arch=arch, n_vocab=0, n_ctx_train=n_ctx_train, n_embd=n_embd, n_layer=n_layer,
        n_ff_arr=n_ff_arr[:n_layer], n_head_arr=n_head_arr[:n_layer], n_head_kv_arr=n_head_kv_arr[:n_layer],
        n_embd_head_k=head_k, n_embd_head_v=head_v, n_rot=n_rot,
        rope_freq_base_train=rope_freq_base,
        # f32 arithmetic, as llama.cpp's 1.0f/ropescale
        rope_freq_scale_train=1.0 if factor == 0.0 else float(np.float32(1.0) / np.float32(factor)),
        rope_scaling_type_train=scaling, rope_attn_factor=rope_attn_factor, rope_finetuned=rope_finetuned,
        n_ctx_orig_yarn=n_ctx_orig_yarn, causal_attn=causal_attn,
        pooling_type=POOLING_TYPES.get(pooling, "unspecified"), n_expert=n_expert,
        n_expert_used=max(n_expert_used[:n_layer], default=0),
    )


def _load_head_sizes(f: GGUFFile, arch: str, n_embd: int, n_head_arr: tuple[int, ...],
                     n_head_kv_arr: tuple[int, ...]) -> tuple[int, int, int]:
    """The key/value head sizes and n_rot (read only when there are heads, as llama.cpp does)."""
    meta = f.metadata
    head_k = head_v = n_rot = 0
    if n_head_arr[0] > 0:
        head_k = meta.get_u32(f"{arch}.attention.key_length", n_embd // n_head_arr[0])
        head_v = meta.get_u32(f"{arch}.attention.value_length", n_embd // n_head_arr[0])
        n_rot = meta.get_u32(f"{arch}.rope.dimension_count", head_k)
    for name in ("attention.key_length_swa", "attention.value_length_swa", "rope.dimension_count_swa"):
        meta.get_u32(f"{arch}.{name}")
    for il, (h, hkv) in enumerate(zip(n_head_arr, n_head_kv_arr, strict=True)):
        # ggml's mul_mat broadcasts KV heads over query heads only by whole multiples (llama.cpp
        # loads such a file and aborts when it builds the attention)
        # (n_head_kv 0: a layer without attention, as a hybrid model's recurrent layers)
        _require(f, hkv == 0 or (h > 0 and h % hkv == 0),
                 f"layer {il}: n_head {h} is not a multiple of n_head_kv {hkv}")
    return head_k, head_v, n_rot


def _load_experts(f: GGUFFile, arch: str, n_layer: int) -> tuple[int, tuple[int, ...]]:
    """The expert counts and llama.cpp's GGML_ASSERTs on them (which abort llama.cpp)."""
    meta = f.metadata
    n_expert = meta.get_u32(f"{arch}.expert_count", 0)
    used = meta.get_u32_or_arr(f"{arch}.expert_used_count", n_layer, (0,) * n_layer)
    n_groups = meta.get_u32(f"{arch}.expert_group_count", 0)
    n_group_used = meta.get_u32(f"{arch}.expert_group_used_count", 0)
    used_max = max(used)
    what = (f"{arch}.expert_count = {n_expert}, expert_used_count = {used_max}, expert_group_count = {n_groups}, "
            f"expert_group_used_count = {n_group_used}")
    ok = n_expert <= LLAMA_MAX_EXPERTS and used_max <= n_expert
    if n_expert > 0:
        ok = ok and used_max > 0 and n_groups < n_expert
        if n_groups > 1:
            ok = ok and n_expert % n_groups == 0 and 0 < n_group_used < n_groups
    else:
        ok = ok and used_max == 0 and n_groups == 0
    _require(f, ok, f"{what}: inconsistent expert counts (llama.cpp asserts and aborts)")
    return n_expert, used


def _require(f: GGUFFile, ok: bool, message: str) -> None:
    if not ok:
        raise MetadataError(f"{f.path}: {message}")
