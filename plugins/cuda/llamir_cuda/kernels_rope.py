"""Rotary embeddings and the masked softmax: rope_ext and soft_max_ext.

The scalars ggml derives on the host are derived here the same way (rope's theta_scale, YaRN's
correction dims and mscale, the ALiBi bases m0 and m1) and given to the kernels, which do the
per-element work: rope one thread per rotated pair, soft_max one block per row.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir

from llamir.ir import ggml_math, ops, rope_corr_dims
from llamir_cuda import kir
from llamir_cuda.kernels_norm import blocks, fits_i32
from llamir_cuda.kir import F32, I32, scalar, tensor
from llamir_cuda.lowering import ceil_div, f32_bits, is_float, kernel

ROPE_BLOCK = 256
SOFT_MAX_BLOCK = 1024  # the largest block; rows shorter than it get the next power of two >= 32
MAX_CACHED = 8         # soft_max: a thread keeps up to this many of its row's logits in registers
f32 = np.float32


# -- rope ------------------------------------------------------------------------------------------
def theta_scale(op: ops.RopeExt) -> float:
    """freq_base^(-2/n_dims) as ggml's rope computes it (powf in f32)."""
    return float(ggml_math.powf(f32(op.freq_base), f32(-2.0) / f32(op.n_dims)))


def _rope_kernel(tx: str, neox: bool, has_ff: bool, yarn: bool) -> kir.Kernel:
    """Pair i < n_dims/2 of each row (NORM: elements 2i and 2i+1; NEOX: i and i + n_dims/2) rotated
    by theta_i = pos * theta_scale^i / ff[i], with YaRN's ramp between the interpolated and the
    extrapolated angle; the elements at or past n_dims pass through. One thread per pair; y may
    be x (each thread reads its pair before writing it)."""
    params = (tensor("x"), tensor("pos"), *((tensor("ff"),) if has_ff else ()), tensor("y"), scalar("n_dims", "i"),
              scalar("theta_scale", "f"), scalar("freq_scale", "f"), scalar("ext_factor", "f"), scalar("corr_low", "f"),
              scalar("corr_span", "f"), scalar("mscale", "f"))

    def body(k: kir.KernelBuilder) -> None:
        b, a = k.b, k.args
        x, y = a["x"], a["y"]
        n_pairs = b.lshr(b.add(y.ne[0], k.i32(1)), k.i32(1))
        g = k.global_id()
        n_rows = b.mul(b.mul(y.ne[1], y.ne[2]), y.ne[3])
        with k.if_then(b.icmp_unsigned("<", g, b.mul(n_pairs, n_rows))):
            i, r = b.urem(g, n_pairs), b.udiv(g, n_pairs)
            i1, r = b.urem(r, y.ne[1]), b.udiv(r, y.ne[1])
            i2, i3 = b.urem(r, y.ne[2]), b.udiv(r, y.ne[2])
            half = b.lshr(a["n_dims"], k.i32(1))
            with k.if_else(b.icmp_unsigned("<", i, half)) as (rotate, keep):
                with rotate:
                    e0, e1 = (i, b.add(i, half)) if neox else (b.shl(i, k.i32(1)), b.or_(b.shl(i, k.i32(1)), k.i32(1)))
                    pos = b.sitofp(k.load(a["pos"].ptr, I32, k.offset(a["pos"], i2)), F32)
                    theta = _theta(k, pos, i)
                    if has_ff:
                        theta = b.fdiv(theta, k.load(a["ff"].ptr, F32, k.offset(a["ff"], i)))
                    angle = _yarn(k, theta, i) if yarn else b.fmul(a["freq_scale"], theta)
                    sin, cos = k.sincos(angle)
                    cos, sin = b.fmul(cos, a["mscale"]), b.fmul(sin, a["mscale"])
                    off0, off1 = k.offset(x, e0, i1, i2, i3), k.offset(x, e1, i1, i2, i3)
                    x0, x1 = k.load_f32(x.ptr, off0, tx), k.load_f32(x.ptr, off1, tx)
                    k.store_f32(k.fma(x0, cos, b.fneg(b.fmul(x1, sin))), y.ptr, k.offset(y, e0, i1, i2, i3), tx)
                    k.store_f32(k.fma(x0, sin, b.fmul(x1, cos)), y.ptr, k.offset(y, e1, i1, i2, i3), tx)
                with keep:
                    for e in (b.shl(i, k.i32(1)), b.or_(b.shl(i, k.i32(1)), k.i32(1))):
                        with k.if_then(b.icmp_unsigned("<", e, y.ne[0])):
                            v = k.load_f32(x.ptr, k.offset(x, e, i1, i2, i3), tx)
                            k.store_f32(v, y.ptr, k.offset(y, e, i1, i2, i3), tx)

    return kir.define("rope", (tx, neox, has_ff, yarn), params, ROPE_BLOCK, body)


