"""Attention kernels: ggml's flash_attn_ext and llamir's fused soft_max_attn (after ggml-cuda's fattn).

Per query row (token t of head h, which reads KV head h // G, G = H / Hkv):
    y = softmax(softcap(q k^T * scale) + slope_h * mask) v      (sinks[h] joining the softmax)
with an online softmax (running max M, sum S and accumulator O) over the KV cells. The rows of
one KV head and stream are numbered j = t*G + g (head h = kvh*G + g), so the heads that share a
KV head share its K/V reads. Two kernels, picked by the rows a KV head has (fattn-mma-f16 and
fattn-vec in ggml-cuda):

- mma (attention_mma.py, prompts): 16 rows per warp on the tensor cores, K/V tiles staged in
  shared memory as f16;
- vec (attention_vec.py, decode: 1-2 tokens, or few rows): warps over the cells with Q in
  registers, split over blocks too when the grid would be small.

A row whose cells are all masked gives 0 (S == 0), as ggml. Layouts in ggml order: q [dk, T, H, S],
k [dk, n, Hkv, Skv], v [dv, n, Hkv, Skv] (soft_max_attn: [n, dv, Hkv, Skv]), mask [n, T', H', S']
repeated over rows, heads and streams, sinks [H]; y [dv, H, T, S] (flash_attn_ext's permuted
output) or [dv, T, H, S] (soft_max_attn). Stream s reads KV stream s / (S / Skv).
"""

from __future__ import annotations

import math

import numpy as np

from llamir.ir import ggml_math, ops
from llamir_cuda.attention_common import ELEMENT_BYTES, FLOAT_KV, QUANT_KV, Variant
from llamir_cuda.attention_mma import MmaShape, mma_fits, mma_kernel
from llamir_cuda.attention_vec import COMBINE_BLOCK, combine_kernel, splits, vec_kernel, vec_max_rows, vec_shape
from llamir_cuda.lowering import ceil_div, device_ptr, f32_bits, grid_for, kernel

MAX_HEAD = 1024          # the head sizes claimed (the Vulkan plugin's bound)
DECODE_TOKENS = 2        # tokens per stream that take the vec kernel whatever their rows (as ggml-cuda)
f32 = np.float32


def _kv_ok(ttype) -> bool:
    return ttype.dtype.name in FLOAT_KV + QUANT_KV


def _attn_ok(node) -> bool:
    q, kt, vt = node.inputs[:3]
    heads = (q.type.shape[-1], node.type.shape[-1])
    return (q.dtype.name == "f32" and _kv_ok(kt.type) and _kv_ok(vt.type)
            and (not node.op.mask or node.inputs[3].dtype.name in FLOAT_KV)
            and all(isinstance(d, int) and d <= MAX_HEAD for d in heads))


def _dense0(ttype, td) -> bool:
    """Whether the tensor's ne0 stride is its element's size (a quantized one's is its block's)."""
    return ttype.dtype.is_quantized or int(td.strides[-1]) == ELEMENT_BYTES[ttype.dtype.name]


def _alibi(max_bias: float, n_head: int) -> tuple[float, float, int]:
    """log2 of ggml's m0 and m1 (f32), and n_head_log2: the slopes' bases (AttnView._slope)."""
    if max_bias <= 0:
        return 0.0, 0.0, 0
    n_head_log2 = 1 << int(math.floor(math.log2(n_head)))
    m0 = ggml_math.powf(f32(2.0), -f32(max_bias) / f32(n_head_log2))
    m1 = ggml_math.powf(f32(2.0), -(f32(max_bias) / f32(2)) / f32(n_head_log2))
    return math.log2(float(m0)), math.log2(float(m1)), n_head_log2


def _attention(k, node, srcs, dst, softcap: float, v_trans: bool) -> None:
    """The mma kernel for prompts (more tokens than a decode, more rows per KV head than a vec
    block takes, heads that fit its registers), else the vec kernel, its cells split over blocks
    when its grid is small."""
    op = node.op
    q, kt, vt = node.inputs[:3]
    n_s, n_head, n_tok, dk = (int(d) for d in q.type.shape)
    n_kv_head, n_kv, dv = int(kt.type.shape[1]), int(kt.type.shape[2]), int(node.type.shape[-1])
    dense = all(_dense0(i.type, td) for i, td in zip(node.inputs[:3 + op.mask], srcs, strict=False))
    var = Variant(kt.dtype.name, vt.dtype.name, node.inputs[3].dtype.name if op.mask else None, op.sinks,
                  bool(softcap), op.max_bias > 0, v_trans, dense, dk, dv)
    n_rows = n_tok * (n_head // n_kv_head)
    scale = op.scale / softcap if softcap else op.scale
    m0_log2, m1_log2, n_head_log2 = _alibi(op.max_bias, n_head)
    args = [(i.type, td) for i, td in zip(node.inputs, srcs, strict=True)] + [
        (node.type, dst), f32_bits(scale), f32_bits(softcap), f32_bits(m0_log2), f32_bits(m1_log2), n_head_log2]
    if n_tok > DECODE_TOKENS and n_rows > vec_max_rows(dv) and mma_fits(dk, dv):
        warps = min(MmaShape.of(dk, dv).max_warps, ceil_div(n_rows, 16))
        k.launch(mma_kernel(var, warps), (ceil_div(n_rows, 16 * warps), n_kv_head, n_s), args, node.name)
        return
    rows, lanes = vec_shape(var, n_rows)
    n_split, split_cells = splits(n_kv, ceil_div(n_rows, rows) * n_kv_head * n_s)
    part = 0
    if n_split > 1:
        part = device_ptr(k.scratch(n_split * n_s * n_head * n_tok * (2 + dv) * 4))
    args += [part, n_split, split_cells]
    k.launch(vec_kernel(var, rows, lanes), (ceil_div(n_rows, rows), n_kv_head, n_s * n_split), args, node.name)
    if n_split > 1:
        k.launch(combine_kernel(var), grid_for(ceil_div(n_s * n_head * n_tok * dv, COMBINE_BLOCK)), args, node.name)


@kernel(ops.FlashAttnExt, supports=_attn_ok)
def flash_attn_ext(k, node, srcs, dst) -> None:
    """ggml_flash_attn_ext: f32 q; f32, f16, bf16 or legacy-quant (q4_0, q4_1, q5_0, q5_1, q8_0) K/V,
    K and V of different types allowed; f16/f32/bf16 mask, ALiBi, logit softcap, sinks, GQA; heads
    up to 1024; y [S, T, H, dv]."""
    _attention(k, node, srcs, dst, node.op.logit_softcap, v_trans=False)


@kernel(ops.SoftMaxAttn, supports=_attn_ok)
def soft_max_attn(k, node, srcs, dst) -> None:
    """llamir's soft_max_attn (mul_mat(v, soft_max_ext(mul_mat(k, q)))): flash_attn_ext's online
    softmax over V stored transposed [S, Hkv, dv, n], y [S, H, T, dv]."""
    _attention(k, node, srcs, dst, 0.0, v_trans=True)
