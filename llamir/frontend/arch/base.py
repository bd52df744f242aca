"""The architecture interface and registry: one short file per architecture."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from llamir.frontend.hparams import HParams
from llamir.ir.ops import ROPE_NEOX, ROPE_NORM

ARCHS: dict[str, type[Architecture]] = {}


def register_arch(cls: type[Architecture]) -> type[Architecture]:
    ARCHS[cls.name] = cls
    return cls


@dataclass(frozen=True)
class TensorSpec:
    """A tensor the architecture reads: GGUF name, numpy-order shape, whether it must exist."""

    name: str
    shape: tuple[int, ...]
    required: bool = True


class ArchError(ValueError):
    """A model whose metadata or tensors do not fit its architecture."""


class Architecture(ABC):
    """Subclasses set `name` and `rope_type`, list their tensors, and build the graph."""

    name: ClassVar[str]
    rope_type: ClassVar[int] = ROPE_NORM
    # tensors llama.cpp's loader for this architecture reads (optionally) that llamir does not
    # implement; "{il}" stands for a layer index
    unimplemented_tensors: ClassVar[tuple[str, ...]] = ()

    def load_hparams(self, f, hp: HParams) -> None:
        """Arch-specific keys and checks (load_arch_hparams); the default needs an rms eps."""
        require_rms_eps(f, hp)
        require_rope_dims(f, hp)

    @abstractmethod
    def tensor_specs(self, hp: HParams) -> list[TensorSpec]:
        """The tensors this architecture loads (load_arch_tensors)."""

    def rope_freq_base(self, hp: HParams, rope, il: int) -> float:
        """The rope base of layer il (llama_model::get_rope_freq_base); SWA layers may differ."""
        return rope.freq_base

    @abstractmethod
    def build(self, g) -> None:
        """Build the decoder graph on a GraphContext `g`."""


def decoder_specs(hp: HParams, *, qk_norm: bool = False, out_bias: bool = False,
                  rope_freqs: bool = False) -> list[TensorSpec]:
    """The tensors of a llama-style decoder (llama.cpp load_arch_tensors for llama/qwen2/qwen3/gemma3):
    q/k/v biases are optional everywhere (create_tensor_qkv); the attention output bias and
    rope_freqs only where the architecture's loader creates them."""
    e, v = hp.n_embd, hp.n_vocab
    specs = [TensorSpec("token_embd.weight", (v, e)), TensorSpec("output_norm.weight", (e,)),
             TensorSpec("output.weight", (v, e), required=False)]
    for il in range(hp.n_layer):
        p = f"blk.{il}."
        n_q = hp.n_embd_head_k * hp.n_head(il)
        specs += [
            TensorSpec(p + "attn_norm.weight", (e,)),
            TensorSpec(p + "attn_q.weight", (n_q, e)),
            TensorSpec(p + "attn_k.weight", (hp.n_embd_k_gqa(il), e)),
            TensorSpec(p + "attn_v.weight", (hp.n_embd_v_gqa(il), e)),
            TensorSpec(p + "attn_output.weight", (e, hp.n_embd_head_v * hp.n_head(il))),
            TensorSpec(p + "ffn_norm.weight", (e,)),
            TensorSpec(p + "ffn_gate.weight", (hp.n_ff(il), e)),
            TensorSpec(p + "ffn_up.weight", (hp.n_ff(il), e)),
            TensorSpec(p + "ffn_down.weight", (e, hp.n_ff(il))),
        ]
        specs += [TensorSpec(p + f"attn_{x}.bias", (n,), required=False)
                  for x, n in (("q", n_q), ("k", hp.n_embd_k_gqa(il)), ("v", hp.n_embd_v_gqa(il)))]
        if out_bias:
            specs.append(TensorSpec(p + "attn_output.bias", (e,), required=False))
        if qk_norm:
            specs += [TensorSpec(p + "attn_q_norm.weight", (hp.n_embd_head_k,)),
                      TensorSpec(p + "attn_k_norm.weight", (hp.n_embd_head_k,))]
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


__all__ = ["ARCHS", "FUSED_QKV", "ROPE_NEOX", "ROPE_NORM", "ArchError", "Architecture", "TensorSpec", "decoder_specs",
           "register_arch", "require_rms_eps", "require_rope_dims"]
