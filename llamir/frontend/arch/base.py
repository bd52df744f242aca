"""The architecture interface and registry: one short file per architecture."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from llamir.frontend.hparams import ArchHParams, HParams
from llamir.ir.ops import ROPE_NEOX, ROPE_NORM

# LLAMA_ROPE_TYPE_NONE: an architecture without rope (gpt2); a K-shift then moves positions only
ROPE_NONE = -1

ARCHS: dict[str, type[Architecture]] = {}


def register_arch(cls: type[Architecture]) -> type[Architecture]:
    ARCHS[cls.name] = cls
    return cls


# Attention logits scale with the q and k gains squared; ~1.5 each gives scores with std ~2.
QK_GAIN = 1.5
# How synth draws a random tensor (synth._INIT has one function for each): a matrix N(0, 1) *
# gain / sqrt(fan_in), so each projection keeps an O(1) input O(1); a norm (or any multiplicative
# vector) gain + N(0, 0.1); a bias 0.2 * gain * N(0, 1); the token embedding N(0, 1) * gain.
INIT_RULES = ("matrix", "norm", "bias", "embedding")
# What a tensor is stored as: the model's matrix dtype (the one quantized), the embedding's, or f32.
STORAGES = ("weight", "embd", "f32")


@dataclass(frozen=True)
class TensorSpec:
    """A tensor the architecture reads: GGUF name, numpy-order shape, whether it must exist, and how
    synth writes a random one: the `init` rule (INIT_RULES; "" = chosen by the name) times `gain`,
    stored as `storage` (STORAGES; "" = weight for a matrix, f32 otherwise), written when `synth`
    (None = when required)."""

    name: str
    shape: tuple[int, ...]
    required: bool = True
    init: str = ""
    gain: float = 1.0
    storage: str = ""
    synth: bool | None = None

    def __post_init__(self) -> None:
        if self.init not in ("", *INIT_RULES):
            raise ValueError(f"tensor {self.name!r}: init {self.init!r} is not one of {INIT_RULES}")
        if self.storage not in ("", *STORAGES):
            raise ValueError(f"tensor {self.name!r}: storage {self.storage!r} is not one of {STORAGES}")

    @property
    def init_rule(self) -> str:
        """The init rule, by the name when none is given: biases, norms, the token embedding, matrices."""
        if self.init:
            return self.init
        stem = self.name.rsplit(".", 1)
        if stem[-1] == "bias":
            return "bias"
        if stem[0].endswith("norm") or len(self.shape) == 1:
            return "norm"
        return "embedding" if self.name == "token_embd.weight" else "matrix"

    @property
    def storage_kind(self) -> str:
        if self.storage:
            return self.storage
        if self.name == "token_embd.weight":
            return "embd"
        return "weight" if len(self.shape) >= 2 else "f32"

    @property
    def in_synth(self) -> bool:
        """Whether a synthetic model of the architecture has this tensor."""
        return self.required if self.synth is None else self.synth


class ArchError(ValueError):
    """A model whose metadata or tensors do not fit its architecture."""


class Architecture(ABC):
    """Subclasses set `name` and `rope_type`, list their tensors, and build the graph."""

    name: ClassVar[str]
    rope_type: ClassVar[int] = ROPE_NORM
    # False for a model without attention heads (mamba): synth writes head counts of 0
    has_attention: ClassVar[bool] = True
    # tensors llama.cpp's loader for this architecture reads (optionally) that llamir does not
    # implement; "{il}" stands for a layer index
    unimplemented_tensors: ClassVar[tuple[str, ...]] = ()
    # llama_model_has_encoder: a separate encoder graph (t5) whose output encode() keeps for the
    # decoder graph's cross-attention; decode() then needs an encode first
    has_encoder: ClassVar[bool] = False

    def load_hparams(self, f, hp: HParams) -> None:
        """Arch-specific keys and checks (load_arch_hparams); the default needs an rms eps."""
        require_rms_eps(f, hp)
        require_rope_dims(f, hp)

    @abstractmethod
    def tensor_specs(self, hp: HParams) -> list[TensorSpec]:
        """The tensors this architecture loads (load_arch_tensors)."""

    def create_memory(self, hp: HParams, causal: bool = True) -> str:
        """llama_model::create_memory's choice, as the kind of memory the context makes
        (llamir.context.memory.MEMORY_KINDS): none for a non-causal encoder, the iSWA pair of
        caches when layers have a sliding window, else one unified KV cache."""
        if not causal:
            return "none"
        return "kv_iswa" if hp.n_swa and any(hp.swa_layers) else "kv"

    def recurrent_layout(self, hp: HParams, size: int):
        """The recurrent state of a "recurrent" memory (llama_hparams::n_embd_r / n_embd_s and
        the recurrent layers): a graph_rs.RSLayout of `size` cells."""
        raise ArchError(f"{self.name} keeps no recurrent state")

    def rope_freq_base(self, hp: HParams, rope, il: int) -> float:
        """The rope base of layer il (llama_model::get_rope_freq_base); SWA layers may differ."""
        return rope.freq_base

    @abstractmethod
    def build(self, g) -> None:
        """Build the decoder graph on a GraphContext `g`."""

    # -- synthetic models (llamir.frontend.synth) ---------------------------------------------
    # the SynthSpec fields only some architectures take, which this one does
    synth_options: ClassVar[frozenset[str]] = frozenset()
    # values of those fields a synthetic model of this architecture needs (an MoE's expert counts),
    # taken when the SynthSpec leaves the field at its default
    synth_defaults: ClassVar[dict[str, object]] = {}

    def synth_check(self, spec) -> None:
        """Refuse a SynthSpec this architecture cannot be written with (a ValueError naming it)."""
        return None

    def synth_kv_heads(self, spec) -> tuple[int, ...]:
        """head_count_kv of each layer of a synthetic model (a hybrid model's are 0 where the
        layer is recurrent)."""
        return (spec.n_head_kv if self.has_attention else 0,) * spec.n_layer

    def synth_name(self, spec) -> str:
        """general.name of a synthetic model."""
        return f"synth-{spec.arch}-{spec.dtype}"

    def synth_metadata(self, w, spec) -> None:
        """Write this architecture's own hparam keys of `spec` with the gguf.GGUFWriter `w`."""
        return None

    def synth_extra(self, spec) -> ArchHParams:
        """hp.extra of the model `spec` describes, as load_hparams would set it (what tensor_specs
        reads of it)."""
        return ArchHParams()


