"""Reference kernels for matmuls, row gathers/scatters, rope, softmax and attention."""

from __future__ import annotations

import math

import numpy as np

from llamir.ir import ggml_math, ops
from llamir.ir.dtypes import BF16, F16, F32, I32, DType
from llamir.ir.interp_kernels import _in, f32, from_f32, kernel, to_f32


# -- matmul ------------------------------------------------------------------------------
def _cached(ctx, a: np.ndarray, dtype: DType, what: str, make):
    """A prepared weight, cached by its memory's address. The entry holds the memory's owner, so
    the address cannot be freed and reused by another weight while the entry exists."""
    if ctx.weight_cache is None or not isinstance(a, np.ndarray):
        return make()
    key = (a.__array_interface__["data"][0], a.shape, a.strides, dtype.name, what)
    hit = ctx.weight_cache.get(key)
    if hit is None:
        owner = a
        while getattr(owner, "base", None) is not None:   # up to the array's memory (an mmap, ...)
            owner = owner.base
        hit = ctx.weight_cache[key] = (owner, make())
    return hit[1]


def matmul_2d(ctx, a: np.ndarray, a_dtype: DType, b: np.ndarray, cacheable: bool,
              sgemm: bool = False, repack_op: str | None = None) -> np.ndarray:
    """b [N, K] f32 @ a[M, K].T -> [N, M] f32, with b rounded to a's vec_dot_type (ggml CPU).
    `sgemm`: ggml would offer this float matmul to llamafile's tinyBLAS (see _mul_mat).
    `repack_op`: "mul_mat" or "mul_mat_id" when `a` is a model weight that llama.cpp offers to the
    CPU_REPACK buffer type for that op (a 2-D mul_mat weight, a 3-D mul_mat_id expert tensor)."""
    from llamir.ir import float_x86, quants_k_x86, quants_x86, repack_x86

    if not ctx.exact:
        return _matmul_fast(ctx, a, a_dtype, b, cacheable)
    if a_dtype in (F32, F16, BF16):
        return float_x86.mul_mat_float(a, b, ctx.numerics, sgemm)
    repack = repack_op is not None and repack_x86.repack_type(a_dtype, a.shape[0], ctx.numerics) is not None
    if a_dtype.name in quants_k_x86.K_TYPES:
        w = _cached(ctx, a, a_dtype, "x86k", lambda: quants_k_x86.prepare(a, a_dtype)) if cacheable \
            else quants_k_x86.prepare(a, a_dtype)
        return quants_k_x86.mul_mat(w, b, repack, gemm=repack_op == "mul_mat")
    if a_dtype.name in quants_x86.EXACT_TYPES:
        w = _cached(ctx, a, a_dtype, f"x86:{repack}", lambda: quants_x86.prepare(a, a_dtype, repack)) \
            if cacheable else quants_x86.prepare(a, a_dtype, repack)
        return quants_x86.mul_mat_exact(w, a_dtype, b)
    raise ValueError(f"mul_mat: ggml's CPU backend has no matmul for {a_dtype} weights")


def _matmul_fast(ctx, a: np.ndarray, a_dtype: DType, b: np.ndarray, cacheable: bool) -> np.ndarray:
    """The same math through BLAS: b rounded to the vec_dot_type (quantized the way ggml's x86
    backend quantizes activations), times the dequantized weight. Orders of magnitude faster than
    ggml's accumulation order, and within float32 rounding of it."""
    from llamir.ir import quants

    a32 = _cached(ctx, a, a_dtype, "f32", lambda: to_f32(a, a_dtype)) if cacheable else to_f32(a, a_dtype)
    if a_dtype == F32:
        return b @ a32.T
    return quants.activation_roundtrip(b, a_dtype) @ a32.T