def _theta(k: kir.KernelBuilder, pos: ir.Value, i: ir.Value) -> ir.Value:
    """pos * theta_scale^i as ggml's CPU rope caches it: theta *= theta_scale i times, in f32.
    The running product is rounded at each step; at positions near 2^19 a closed-form power
    (ggml-cuda's powf) differs from it by an NMSE of 5e-6, so the product is repeated here."""
    theta = k.var(F32, pos)
    with k.loop(k.i32(0), i):
        k.set(theta, k.b.fmul(k.get(theta, F32), k.args["theta_scale"]))
    return k.get(theta, F32)


def _yarn(k: kir.KernelBuilder, theta: ir.Value, i: ir.Value) -> ir.Value:
    """rope_yarn's angle: freq_scale*theta mixed back towards theta by ramp(i) * ext_factor, the
    ramp 1 below the low correction dim, 0 above the high one, linear between."""
    b, a = k.b, k.args
    ramp_y = b.fdiv(b.fsub(b.uitofp(i, F32), a["corr_low"]), a["corr_span"])
    ramp = b.fsub(k.f32(1.0), k.fmin(k.f32(1.0), k.fmax(k.f32(0.0), ramp_y)))
    mix = b.fmul(ramp, a["ext_factor"])
    return k.fma(b.fmul(a["freq_scale"], theta), b.fsub(k.f32(1.0), mix), b.fmul(theta, mix))


def _rope_ok(node) -> bool:
    x = node.inputs[0]
    return x.dtype.name in ("f32", "f16") and node.dtype == x.dtype and fits_i32(x.type)


@kernel(ops.RopeExt, supports=_rope_ok)
def rope_ext(k, node, srcs, dst) -> None:
    """ggml_rope_ext: NORM and NEOX, YaRN, freq factors, n_dims below the head size; f32 or f16 x,
    possibly a strided view, possibly rotated in place."""
    op = node.op
    x = node.inputs[0]
    low, high = rope_corr_dims(op.n_dims, op.n_ctx_orig, op.freq_base, op.beta_fast, op.beta_slow)
    with np.errstate(all="ignore"):
        span = f32(high) - f32(low)
    span = f32(0.001) if f32(0.001) > span else span  # MAX(0.001f, high - low)
    mscale = f32(op.attn_factor)
    if op.ext_factor != 0.0:
        mscale = mscale * np.ravel(ggml_math.fma(f32(0.1), ggml_math.logf(f32(1) / f32(op.freq_scale)), f32(1)))[0]
    kern = _rope_kernel(x.dtype.name, op.mode == ops.ROPE_NEOX, op.freq_factors, op.ext_factor != 0.0)
    head = int(x.type.shape[-1])
    n_threads = (head + 1) // 2 * (int(node.type.numel) // max(head, 1))
    args = [(v.type, td) for v, td in zip(node.inputs, srcs, strict=True)] + [(node.type, dst)]
    args += [op.n_dims, theta_scale(op), f32_bits(op.freq_scale), f32_bits(op.ext_factor), f32_bits(low),
             float(span), float(mscale)]
    k.launch(kern, blocks(ceil_div(n_threads, ROPE_BLOCK)), args, name=node.name)


