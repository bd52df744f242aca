"""Mixture-of-experts ffn tensors for the llama family (llama.cpp load_arch_tensors of Mixtral-style
llama, qwen2moe, qwen3moe): a router and stacked experts in place of the dense ffn, optionally a
shared expert with its own sigmoid gate (qwen2moe)."""

from __future__ import annotations

import re

from llamir.frontend.arch.base import ArchError, TensorSpec

_DENSE_FFN = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.weight")


def expert_specs(hp, il: int, n_ff_exp: int, gate_required: bool = True) -> list[TensorSpec]:
    """Block il's router [n_expert, n_embd] (kept f32, as llama-quantize does) and its experts
    [n_expert, n_ff_exp, n_embd] (gate, up) and [n_expert, n_embd, n_ff_exp] (down)."""
    p, e, n = f"blk.{il}.", hp.n_embd, hp.n_expert
    return [TensorSpec(p + "ffn_gate_inp.weight", (n, e), storage="f32"),
            TensorSpec(p + "ffn_gate_exps.weight", (n, n_ff_exp, e), required=gate_required, synth=True),
            TensorSpec(p + "ffn_down_exps.weight", (n, e, n_ff_exp)),
            TensorSpec(p + "ffn_up_exps.weight", (n, n_ff_exp, e))]


def shared_expert_specs(hp, il: int, n_ff_shexp: int) -> list[TensorSpec]:
    """qwen2moe's shared expert and its gate vector [n_embd] (a projection, drawn as a matrix row)."""
    p, e = f"blk.{il}.", hp.n_embd
    return [TensorSpec(p + "ffn_gate_inp_shexp.weight", (e,), init="matrix"),
            TensorSpec(p + "ffn_gate_shexp.weight", (n_ff_shexp, e)),
            TensorSpec(p + "ffn_down_shexp.weight", (e, n_ff_shexp)),
            TensorSpec(p + "ffn_up_shexp.weight", (n_ff_shexp, e))]


def with_experts(specs: list[TensorSpec], block_specs) -> list[TensorSpec]:
    """decoder_specs' list with each block's dense ffn_gate/up/down replaced by block_specs(il)."""
    out: list[TensorSpec] = []
    for spec in specs:
        dense = _DENSE_FFN.fullmatch(spec.name)
        if dense is None:
            out.append(spec)
        elif dense[2] == "gate":
            out += block_specs(int(dense[1]))
    return out


def load_expert_hparams(f, hp, *keys: str) -> None:
    """The expert ffn widths the loader reads ("exp", "shexp"), and llama.cpp's refusal of a model
    without experts."""
    meta = f.metadata
    if "exp" in keys:
        hp.n_ff_exp = meta.get_u32(f"{hp.arch}.expert_feed_forward_length", 0)
    if "shexp" in keys:
        hp.n_ff_shexp = meta.get_u32(f"{hp.arch}.expert_shared_feed_forward_length", 0)
    for what, n in (("n_expert", hp.n_expert), ("n_expert_used", hp.n_expert_used)):
        if n == 0:
            raise ArchError(f"{f.path}: {what} must be > 0 for {hp.arch.upper()}")
    if hp.n_rot != hp.n_embd_head_k:   # GGML_ASSERT(n_embd_head == n_rot) in the graph
        raise ArchError(f"{f.path}: {hp.arch} needs rope.dimension_count {hp.n_rot} == the head size "
                        f"{hp.n_embd_head_k} (llama.cpp aborts)")


def n_ff_exp(hp, il: int) -> int:
    """An expert's width: expert_feed_forward_length, else n_ff / n_expert_used (as llama.cpp)."""
    return hp.n_ff_exp or hp.n_ff(il) // hp.n_expert_used


__all__ = ["expert_specs", "load_expert_hparams", "n_ff_exp", "shared_expert_specs", "with_experts"]
