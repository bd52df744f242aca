"""Attention kernels: rope_ext, soft_max_ext, flash_attn_ext, and llamir's fused soft_max_attn.

The scalars ggml derives on the host are derived here the same way (rope's theta_scale, YaRN's
correction dims and mscale, ALiBi's m0/m1/n_head_log2) and passed as params; the shaders do the
per-element work.
"""

from __future__ import annotations

import math

import numpy as np

from llamir.ir import BF16, ggml_math, ops, rope_corr_dims
from llamir_vulkan import lowering
from llamir_vulkan.lowering import Params, float_type, groups_for, is_float, kernel

ROPE_WG = 256
SOFT_MAX_WG = 256
ATTN_WG = 128
ATTN_MAX_HEAD = 1024    # the largest dk/dv the flash_attn tiles fit in shared memory with
ATTN_KV_TILE = 4096     # floats of shared memory for a K/V tile (16 KiB)
ATTN_Q_TILE = 2048      # floats of shared memory for the query rows (8 KiB)
ATTN_MAX_ACC = 16       # output accumulators per thread (registers)
f32 = np.float32

# K/V storage: dtype -> (GLSL storage type, flash_attn_kv.glsl format)
KV_FORMATS = {
    "f32": ("float", "KV_FLOAT"), "f16": ("float16_t", "KV_FLOAT"), "bf16": ("uint16_t", "KV_BF16"),
    "q4_0": ("uint8_t", "KV_Q4_0"), "q4_1": ("uint8_t", "KV_Q4_1"), "q5_0": ("uint8_t", "KV_Q5_0"),
    "q5_1": ("uint8_t", "KV_Q5_1"), "q8_0": ("uint8_t", "KV_Q8_0"),
}


def _alibi(params: Params, max_bias: float, n_head: int) -> Params:
    """max_bias, m0, m1, n_head_log2 as ggml's soft_max and flash_attn_ext compute them (the slope
    of each head is derived from them in soft_max_alibi.glsl)."""
    n_head_log2 = 1 << int(math.floor(math.log2(n_head)))
    m0 = ggml_math.powf(f32(2.0), -f32(max_bias) / f32(n_head_log2))
    m1 = ggml_math.powf(f32(2.0), -(f32(max_bias) / f32(2)) / f32(n_head_log2))
    return params.f32(max_bias, float(m0), float(m1)).u32(n_head_log2)


def _tensors(node, srcs, dst) -> list:
    return [(i.type, td, False) for i, td in zip(node.inputs, srcs)] + [(node.type, dst, True)]


# -- rope ------------------------------------------------------------------------------------------
def _rope_ok(node) -> bool:
    x = node.inputs[0]
    return is_float(x.type) and node.dtype == x.dtype


