"""Context parameters (llama_context_params) and their resolution into cparams, as
llama_context's constructor does it: defaults, padding, caps and the checks that refuse."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, replace

from llamir.context.batch import LLAMA_MAX_SEQ
from llamir.frontend.graph_context import RopeParams
from llamir.frontend.hparams import HParams
from llamir.ir import F16, DType, dtype_named

log = logging.getLogger("llamir")


class ContextParamsError(ValueError):
    """Context parameters llama.cpp would refuse; the message says which and why."""


def pad(x: int, n: int) -> int:
    return (x + n - 1) // n * n


@dataclass(frozen=True)
class ContextParams:
    """What the user asks for. 0 / negative / None mean "llama.cpp's default" as in llama.h."""

    n_ctx: int = 512
    n_batch: int = 2048
    n_ubatch: int = 512
    n_seq_max: int = 1
    n_threads: int = 0                # 0: the CPU backend's own count (the CPUs this process may use)
    kv_unified: bool = False
    type_k: DType | str = F16
    type_v: DType | str = F16
    flash_attn: str = "auto"         # "auto" | "on" | "off"
    embeddings: bool = False
    pooling_type: str = "unspecified"
    attention_type: str = "unspecified"   # "causal" | "non-causal"
    rope_scaling_type: str = ""
    rope_freq_base: float = 0.0
    rope_freq_scale: float = 0.0
    yarn_ext_factor: float = -1.0
    yarn_attn_factor: float = -1.0
    yarn_beta_fast: float = -1.0
    yarn_beta_slow: float = -1.0
    yarn_orig_ctx: int = 0
    op_offload: bool = True
    offload_kqv: bool = True
    swa_full: bool = True
    no_perf: bool = True


@dataclass(frozen=True)
class CParams:
    """The resolved parameters a context runs with (llama_cparams)."""

    n_ctx: int
    n_ctx_seq: int
    n_batch: int
    n_ubatch: int
    n_seq_max: int
    n_threads: int
    kv_unified: bool
    type_k: DType
    type_v: DType
    flash_attn: bool
    auto_fa: bool
    embeddings: bool
    pooling_type: str
    causal_attn: bool
    rope: RopeParams
    op_offload: bool
    offload_kqv: bool
    swa_full: bool
    no_perf: bool
    graph_reuse: bool
    attn_rot: bool = True     # a quantized KV cache may be Hadamard-rotated (off: LLAMA_ATTN_ROT_DISABLE)

    def with_flash_attn(self, on: bool) -> CParams:
        return replace(self, flash_attn=on, auto_fa=False)


def resolve(p: ContextParams, hp: HParams) -> CParams:
    """llama_context::llama_context's parameter handling, step for step."""
    n_seq_max = max(1, p.n_seq_max)
    if n_seq_max > LLAMA_MAX_SEQ:
        raise ContextParamsError(f"n_seq_max must be <= {LLAMA_MAX_SEQ}, got {p.n_seq_max}")
    pooling = p.pooling_type
    if pooling == "unspecified":
        pooling = "none" if hp.pooling_type == "unspecified" else hp.pooling_type
    elif hp.pooling_type not in ("unspecified", pooling):
        log.warning("pooling type %s differs from the model's %s", pooling, hp.pooling_type)
    if p.attention_type not in ("unspecified", "causal", "non-causal"):
        raise ContextParamsError(f"attention_type must be causal or non-causal, got {p.attention_type!r}")
    causal = hp.causal_attn if p.attention_type == "unspecified" else p.attention_type == "causal"
    if p.flash_attn not in ("auto", "on", "off"):
        raise ContextParamsError(f"flash_attn must be auto, on or off, got {p.flash_attn!r}")
    n_ctx = p.n_ctx if p.n_ctx > 0 else hp.n_ctx_train
    n_batch = min(n_ctx, p.n_batch) if causal else p.n_batch
    if n_batch <= 0:
        raise ContextParamsError(f"n_batch must be positive, got {p.n_batch}")
    n_ubatch = min(n_batch, p.n_ubatch if p.n_ubatch > 0 else n_batch)
    n_ctx = pad(n_ctx, 256)
    if p.kv_unified:
        n_ctx_seq = n_ctx
    else:
        n_ctx_seq = pad(n_ctx // n_seq_max, 256)
        if n_ctx != n_ctx_seq * n_seq_max:
            n_ctx = n_ctx_seq * n_seq_max
            log.warning("n_ctx is not divisible by n_seq_max - rounding down to %d", n_ctx)
    type_k = dtype_named(p.type_k) if isinstance(p.type_k, str) else p.type_k
    type_v = dtype_named(p.type_v) if isinstance(p.type_v, str) else p.type_v
    for what, t in (("K", type_k), ("V", type_v)):
        if t.is_int:
            raise ContextParamsError(f"the {what} cache cannot be of type {t}")
    flash_mode = p.flash_attn
    if type_v.is_quantized and flash_mode != "on":  # llama_init_from_model's order of checks
        if flash_mode == "off":
            raise ContextParamsError("quantized V cache requires flash_attn to be enabled")
        log.info("enabling flash_attn since it is required for quantized V cache")
        flash_mode = "on"
    if flash_mode != "off":
        for what, t, head in (("K", type_k, hp.n_embd_head_k), ("V", type_v, hp.n_embd_head_v)):
            if t.is_quantized and head % t.block_size:
                raise ContextParamsError(f"{what} cache type {t} with block size {t.block_size} does not divide "
                                         f"n_embd_head_{what.lower()}={head}")
    flash = flash_mode != "off"
    rope = RopeParams.resolve(hp, p.rope_freq_base, p.rope_freq_scale, p.rope_scaling_type,
                              p.yarn_ext_factor, p.yarn_attn_factor, p.yarn_beta_fast, p.yarn_beta_slow,
                              p.yarn_orig_ctx)
    reuse_env = os.environ.get("LLAMIR_GRAPH_REUSE_DISABLE")
    graph_reuse = not (reuse_env and reuse_env.strip() not in ("", "0"))
    attn_rot = not c_atoi(os.environ.get("LLAMA_ATTN_ROT_DISABLE", "0"))   # llama_kv_cache reads it so
    if not attn_rot:
        log.warning("attention rotation force disabled (LLAMA_ATTN_ROT_DISABLE)")
    return CParams(
        n_ctx=n_ctx, n_ctx_seq=n_ctx_seq, n_batch=n_batch, n_ubatch=n_ubatch, n_seq_max=n_seq_max,
        n_threads=max(0, p.n_threads), kv_unified=p.kv_unified, type_k=type_k, type_v=type_v,
        flash_attn=flash, auto_fa=flash_mode == "auto", embeddings=p.embeddings, pooling_type=pooling,
        causal_attn=causal, rope=rope, op_offload=p.op_offload, offload_kqv=p.offload_kqv,
        swa_full=p.swa_full, no_perf=p.no_perf, graph_reuse=graph_reuse, attn_rot=attn_rot)


def c_atoi(text: str) -> int:
    """C's atoi: leading whitespace, an optional sign, then digits; anything else ends it (0 if none)."""
    m = re.match(r"[ \t\n\v\f\r]*([+-]?[0-9]+)", text)
    return int(m.group(1)) if m else 0