# -- soft_max --------------------------------------------------------------------------------------
def alibi_bases(max_bias: float, n_head: int) -> tuple[float, float, int]:
    """m0, m1 and n_head_log2 as ggml's soft_max computes them: head h's slope is m0^(h+1) for
    the first n_head_log2 heads, m1^(2(h - n_head_log2) + 1) after them."""
    n_head_log2 = 1 << int(math.floor(math.log2(n_head)))
    m0 = ggml_math.powf(f32(2.0), -f32(max_bias) / f32(n_head_log2))
    m1 = ggml_math.powf(f32(2.0), -(f32(max_bias) / f32(2)) / f32(n_head_log2))
    return float(m0), float(m1), n_head_log2


def _soft_max_kernel(tm: str | None, sinks: bool, alibi: tuple[float, float, int] | None, block: int,
                     cached: int) -> kir.Kernel:
    """softmax(x*scale + slope_h*mask) of row (t, h, s) of x [n, T, H, S] (ggml's order), the
    mask [n, T', H', S'] repeated over heads and streams, each row's normaliser counting
    exp(sinks[h]) too. With `cached` > 0 a thread keeps its `cached` logits in registers (rows up
    to cached * block), else it recomputes them from x and the mask in each of the three passes."""
    params = (tensor("x"), *((tensor("m"),) if tm else ()), *((tensor("sinks"),) if sinks else ()), tensor("y"),
              scalar("scale", "f"))

    def body(k: kir.KernelBuilder) -> None:
        b, a = k.b, k.args
        x, y = a["x"], a["y"]
        r = k.ctaid(0)
        t, r = b.urem(r, x.ne[1]), b.udiv(r, x.ne[1])
        h, s = b.urem(r, x.ne[2]), b.udiv(r, x.ne[2])
        slope = _alibi_slope(k, h, *alibi) if alibi else None

        def logit(j: ir.Value) -> ir.Value:
            w = b.fmul(k.load(x.ptr, F32, k.offset(x, j, t, h, s)), a["scale"])
            if tm:
                m = a["m"]
                mv = k.load_f32(m.ptr, k.offset(m, j, b.urem(t, m.ne[1]), b.urem(h, m.ne[2]), b.urem(s, m.ne[3])), tm)
                w = k.fma(slope, mv, w) if alibi else b.fadd(w, mv)
            return w

        def store(j: ir.Value, v: ir.Value) -> None:
            k.store(v, y.ptr, k.offset(y, j, t, h, s))

        sink = k.load(a["sinks"].ptr, F32, k.offset(a["sinks"], h)) if sinks else None
        if cached:
            _cached_row(k, x.ne[0], logit, store, sink, cached)
        else:
            _looped_row(k, x.ne[0], logit, store, sink)

    key = (tm, sinks, alibi, block, cached)
    return kir.define("soft_max", key, params, block, body)


def _alibi_slope(k: kir.KernelBuilder, h: ir.Value, m0: float, m1: float, n_head_log2: int) -> ir.Value:
    """Head h's ALiBi slope: m0^(h+1) or m1^(2(h - n_head_log2) + 1), the power in double."""
    b = k.b
    first = b.icmp_unsigned("<", h, k.i32(n_head_log2))
    e0 = b.uitofp(b.add(h, k.i32(1)), F32)
    e1 = b.uitofp(b.add(b.shl(b.sub(h, k.i32(n_head_log2)), k.i32(1)), k.i32(1)), F32)
    return b.fptrunc(k.select(first, k.pow(m0, e0), k.pow(m1, e1)), F32)