def _batch_index(idx: tuple[int, ...], a_batch: tuple[int, ...], b_batch: tuple[int, ...]) -> tuple[int, ...]:
    """ggml's broadcast: b batch i uses a batch i // (nb / na) (consecutive b's share an a)."""
    return tuple(i // (nb // na) for i, na, nb in zip(idx, a_batch, b_batch, strict=True))


@kernel(ops.MulMat)
def _mul_mat(ctx, node, args, bindings):
    a, b = args
    a_dtype = _in(node, 0)
    b32 = to_f32(b, _in(node, 1))
    cacheable = node.inputs[0].kind == "weight"
    rank = max(a.ndim, b32.ndim)
    a = a.reshape((1,) * (rank - a.ndim) + a.shape)
    b32 = b32.reshape((1,) * (rank - b32.ndim) + b32.shape)
    a_batch, b_batch = a.shape[:-2], b32.shape[:-2]
    m = node.type.evaluate(bindings)[-1]
    # ggml_compute_forward_mul_mat hands llamafile a contiguous src1, or src1 once converted to
    # the vec_dot_type; a non-contiguous src1 already of that type goes to vec_dot
    sgemm = b.flags.c_contiguous or _in(node, 1) != a_dtype
    out = np.empty(b_batch + (b32.shape[-2], m), dtype=f32)
    repack_op = "mul_mat" if cacheable and math.prod(a_batch) == 1 else None   # ggml_n_dims(src0) == 2
    for idx in np.ndindex(*b_batch):
        out[idx] = matmul_2d(ctx, a[_batch_index(idx, a_batch, b_batch)], a_dtype, b32[idx], cacheable, sgemm,
                             repack_op)
    return out.reshape(node.type.evaluate(bindings))


@kernel(ops.MulMatId)
def _mul_mat_id(ctx, node, args, bindings):
    w, b, ids = args
    w_dtype = _in(node, 0)
    b32 = to_f32(b, _in(node, 1))
    n_expert = w.shape[0]
    _check_indices(ids, n_expert, "mul_mat_id expert id")
    n_tokens, k = ids.shape
    out = np.empty((n_tokens, k, node.type.evaluate(bindings)[-1]), dtype=f32)
    for e in np.unique(ids):
        tok, slot = np.nonzero(ids == e)
        rows = b32[tok, slot % b32.shape[1]]
        weight = node.inputs[0].kind == "weight"
        out[tok, slot] = matmul_2d(ctx, w[e], w_dtype, rows, weight,
                                   repack_op="mul_mat_id" if weight and n_expert > 1 else None)
    return out


# -- rows ----------------------------------------------------------------------------------
def _check_indices(idx: np.ndarray, n: int, what: str) -> None:
    bad = (idx < 0) | (idx >= n)
    if np.any(bad):
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{what} {int(idx[where])} at {list(where)} is outside [0, {n})")


@kernel(ops.GetRows)
def _get_rows(ctx, node, args, bindings):
    a, idx = args
    _check_indices(idx, a.shape[-2], "get_rows index")
    if a.ndim == 2:
        rows = a[idx]
    else:
        rows = np.stack([a[b][idx[b]] for b in np.ndindex(*a.shape[:-2])])
        rows = rows.reshape(idx.shape + rows.shape[-1:])
    if _in(node, 0) == I32:
        return np.ascontiguousarray(rows)
    return np.ascontiguousarray(to_f32(rows, _in(node, 0)), dtype=f32)


@kernel(ops.SetRows)
def _set_rows(ctx, node, args, bindings):
    dst, src, idx = args
    dst_dtype = node.dtype
    _check_indices(idx, dst.shape[-2], "set_rows index")
    src32 = to_f32(src, _in(node, 1))
    batch = dst.shape[:-2]
    if not batch:
        dst[idx.reshape(-1)] = from_f32(src32, dst_dtype)
        return dst
    idx = idx.reshape((1,) * (3 - idx.ndim) + idx.shape)  # [ne12, ne11, N]
    full = (1,) * (2 - len(batch)) + batch
    for b in np.ndindex(*full):
        i3, i2 = b
        rows = idx[i3 % idx.shape[0], i2 % idx.shape[1]]
        target = dst[b[-len(batch):]]
        target[rows] = from_f32(src32[b[-len(batch):]], dst_dtype)
    return dst


# -- rope ----------------------------------------------------------------------------------
def rope_corr_dims(n_dims: int, n_ctx_orig: int, freq_base: float, beta_fast: float, beta_slow: float):
    """ggml_rope_yarn_corr_dims, in f32 like ggml: a base <= 1 or a context <= 0 gives C's infinities
    and NaNs (logf(0) = -inf, x / 0), and ggml's MAX/MIN macros let a NaN through."""
    def logf(x: np.float32) -> np.float32:
        if x > 0 and math.isfinite(x):
            return f32(math.log(x))
        with np.errstate(all="ignore"):
            return np.log(x)

    def corr_dim(n_rot: float) -> np.float32:
        with np.errstate(all="ignore"):
            ratio = f32(n_ctx_orig) / (f32(n_rot) * f32(2) * f32(math.pi))
            return f32(n_dims) * logf(ratio) / (f32(2) * logf(f32(freq_base)))
    start, end = np.floor(corr_dim(beta_fast)), np.ceil(corr_dim(beta_slow))
    low = 0.0 if 0 > start else float(start)                        # MAX(0, start)
    high = n_dims - 1.0 if n_dims - 1 < end else float(end)         # MIN(n_dims - 1, end)
    return low, high


def rope_yarn_ramp_mix(op: ops.RopeExt) -> np.ndarray:
    """rope_yarn_ramp(low, high, i0) * ext_factor for each of the n_dims/2 pairs (NaNs as C's MAX/MIN)."""
    low, high = rope_corr_dims(op.n_dims, op.n_ctx_orig, op.freq_base, op.beta_fast, op.beta_slow)
    with np.errstate(all="ignore"):
        span = f32(high) - f32(low)
        span = f32(0.001) if f32(0.001) > span else span             # MAX(0.001f, high - low)
        y = (np.arange(op.n_dims // 2, dtype=f32) - f32(low)) / span
        return (f32(1) - np.minimum(f32(1), np.maximum(f32(0), y))) * f32(op.ext_factor)


def rope_cos_sin(op: ops.RopeExt, pos: np.ndarray, freq_factors: np.ndarray | None):
    """cos/sin [T, n_dims/2] as ggml_rope_cache_init computes them (theta *= theta_scale in f32)."""
    half = op.n_dims // 2
    theta_scale = f32(ggml_math.powf(f32(op.freq_base), f32(-2.0) / f32(op.n_dims)))
    theta = pos.astype(f32)
    thetas = np.empty((pos.shape[0], half), dtype=f32)
    for i in range(half):
        thetas[:, i] = theta
        theta = theta * theta_scale
    if freq_factors is not None:
        thetas = thetas / freq_factors[:half].astype(f32)
    theta_interp = f32(op.freq_scale) * thetas
    mscale = f32(op.attn_factor)
    if op.ext_factor != 0.0:  # rope_yarn; GCC fuses the first product of the mix into an fma
        ramp_mix = rope_yarn_ramp_mix(op)
        theta_interp = ggml_math.fma(theta_interp, f32(1) - ramp_mix, thetas * ramp_mix)
        mscale = mscale * ggml_math.fma(f32(0.1), ggml_math.logf(f32(1) / f32(op.freq_scale)), f32(1))[0]
    return ggml_math.cosf(theta_interp) * mscale, ggml_math.sinf(theta_interp) * mscale


@kernel(ops.RopeExt)
def _rope(ctx, node, args, bindings):
    op = node.op
    x = to_f32(args[0], _in(node, 0))
    cos, sin = rope_cos_sin(op, args[1], args[2] if op.freq_factors else None)
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, n_dims/2] against x [..., T, H, d]
    y = np.array(x, dtype=f32, copy=True)
    half = op.n_dims // 2
    if op.mode == ops.ROPE_NEOX:
        first, second = slice(0, half), slice(half, op.n_dims)
    else:
        first, second = slice(0, op.n_dims, 2), slice(1, op.n_dims, 2)
    x0, x1 = x[..., first], x[..., second]
    # rotate_pairs: x0*cos - x1*sin and x0*sin + x1*cos, GCC fusing each first product into an fma
    y[..., first] = ggml_math.fma(x0, cos, -(x1 * sin))
    y[..., second] = ggml_math.fma(x0, sin, x1 * cos)
    return from_f32(y, node.dtype)


# -- softmax and attention -----------------------------------------------------------------
def alibi_slopes(n_head: int, max_bias: float) -> np.ndarray:
    """Per-head ALiBi slopes as ggml computes them (all 1 when max_bias == 0)."""
    if max_bias <= 0:
        return np.ones(n_head, dtype=f32)
    n_head_log2 = 1 << int(math.floor(math.log2(n_head)))
    m0 = ggml_math.powf(f32(2.0), -f32(max_bias) / f32(n_head_log2))
    m1 = ggml_math.powf(f32(2.0), -(f32(max_bias) / f32(2)) / f32(n_head_log2))
    heads = np.arange(n_head)
    return np.where(heads < n_head_log2, ggml_math.powf(m0, heads + 1),
                    ggml_math.powf(m1, 2 * (heads - n_head_log2) + 1)).astype(f32)


def _mask_rows(mask: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The mask rows that apply to x of `shape` [..., H, T, n]: first T rows, heads tiled."""
    from llamir.ir.interp_kernels import tile_to

    m = mask[..., : shape[-2], :]
    return tile_to(m, shape) if m.ndim > 1 else m


@kernel(ops.SoftMaxExt)
def _soft_max(ctx, node, args, bindings):
    op = node.op
    x = args[0]
    rest = list(args[1:])
    w = x * f32(op.scale)
    if op.mask:
        mask = _mask_rows(to_f32(rest.pop(0), _in(node, 1)), x.shape)
        if op.max_bias > 0:  # wp[i] += slope*mask[i], contracted to an fma by GCC
            slopes = alibi_slopes(x.shape[-3], op.max_bias)[:, None, None]
            w = ggml_math.fma(np.broadcast_to(slopes, w.shape), mask, w)
        else:
            w = w + mask
    row_max = np.max(w, axis=-1, keepdims=True)
    sinks = None
    if op.sinks:
        sinks = rest.pop(0).astype(f32)[:, None, None]
        row_max = np.maximum(row_max, sinks)
    e, total = ggml_math.vec_soft_max(w, row_max, ctx.numerics)  # ggml_compute_forward_soft_max_f32
    if sinks is not None:
        with np.errstate(invalid="ignore"):
            total = total + ggml_math.expf(np.broadcast_to(sinks - row_max, total.shape)).astype(np.float64)
    with np.errstate(divide="ignore"):
        return e * (1.0 / total).astype(f32)