@kernel(ops.RopeExt, supports=_rope_ok)
def rope_ext(k, node, srcs, dst) -> None:
    """ggml_rope_ext (NORM and NEOX, YaRN, freq factors, n_dims below the head size), f32 or f16 x,
    possibly a strided view: one thread per pair of elements (shaders/rope.comp)."""
    op = node.op
    x = node.inputs[0]
    theta_scale = ggml_math.powf(f32(op.freq_base), f32(-2.0) / f32(op.n_dims))
    low, high = rope_corr_dims(op.n_dims, op.n_ctx_orig, op.freq_base, op.beta_fast, op.beta_slow)
    mscale = f32(op.attn_factor)
    if op.ext_factor != 0.0:
        mscale = mscale * np.ravel(ggml_math.fma(f32(0.1), ggml_math.logf(f32(1) / f32(op.freq_scale)), f32(1)))[0]
    params = Params().u32(op.n_dims).f32(float(theta_scale), op.freq_scale, op.ext_factor, float(mscale), low, high)
    defines = {"X_TYPE": float_type(x.dtype), "NEOX": int(op.mode == ops.ROPE_NEOX), "HAS_FF": int(op.freq_factors),
               "WG": ROPE_WG}
    head = int(x.type.shape[-1])
    n_threads = (head + 1) // 2 * (node.type.numel // head)
    k.dispatch("rope", defines, _tensors(node, srcs, dst), params, groups_for(-(-n_threads // ROPE_WG)), node.name)


# -- soft_max ----------------------------------------------------------------------------------------
def _soft_max_ok(node) -> bool:
    x = node.inputs[0]
    return x.dtype.name == "f32" and node.dtype.name == "f32" and (not node.op.mask or is_float(node.inputs[1].type))


@kernel(ops.SoftMaxExt, supports=_soft_max_ok)
def soft_max_ext(k, node, srcs, dst) -> None:
    """ggml_soft_max_ext: scale, an f32/f16 mask repeated over heads and streams, ALiBi slopes,
    sinks; one workgroup per row (shaders/soft_max.comp)."""
    op = node.op
    x = node.inputs[0]
    defines = {"HAS_MASK": int(op.mask), "HAS_SINKS": int(op.sinks), "WG": SOFT_MAX_WG}
    if op.mask:
        defines["M_TYPE"] = float_type(node.inputs[1].dtype)
    n_head = int(x.type.shape[-3]) if x.type.rank >= 3 else 1
    params = _alibi(Params().f32(op.scale), op.max_bias, n_head)
    n_rows = node.type.numel // int(x.type.shape[-1])
    k.dispatch("soft_max", defines, _tensors(node, srcs, dst), params, groups_for(n_rows), node.name)


# -- attention --------------------------------------------------------------------------------------
def _kv_ok(ttype) -> bool:
    """A K/V type the shader reads: bf16 only while lowering indexes it in 2-byte elements (its
    numpy dtype is uint8 bytes, which makes unit_of count bf16 strides in bytes)."""
    if ttype.dtype == BF16:
        return lowering.unit_of(ttype) == 2
    return ttype.dtype.name in KV_FORMATS


def _attn_ok(node) -> bool:
    q, kt, vt = node.inputs[:3]
    heads = (q.type.shape[-1], node.type.shape[-1])
    return (q.dtype.name == "f32" and _kv_ok(kt.type) and _kv_ok(vt.type)
            and (not node.op.mask or is_float(node.inputs[3].type))
            and all(isinstance(d, int) and d <= ATTN_MAX_HEAD for d in heads))


def _attention(k, node, srcs, dst, softcap: float, soft_max_attn: bool) -> None:
    """The flash_attn shader for flash_attn_ext (soft_max_attn=False) or soft_max_attn: tiles sized
    to the head sizes, one workgroup per BR query rows of a KV head and stream."""
    op = node.op
    q, kt, vt = node.inputs[:3]
    n_s, n_head, n_tok, dk = (int(d) for d in q.type.shape)
    n_kv_head = int(kt.type.shape[1])
    dv = int(node.type.shape[-1])
    br = max(1, min(16, ATTN_Q_TILE // dk, ATTN_MAX_ACC * ATTN_WG // dv))
    bc = max(1, min(32, ATTN_KV_TILE // max(dk, dv)))
    (k_type, k_format), (v_type, v_format) = KV_FORMATS[kt.dtype.name], KV_FORMATS[vt.dtype.name]
    defines = {"DK": dk, "DV": dv, "BR": br, "BC": bc, "ACC_N": -(-br * dv // ATTN_WG), "WG": ATTN_WG,
               "K_TYPE": k_type, "K_FORMAT": k_format, "V_TYPE": v_type, "V_FORMAT": v_format,
               "HAS_MASK": int(op.mask), "HAS_SINKS": int(op.sinks), "SOFT_MAX_ATTN": int(soft_max_attn)}
    if op.mask:
        defines["M_TYPE"] = float_type(node.inputs[3].dtype)
    scale = op.scale / softcap if softcap else op.scale
    params = _alibi(Params().f32(scale, softcap), op.max_bias, n_head)
    n_groups = n_s * n_kv_head * -(-n_tok * (n_head // n_kv_head) // br)
    k.dispatch("flash_attn", defines, _tensors(node, srcs, dst), params, groups_for(n_groups), node.name)


@kernel(ops.FlashAttnExt, supports=_attn_ok)
def flash_attn_ext(k, node, srcs, dst) -> None:
    """ggml_flash_attn_ext: f32 q; f32, f16 or legacy-quant (q4_0, q4_1, q5_0, q5_1, q8_0) K/V (bf16
    too, see _kv_ok), K and V of different types allowed;
    f16/f32 mask, ALiBi, logit softcap, sinks, GQA; y [S, T, H, dv] (shaders/flash_attn.comp)."""
    _attention(k, node, srcs, dst, node.op.logit_softcap, soft_max_attn=False)


@kernel(ops.SoftMaxAttn, supports=_attn_ok)
def soft_max_attn(k, node, srcs, dst) -> None:
    """llamir's soft_max_attn (mul_mat(v, soft_max_ext(mul_mat(k, q)))): flash_attn_ext's online
    softmax over V stored transposed [S, Hkv, dv, n], y [S, H, T, dv]."""
    _attention(k, node, srcs, dst, 0.0, soft_max_attn=True)