def _cached_row(k: kir.KernelBuilder, n: ir.Value, logit, store, sink, cached: int) -> None:
    """The three passes over logits held in registers: thread t's j = t + c*block, c < cached."""
    b, block = k.b, k.block[0]
    neg_inf = k.f32(-math.inf)
    slots = []
    for c in range(cached):
        j = b.add(k.tid(0), k.i32(c * block))
        inside = b.icmp_unsigned("<", j, n)
        v = k.var(F32, neg_inf)
        with k.if_then(inside):
            k.set(v, logit(j))
        slots.append((j, inside, k.get(v, F32)))
    row_max = neg_inf
    for _, _, v in slots:
        row_max = k.fmax(row_max, v)
    row_max = _with_sink(k, k.block_reduce(row_max, k.fmax, neg_inf), sink)
    exps = [(j, inside, k.select(inside, k.exp(b.fsub(v, row_max)), k.f32(0.0))) for j, inside, v in slots]
    total = k.f32(0.0)
    for _, _, e in exps:
        total = b.fadd(total, e)
    inv = _inverse_total(k, k.block_reduce(total, b.fadd, k.f32(0.0)), sink, row_max)
    for j, inside, e in exps:
        with k.if_then(inside):
            store(j, b.fmul(e, inv))


def _looped_row(k: kir.KernelBuilder, n: ir.Value, logit, store, sink) -> None:
    """The three passes over a row too long for registers, each recomputing the logits."""
    b, block = k.b, k.block[0]
    neg_inf = k.f32(-math.inf)
    acc = k.var(F32, neg_inf)
    with k.loop(k.tid(0), n, block) as j:
        k.set(acc, k.fmax(k.get(acc, F32), logit(j)))
    row_max = _with_sink(k, k.block_reduce(k.get(acc, F32), k.fmax, neg_inf), sink)
    k.set(acc, k.f32(0.0))
    with k.loop(k.tid(0), n, block) as j:
        k.set(acc, b.fadd(k.get(acc, F32), k.exp(b.fsub(logit(j), row_max))))
    inv = _inverse_total(k, k.block_reduce(k.get(acc, F32), b.fadd, k.f32(0.0)), sink, row_max)
    with k.loop(k.tid(0), n, block) as j:
        store(j, b.fmul(k.exp(b.fsub(logit(j), row_max)), inv))


def _with_sink(k: kir.KernelBuilder, row_max: ir.Value, sink: ir.Value | None) -> ir.Value:
    return row_max if sink is None else k.fmax(row_max, sink)


def _inverse_total(k: kir.KernelBuilder, total: ir.Value, sink: ir.Value | None, row_max: ir.Value) -> ir.Value:
    """1 / the row's normaliser (with the sink's term exp(sink - max))."""
    b = k.b
    if sink is not None:
        total = b.fadd(total, k.exp(b.fsub(sink, row_max)))
    return b.fdiv(k.f32(1.0), total)


def soft_max_shape(n: int) -> tuple[int, int]:
    """(block, cached) for rows of n: a block of the next power of two >= n (32 to 1024, as
    ggml-cuda sizes it), the logits in registers while they fit MAX_CACHED a thread."""
    block = kir.WARP
    while block < n and block < SOFT_MAX_BLOCK:
        block *= 2
    per_thread = ceil_div(max(n, 1), block)
    cached = 1 << (per_thread - 1).bit_length()
    return block, cached if cached <= MAX_CACHED else 0


def _soft_max_ok(node) -> bool:
    x = node.inputs[0]
    return (x.dtype.name == "f32" and node.dtype.name == "f32"
            and (not node.op.mask or is_float(node.inputs[1].type)))


@kernel(ops.SoftMaxExt, supports=_soft_max_ok)
def soft_max_ext(k, node, srcs, dst) -> None:
    """ggml_soft_max_ext: scale, an f32/f16/bf16 mask repeated over heads and streams, ALiBi
    slopes, sinks; one block per row."""
    op = node.op
    x = node.inputs[0]
    shape = [int(d) for d in x.type.shape]
    n = shape[-1]
    alibi = alibi_bases(op.max_bias, shape[-3] if len(shape) >= 3 else 1) if op.max_bias > 0 else None
    block, cached = soft_max_shape(n)
    kern = _soft_max_kernel(node.inputs[1].dtype.name if op.mask else None, op.sinks, alibi, block, cached)
    args = [(v.type, td) for v, td in zip(node.inputs, srcs, strict=True)] + [(node.type, dst), f32_bits(op.scale)]
    k.launch(kern, blocks(int(node.type.numel) // max(n, 1)), args, name=node.name)