def decoder_specs(hp: HParams, *, qkv_bias: bool = False, qk_norm: bool = False, out_bias: bool = False,
                  post_norms: bool = False, rope_freqs: bool = False, embd_gain: float = 1.0) -> list[TensorSpec]:
    """The tensors of a llama-style decoder (llama.cpp load_arch_tensors for llama/qwen2/qwen3/gemma3),
    in the order of the block: q/k/v biases are optional everywhere (create_tensor_qkv; synth writes
    them with qkv_bias); the attention output bias and rope_freqs only where the architecture's loader
    creates them. With qk_norm the score gain is in the q/k norms, else in the q/k matrices."""
    e, v = hp.n_embd, hp.n_vocab
    # gain 3: logits with a std of ~3 (tied models get std ~sqrt(n_embd) from the O(1) embedding)
    specs = [TensorSpec("token_embd.weight", (v, e), gain=embd_gain), TensorSpec("output_norm.weight", (e,)),
             TensorSpec("output.weight", (v, e), required=False, gain=3.0, synth=True)]
    qk_gain = 1.0 if qk_norm else QK_GAIN
    for il in range(hp.n_layer):
        p, n_q, n_k, n_v = f"blk.{il}.", hp.n_embd_head_k * hp.n_head(il), hp.n_embd_k_gqa(il), hp.n_embd_v_gqa(il)
        specs += [TensorSpec(p + "attn_norm.weight", (e,)), TensorSpec(p + "attn_q.weight", (n_q, e), gain=qk_gain),
                  TensorSpec(p + "attn_k.weight", (n_k, e), gain=qk_gain), TensorSpec(p + "attn_v.weight", (n_v, e))]
        specs += [TensorSpec(p + f"attn_{x}.bias", (n,), required=False, synth=qkv_bias)
                  for x, n in (("q", n_q), ("k", n_k), ("v", n_v))]
        if qk_norm:
            specs += [TensorSpec(p + f"attn_{x}_norm.weight", (hp.n_embd_head_k,), gain=QK_GAIN) for x in "qk"]
        specs.append(TensorSpec(p + "attn_output.weight", (e, hp.n_embd_head_v * hp.n_head(il))))
        if out_bias:
            specs.append(TensorSpec(p + "attn_output.bias", (e,), required=False))
        if post_norms:
            specs += [TensorSpec(p + f"{x}.weight", (e,), gain=0.5) for x in ("post_attention_norm", "post_ffw_norm")]
        f = hp.n_ff(il)
        specs += [TensorSpec(p + "ffn_norm.weight", (e,)), TensorSpec(p + "ffn_gate.weight", (f, e)),
                  TensorSpec(p + "ffn_up.weight", (f, e)), TensorSpec(p + "ffn_down.weight", (e, f))]
    if rope_freqs:
        specs.append(TensorSpec("rope_freqs.weight", (hp.n_rot // 2,), required=False))
    return specs


def require_rms_eps(f, hp: HParams) -> None:
    """get_key(LLM_KV_ATTENTION_LAYERNORM_RMS_EPS), required, f32. ggml's rms_norm asserts eps >= 0
    (llama.cpp loads a NaN or negative eps, then aborts at its first decode), so it is refused here."""
    key = f"{hp.arch}.attention.layer_norm_rms_epsilon"
    eps = f.metadata.get_f32(key, required=True)
    if not eps >= 0.0:
        raise ArchError(f"{f.path}: {key} = {eps}: ggml's rms_norm needs eps >= 0 (llama.cpp aborts on it)")
    hp.f_norm_rms_eps = eps


FUSED_QKV = ("blk.{il}.attn_qkv.weight", "blk.{il}.attn_qkv.bias")

def require_rope_dims(f, hp: HParams) -> None:
    """ggml's rope asserts an even n_dims within the head size (llama.cpp loads such a file, then
    aborts at its first decode); llamir's rope_ext also needs at least one rotated pair."""
    if not (hp.n_rot % 2 == 0 and 0 < hp.n_rot <= hp.n_embd_head_k):
        raise ArchError(f"{f.path}: {hp.arch}.rope.dimension_count = {hp.n_rot}: rope needs an even count in "
                        f"(0, {hp.n_embd_head_k}], the head size (llama.cpp aborts at its first decode)")


__all__ = ["ARCHS", "FUSED_QKV", "INIT_RULES", "QK_GAIN", "ROPE_NEOX", "ROPE_NORM", "STORAGES", "ArchError",
           "Architecture", "TensorSpec", "decoder_specs", "register_arch", "require_rms_eps", "require_rope_dims"]
