"""The float functions ggml's x86 CPU backend evaluates, ported to numpy bit for bit.

ggml (built with GCC, whose default -ffp-contract=fast fuses a*b+c into one FMA) computes
softmax and SiLU with its own vectorised exp, `ggml_v_expf`, on whole vectors (16 lanes in the
AVX-512 build, 8 in the AVX2 one, each with its own exp: see llamir.ir.numerics), sums those
vectors horizontally in the build's order, and falls back to glibc's expf/sinf/cosf in scalar
code (row tails, rope angles, sinks). Every function here follows one of those, named in its
docstring, so the reference interpreter rounds exactly as llama.cpp does; all of them act
element-wise (or row-wise, on the last axis) on float32 arrays of any shape.

The ports follow glibc 2.36 (Debian 12): expf, sinf, cosf and logf (table-driven, float64
inside), tanhf, expm1f and erff (fdlibm, float). glibc's FMA builds (the ones x86-64 runs) fuse
some of expf/logf's float64 steps; emulating that would take double-double arithmetic for a
change that can reach the float32 result only about once in 10^8 calls (none in the ~10^5
inputs per function compared with glibc itself in tests/ir/test_ggml_exact_math.py), so the
float64 parts below round each step. powf is approximated by rounding the float64 power; it
only computes per-op scalars (rope's theta scale, ALiBi slopes).
"""

from __future__ import annotations

import decimal
from functools import cache

import numpy as np

from llamir.ir.numerics import AVX512, Numerics

f32, f64 = np.float32, np.float64
u32, u64 = np.uint32, np.uint64


def _hex32(s: str) -> np.float32:
    return f32(float.fromhex(s))


# -- exact float32 fused multiply-add ----------------------------------------------------------
_LOW29, _MIDPOINT_BIT = u64((1 << 29) - 1), u64(1 << 28)
_F32_MIN_NORMAL = f32(2.0**-126)


def fma(a, b, c) -> np.ndarray:
    """float32 a*b + c with a single rounding (vfmadd): exact through float64.

    a*b is exact in float64; the one float64 rounding of the sum can only mislead the float32
    rounding when it lands exactly halfway between two float32 values. Those sums (a normal
    float32 midpoint has 25 significant bits; float32-subnormal results are checked whole) get
    the exact error of the float64 sum (TwoSum), and the few with a nonzero one are rounded
    towards it."""
    a, b, c = (np.asarray(v, dtype=f32) for v in (a, b, c))
    shape = np.broadcast_shapes(a.shape, b.shape, c.shape) or (1,)
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.empty(shape, dtype=f64)
        p[...] = a
        p *= b   # in place: far faster than ufuncs with dtype=f64 on mixed inputs
        s = np.empty(shape, dtype=f64)
        s[...] = c
        s += p
        out = s.astype(f32)
        maybe_tie = (s.view(u64) & _LOW29) == _MIDPOINT_BIT
        magnitude = np.abs(out)
        if out.size and not magnitude.min() > _F32_MIN_NORMAL:    # (a NaN anywhere takes this path too)
            maybe_tie |= (magnitude <= _F32_MIN_NORMAL) & (s != 0)
        at = np.flatnonzero(maybe_tie)
        if at.size:
            s_t, p_t = s.reshape(-1)[at], p.reshape(-1)[at]
            c_t = (c.reshape(-1)[at] if c.shape == shape and c.flags.c_contiguous
                   else np.broadcast_to(c, shape)[np.unravel_index(at, shape)]).astype(f64)
            t = s_t - p_t
            err = (p_t - (s_t - t)) + (c_t - t)               # exact: p + c == s + err
            lost = err != 0
            if lost.any():
                at, s_t, err = at[lost], s_t[lost], err[lost]
                flat = out.reshape(-1)
                r = flat[at]
                below = np.where(r.astype(f64) < s_t, r, np.nextafter(r, f32(-np.inf)))
                above = np.where(r.astype(f64) > s_t, r, np.nextafter(r, f32(np.inf)))
                is_mid = (r.astype(f64) != s_t) & ((below.astype(f64) + above.astype(f64)) * 0.5 == s_t)
                flat[at] = np.where(is_mid, np.where(err > 0, above, below), r)
    return out


# -- ggml_v_expf / ggml_v_silu (vec.h: the AVX512F and the AVX2+FMA branches) ----------------
_SHIFT23 = _hex32("0x1.8p23")
_LOG2E = _hex32("0x1.715476p+0")
_LN2_HI, _LN2_LO = _hex32("0x1.62e4p-1"), _hex32("0x1.7f7d1cp-20")
_P1, _P2, _P3 = _hex32("0x1.ffffecp-1"), _hex32("0x1.fffdb6p-2"), _hex32("0x1.555e66p-3")
_P4, _P5 = _hex32("0x1.573e2ep-5"), _hex32("0x1.0e4020p-7")


def _expf_reduce(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Both branches' first steps: z = x*log2e + 0x1.8p23 (n sits in z's low bits), n = round(x*log2e),
    b = x - n*ln2 with ln2 in two parts."""
    z = fma(x, _LOG2E, _SHIFT23)
    n = z - _SHIFT23
    b = fma(-n, _LN2_LO, fma(-n, _LN2_HI, x))
    return z, n, b


def _v_expf_avx512(x: np.ndarray) -> np.ndarray:
    """2^n * poly(b) with vscalefps; |n| > 192 answers 0 or inf outright (and for +-inf)."""
    _, n, b = _expf_reduce(x)
    u = b * b
    j = fma(fma(fma(_P5, b, _P4), u, fma(_P3, b, _P2)), u, fma(_P1, b, f32(1)))
    out_of_range = np.abs(n) > 192
    exponent = np.where(out_of_range | np.isnan(n), 0, n).astype(np.int32)
    res = np.ldexp(j, exponent)                           # _mm512_scalef_ps (j finite, n integral)
    return np.where(out_of_range, np.where(n <= 0, f32(0), f32(np.inf)), res).astype(f32)


def _v_expf_avx2(x: np.ndarray) -> np.ndarray:
    """k = 2^n built from z's bits, exp = k + k*j with j = poly(b) - 1; |n| > 126 scales in two
    steps (s2 * s1), |n| > 192 gives s1*s1 (0 or inf)."""
    z, n, b = _expf_reduce(x)
    e = z.view(u32) << u32(23)                             # _mm256_slli_epi32: wraps
    k = (e + np.float32(1).view(u32)).view(f32)
    u = b * b
    j = fma(fma(fma(_P5, b, _P4), u, fma(_P3, b, _P2)), u, _P1 * b)
    abs_n = np.abs(n)
    g = np.where(n <= 0, u32(0x82000000), u32(0))          # an ordered compare: NaN gives 0
    s1 = (g + u32(0x7F000000)).view(f32)
    s2 = (e - g).view(f32)
    return np.where(abs_n > 192, s1 * s1, np.where(abs_n > 126, fma(s2, j, s2) * s1, fma(k, j, k))).astype(f32)


def v_expf(x: np.ndarray, numerics: Numerics = AVX512) -> np.ndarray:
    """ggml_v_expf, lane by lane, as the profile's build computes it."""
    x = np.asarray(x, dtype=f32)
    with np.errstate(invalid="ignore", over="ignore"):
        return _v_expf_avx512(x) if numerics.lanes == 16 else _v_expf_avx2(x)


def v_silu(x: np.ndarray, numerics: Numerics = AVX512) -> np.ndarray:
    """ggml_v_silu: x / (1 + ggml_v_expf(0 - x))."""
    x = np.asarray(x, dtype=f32)
    with np.errstate(over="ignore"):
        return x / (f32(1) + v_expf(f32(0) - x, numerics))


def _head(n: int, numerics: Numerics) -> int:
    """How many of a row's n values ggml's vector loops take; the rest go through scalar code."""
    return n - n % numerics.lanes


def vec_silu(x: np.ndarray, numerics: Numerics = AVX512) -> np.ndarray:
    """ggml_vec_silu_f32 on each row (last axis): ggml_v_silu on whole vectors, then
    ggml_silu_f32 (glibc expf) on the rest."""
    x = np.asarray(x, dtype=f32)
    k = _head(x.shape[-1], numerics)
    if k == x.shape[-1]:
        return v_silu(x, numerics)
    with np.errstate(over="ignore"):
        tail = x[..., k:] / (f32(1) + expf(-x[..., k:]))
    return np.concatenate([v_silu(x[..., :k], numerics), tail], axis=-1)


def reduce_add_16(v: np.ndarray) -> np.ndarray:
    """_mm512_reduce_add_ps over the last axis (16 lanes) in GCC's order: halves, quarters, pairs."""
    h8 = v[..., 8:16] + v[..., 0:8]
    h4 = h8[..., 4:8] + h8[..., 0:4]
    return (h4[..., 0] + h4[..., 2]) + (h4[..., 1] + h4[..., 3])


def hsum_8(v: np.ndarray) -> np.ndarray:
    """The 128-bit horizontal sum of 8 lanes (extract + movehl + movehdup), as tinyBLAS's hsum and
    ggml's AVX2 softmax and variance sums: ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))."""
    h4 = v[..., 4:8] + v[..., 0:4]
    return (h4[..., 0] + h4[..., 2]) + (h4[..., 1] + h4[..., 3])


def reduce_hadd_8(v: np.ndarray) -> np.ndarray:
    """GGML_F32x8_REDUCE's last step (two _mm_hadd_ps): ((l0+l4)+(l1+l5)) + ((l2+l6)+(l3+l7))."""
    h4 = v[..., 0:4] + v[..., 4:8]
    return (h4[..., 0] + h4[..., 1]) + (h4[..., 2] + h4[..., 3])


def vector_sum(v: np.ndarray, numerics: Numerics) -> np.ndarray:
    """One vector's float sum in the profile's loops (softmax, variance, tinyBLAS): the last axis
    holds `numerics.lanes` values."""
    return reduce_add_16(v) if numerics.lanes == 16 else hsum_8(v)


def reduce_accumulators(acc: np.ndarray, numerics: Numerics) -> np.ndarray:
    """GGML_F32_VEC_REDUCE of four accumulators [..., 4 * lanes]: (0+2)+(1+3), then the vector
    reduced (_mm512_reduce_add_ps, or the AVX build's two hadds)."""
    n = numerics.lanes
    v = (acc[..., 0:n] + acc[..., 2 * n:3 * n]) + (acc[..., n:2 * n] + acc[..., 3 * n:4 * n])
    return reduce_add_16(v) if n == 16 else reduce_hadd_8(v)


def chunked_sum(x: np.ndarray, numerics: Numerics) -> np.ndarray:
    """sum of each row (last axis) into a float64, as ggml's vectorised softmax and variance loops
    add it: each whole vector's float sum in order, then the tail's values one by one. [..., 1]."""
    n = x.shape[-1]
    k = _head(n, numerics)
    lanes = numerics.lanes
    chunks = vector_sum(x[..., :k].reshape(x.shape[:-1] + (k // lanes, lanes)), numerics)
    terms = np.concatenate([chunks.astype(f64), x[..., k:].astype(f64)], axis=-1)
    if terms.shape[-1] == 0:
        return np.zeros(x.shape[:-1] + (1,))
    return np.add.accumulate(terms, axis=-1)[..., -1:]


def vec_soft_max(x: np.ndarray, row_max: np.ndarray, numerics: Numerics = AVX512,
                 ) -> tuple[np.ndarray, np.ndarray]:
    """ggml_vec_soft_max_f32 on each row: y = exp(x - max) (ggml_v_expf on whole vectors, glibc
    expf on the tail) and their float64 sum (chunked_sum). Returns (y, sum [..., 1] float64)."""
    x = np.asarray(x, dtype=f32)
    n = x.shape[-1]
    k = _head(n, numerics)
    with np.errstate(invalid="ignore"):
        shifted = x - np.asarray(row_max, dtype=f32)
    y = v_expf(shifted[..., :k], numerics)
    if k < n:
        y = np.concatenate([y, expf(shifted[..., k:])], axis=-1)
    return y, chunked_sum(y, numerics)


# -- glibc expf (sysdeps/ieee754/flt-32/e_expf.c, table-driven, float64 inside) -------------------
_EXP_N = 32
_INV_LN2_N = float.fromhex("0x1.71547652b82fep+0") * _EXP_N
_SHIFT52 = float.fromhex("0x1.8p+52")
_EXP_C = (float.fromhex("0x1.c6af84b912394p-5") / _EXP_N**3,
          float.fromhex("0x1.ebfce50fac4f3p-3") / _EXP_N**2,
          float.fromhex("0x1.62e42ff0c52d6p-1") / _EXP_N)


@cache
def _exp2_table() -> np.ndarray:
    """bits(2^(i/32)) - (i << 47): the float64 of 2^(k/32) is bits(tab[k % 32] + (k << 47))."""
    with decimal.localcontext() as ctx:
        ctx.prec = 60
        two = decimal.Decimal(2)
        values = [float(two ** (decimal.Decimal(i) / _EXP_N)) for i in range(_EXP_N)]
    bits = np.array(values, dtype=f64).view(u64)
    return bits - (np.arange(_EXP_N, dtype=u64) << u64(47))


def expf(x: np.ndarray) -> np.ndarray:
    """glibc expf: k = round(x*32/ln2), exp(x) = 2^(k/32) * cubic(r) in float64, rounded once."""
    x = np.asarray(x, dtype=f32)
    xd = x.astype(f64)
    with np.errstate(invalid="ignore", over="ignore"):
        z = _INV_LN2_N * xd
        kd = z + _SHIFT52
        ki = kd.view(u64)
        kd = kd - _SHIFT52
        r = z - kd
        t = _exp2_table()[(ki % u64(_EXP_N)).astype(np.intp)] + (ki << u64(47))
        s = t.view(f64)
        y = ((_EXP_C[0] * r + _EXP_C[1]) * (r * r) + (_EXP_C[2] * r + 1.0)) * s
        out = y.astype(f32)
    big = np.abs(x) >= f32(88)                                  # glibc's special-case gate (and NaN)
    if np.any(big):
        special = np.where(x > _hex32("0x1.62e42ep6"), f32(np.inf),
                           np.where(x < _hex32("-0x1.9fe368p6"), f32(0), out))
        special = np.where(np.isnan(x), x, special)
        out = np.where(big | np.isnan(x), special, out)
    return out


# -- glibc sinf / cosf (sysdeps/ieee754/flt-32/s_sinf.c, s_cosf.c, s_sincosf.h) ---------------
_HPI_INV_2_24 = float.fromhex("0x1.45F306DC9C883p+23")        # 2/pi * 2^24
_HPI = float.fromhex("0x1.921FB54442D18p0")                   # pi/2
_PI63 = float.fromhex("0x1.921FB54442D18p-62")                # 2pi * 2^-64
_COS_C = tuple(float.fromhex(h) for h in ("0x1p0", "-0x1.ffffffd0c621cp-2", "0x1.55553e1068f19p-5",
                                          "-0x1.6c087e89a359dp-10", "0x1.99343027bf8c3p-16"))
_SIN_S = tuple(float.fromhex(h) for h in ("-0x1.555545995a603p-3", "0x1.1107605230bc4p-7",
                                          "-0x1.994eb3774cf24p-13"))


def _abstop12(x) -> np.ndarray:
    return (np.asarray(x, dtype=f32).view(u32) >> u32(20)) & u32(0x7FF)


@cache
def _inv_pio4() -> np.ndarray:
    """glibc's __inv_pio4: entry i holds bits 8i-24 .. 8i+8 of 2/pi's binary fraction (192 bits)."""
    bits = 256
    scale = 1 << (bits + 16)

    def arctan_inv(m: int) -> int:  # arctan(1/m) * scale, by its Taylor series in integers
        total, term, k, sign = 0, scale // m, 1, 1
        while term:
            total += sign * (term // k)
            term //= m * m
            k += 2
            sign = -sign
        return total

    pi_scaled = 16 * arctan_inv(5) - 4 * arctan_inv(239)      # Machin's formula
    two_over_pi = (2 * scale * (1 << bits)) // pi_scaled      # 2/pi * 2^bits
    return np.array([(two_over_pi >> (bits - 8 * (i + 1))) & 0xFFFFFFFF for i in range(24)], dtype=u64)


def _reduce_large(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """glibc reduce_large: |y| mod pi/2 from a 32x96-bit product with 2/pi; returns (r, quadrant)."""
    xi = y.view(u32).astype(u64)
    table = _inv_pio4()
    base = ((xi >> u64(26)) & u64(15)).astype(np.intp)
    shift = (xi >> u64(23)) & u64(7)
    m = ((xi & u64(0xFFFFFF)) | u64(0x800000)) << shift
    res0 = (m * table[base]) & u64(0xFFFFFFFF)                 # a 32-bit product in C
    res1 = m * table[base + 4]
    res2 = m * table[base + 8]
    res0 = ((res2 >> u64(32)) | (res0 << u64(32))) + res1
    n = (res0 + u64(1 << 61)) >> u64(62)
    res0 = res0 - (n << u64(62))
    return res0.view(np.int64).astype(f64) * _PI63, n.astype(np.int64)


def _poly(x: np.ndarray, x2: np.ndarray, odd: np.ndarray, negate_cos: np.ndarray) -> np.ndarray:
    """glibc sinf_poly: the sine polynomial for an even quadrant, the cosine one for odd."""
    x3 = x * x2
    sine = (x + x3 * _SIN_S[0]) + (x3 * x2) * (_SIN_S[1] + x2 * _SIN_S[2])
    c = tuple(np.where(negate_cos, -v, v) for v in _COS_C)
    x4 = x2 * x2
    cosine = (c[0] + x2 * c[1] + x4 * c[2]) + (x4 * x2) * (c[3] + x2 * c[4])
    return np.where(odd, cosine, sine)


def _sin_or_cos(y: np.ndarray, cos: bool) -> np.ndarray:
    y = np.asarray(y, dtype=f32)
    x = y.astype(f64)
    top = _abstop12(y)
    with np.errstate(invalid="ignore"):
        # |y| < 120: one multiply-subtract by pi/2 (glibc reduce_fast, the quadrant from bits 24..31)
        n_fast = ((x * _HPI_INV_2_24).astype(np.int64).astype(np.int32) + 0x800000) >> 24
        r_fast = x - n_fast * _HPI
        r_large, n_large = _reduce_large(np.where(top < _abstop12(np.inf), y, f32(0)))
        sign_bit = (y.view(u32) >> u32(31)).astype(np.int64)
        is_small = top < _abstop12(f32(float.fromhex("0x1.921FB54442D18p-1")))
        is_fast = top < _abstop12(f32(120))
        r = np.where(is_small, x, np.where(is_fast, r_fast, r_large))
        n = np.where(is_small, 0, np.where(is_fast, n_fast, n_large))
        quadrant = np.where(is_small | is_fast, n, n + sign_bit) & 3
        sign = np.where((quadrant == 1) | (quadrant == 2), -1.0, 1.0)
        arg = np.where(is_small, x, r * sign)
        out = _poly(arg, r * r, (n + cos) & 1 == 1, (quadrant & 2) == 2).astype(f32)
        tiny = top < _abstop12(f32(2.0**-12))
        out = np.where(tiny, f32(1) if cos else y, out)
        return np.where(top >= _abstop12(np.inf), y - y, out)


def sinf(y: np.ndarray) -> np.ndarray:
    """glibc sinf (float64 polynomial after reduction to [-pi/4, pi/4])."""
    return _sin_or_cos(y, cos=False)


def cosf(y: np.ndarray) -> np.ndarray:
    """glibc cosf (float64 polynomial after reduction to [-pi/4, pi/4])."""
    return _sin_or_cos(y, cos=True)


# -- glibc 2.36 tanhf / expm1f (sysdeps/ieee754/flt-32/s_tanhf.c, s_expm1f.c: fdlibm, float) -------
_EXPM1_Q = tuple(_hex32(h) for h in ("-0x1.111112p-5", "0x1.a01a02p-10", "-0x1.4ce19ap-14", "0x1.0cfca8p-18",
                                     "-0x1.afdd76p-23"))
_LN2_HI_F, _LN2_LO_F = _hex32("0x1.62e3p-1"), _hex32("0x1.2fefa2p-17")
_INVLN2_F = _hex32("0x1.715476p+0")


def expm1f(x: np.ndarray) -> np.ndarray:
    """glibc's fdlibm expm1f, each step rounded in float: k = round(x/ln2), x - k*ln2 in two parts,
    a rational correction, then 2^k scaling; -1 below -27*ln2, inf past 88.72."""
    x = np.asarray(x, dtype=f32)
    hx = x.view(u32) & u32(0x7FFFFFFF)
    big = hx >= u32(0x4195B844)                                              # |x| >= 27*ln2
    with np.errstate(all="ignore"):
        huge = np.where(np.isnan(x), x + x, np.where(x < 0, f32(-1), f32(np.inf)))
        return np.where(big & ((x < 0) | (hx >= u32(0x42B17218))), huge, _expm1f_core(x))


def _expm1f_core(x: np.ndarray) -> np.ndarray:
    one, half = f32(1), f32(0.5)
    hx = x.view(u32) & u32(0x7FFFFFFF)
    neg = x < 0
    with np.errstate(all="ignore"):
        near = (hx > u32(0x3EB17218)) & (hx < u32(0x3F851592))           # 0.5 ln2 < |x| < 1.5 ln2
        k_far = (_INVLN2_F * x + np.where(neg, -half, half)).astype(np.int32)
        k = np.where(hx > u32(0x3EB17218), np.where(near, np.where(neg, -1, 1), k_far), 0).astype(np.int32)
        t = k.astype(f32)
        hi = np.where(near, np.where(neg, x + _LN2_HI_F, x - _LN2_HI_F), x - t * _LN2_HI_F)
        lo = np.where(near, np.where(neg, -_LN2_LO_F, _LN2_LO_F), t * _LN2_LO_F)
        reduced = np.where(k != 0, hi - lo, x)
        c = np.where(k != 0, (hi - reduced) - lo, f32(0))
        x = reduced
        hfx = half * x
        hxs = x * hfx
        q = _EXPM1_Q
        r1 = one + hxs * (q[0] + hxs * (q[1] + hxs * (q[2] + hxs * (q[3] + hxs * q[4]))))
        t3 = f32(3) - r1 * hfx
        e = hxs * ((r1 - t3) / (f32(6) - x * t3))
        y0 = x - (x * e - hxs)
        e = (x * (e - c) - c) - hxs
        y_m1 = half * (x - e) - half
        y_p1 = np.where(x < f32(-0.25), -f32(2) * (e - (x + half)), one + f32(2) * (x - e))

        def add_exponent(y):
            return (y.view(np.int32) + (k << 23)).view(f32)

        y_big = add_exponent(one - (e - x)) - one                           # k <= -2 or k > 56
        t_small = (np.int32(0x3F800000) - (np.int32(0x1000000) >> np.clip(k, 0, 31))).view(f32)
        y_mid = add_exponent(t_small - (e - x))                              # 2 <= k < 23
        t_large = ((np.int32(0x7F) - k) << 23).view(f32)
        y_hi = add_exponent((x - (e + t_large)) + one)                       # 23 <= k <= 56
        y = np.where((k <= -2) | (k > 56), y_big, np.where(k < 23, y_mid, y_hi))
        y = np.where(k == 1, y_p1, np.where(k == -1, y_m1, y))
        y = np.where(k == 0, y0, y)
        return np.where(hx < u32(0x33000000), x, y).astype(f32)              # |x| < 2^-25: x


def tanhf(x: np.ndarray) -> np.ndarray:
    """glibc 2.36's tanhf (fdlibm): 1 - 2/(expm1f(2|x|) + 2) for |x| >= 1, -t/(t + 2) with
    t = expm1f(-2|x|) below, +-1 from 22 on, x itself below 2^-55."""
    x = np.asarray(x, dtype=f32)
    one, two = f32(1), f32(2)
    ix = x.view(u32) & u32(0x7FFFFFFF)
    ax = np.abs(x)
    with np.errstate(all="ignore"):
        t_big = expm1f(two * ax)
        t_small = expm1f(-two * ax)
        z = np.where(ix >= u32(0x3F800000), one - two / (t_big + two), -t_small / (t_small + two))
        z = np.where(ix >= u32(0x41B00000), one, z)
        z = np.where(x < 0, -z, z)
        z = np.where(ix < u32(0x24000000), x * (one + x), z)
        return np.where(ix >= u32(0x7F800000), np.where(np.isnan(x), x, np.sign(x)), z).astype(f32)


# -- glibc 2.36 erff (sysdeps/ieee754/flt-32/s_erff.c: fdlibm, float) ------------------------------
def _erf_poly(z, coeffs):
    """c0 + z*(c1 + z*(c2 + ...)) in float, innermost first (fdlibm's Horner nesting)."""
    acc = f32(float(coeffs[-1])) * np.ones_like(z)
    for c in reversed(coeffs[:-1]):
        acc = f32(float(c)) + z * acc
    return acc


_ERF_PP = ("1.2837916613e-01", "-3.2504209876e-01", "-2.8481749818e-02", "-5.7702702470e-03", "-2.3763017452e-05")
_ERF_QQ = ("1.0", "3.9791721106e-01", "6.5022252500e-02", "5.0813062117e-03", "1.3249473704e-04",
           "-3.9602282413e-06")
_ERF_PA = ("-2.3621185683e-03", "4.1485610604e-01", "-3.7220788002e-01", "3.1834661961e-01", "-1.1089469492e-01",
           "3.5478305072e-02", "-2.1663755178e-03")
_ERF_QA = ("1.0", "1.0642088205e-01", "5.4039794207e-01", "7.1828655899e-02", "1.2617121637e-01",
           "1.3637083583e-02", "1.1984500103e-02")
_ERF_RA = ("-9.8649440333e-03", "-6.9385856390e-01", "-1.0558626175e+01", "-6.2375331879e+01", "-1.6239666748e+02",
           "-1.8460508728e+02", "-8.1287437439e+01", "-9.8143291473e+00")
_ERF_SA = ("1.0", "1.9651271820e+01", "1.3765776062e+02", "4.3456588745e+02", "6.4538726807e+02",
           "4.2900814819e+02", "1.0863500214e+02", "6.5702495575e+00", "-6.0424413532e-02")
_ERF_RB = ("-9.8649431020e-03", "-7.9928326607e-01", "-1.7757955551e+01", "-1.6063638306e+02", "-6.3756646729e+02",
           "-1.0250950928e+03", "-4.8351919556e+02")
_ERF_SB = ("1.0", "3.0338060379e+01", "3.2579251099e+02", "1.5367296143e+03", "3.1998581543e+03",
           "2.5530502930e+03", "4.7452853394e+02", "-2.2440952301e+01")
_ERX, _EFX = f32(8.4506291151e-01), f32(1.2837916613e-01)


def erff(x: np.ndarray) -> np.ndarray:
    """glibc erff (fdlibm): a rational approximation on [0, 0.84375), erx + P/Q on [0.84375, 1.25),
    1 - exp(-z*z - 0.5625) exp((z-x)(z+x) + R/S) / x up to 6 (glibc expf), +-1 beyond."""
    x = np.asarray(x, dtype=f32)
    one = f32(1)
    ix = x.view(u32) & u32(0x7FFFFFFF)
    ax = np.abs(x)
    with np.errstate(all="ignore"):
        z = x * x
        small = x + x * (_erf_poly(z, _ERF_PP) / _erf_poly(z, _ERF_QQ))
        tiny = np.where(ix < u32(0x04000000), f32(0.0625) * (f32(16) * x + (f32(16) * _EFX) * x), x + _EFX * x)
        small = np.where(ix < u32(0x31800000), tiny, small)
        s = ax - one
        mid = _ERX + _erf_poly(s, _ERF_PA) / _erf_poly(s, _ERF_QA)
        inv = one / (ax * ax)
        near = ix < u32(0x4036DB6E)
        R = np.where(near, _erf_poly(inv, _ERF_RA), _erf_poly(inv, _ERF_RB))
        S = np.where(near, _erf_poly(inv, _ERF_SA), _erf_poly(inv, _ERF_SB))
        zt = (ax.view(u32) & u32(0xFFFFF000)).view(f32)
        r = expf(-zt * zt - f32(0.5625)) * expf((zt - ax) * (zt + ax) + R / S)
        tail = one - r / ax
        out = np.where(ix < u32(0x3F580000), small, np.where(x < 0, -np.where(ix < u32(0x3FA00000), mid, tail),
                                                              np.where(ix < u32(0x3FA00000), mid, tail)))
        out = np.where(ix >= u32(0x40C00000), np.sign(x).astype(f32), out)
        return np.where(np.isnan(x), x, out).astype(f32)


_LOGF_TAB = tuple((float.fromhex(a), float.fromhex(b)) for a, b in (
    ("0x1.661ec79f8f3bep+0", "-0x1.57bf7808caadep-2"), ("0x1.571ed4aaf883dp+0", "-0x1.2bef0a7c06ddbp-2"),
    ("0x1.49539f0f010bp+0", "-0x1.01eae7f513a67p-2"), ("0x1.3c995b0b80385p+0", "-0x1.b31d8a68224e9p-3"),
    ("0x1.30d190c8864a5p+0", "-0x1.6574f0ac07758p-3"), ("0x1.25e227b0b8eap+0", "-0x1.1aa2bc79c81p-3"),
    ("0x1.1bb4a4a1a343fp+0", "-0x1.a4e76ce8c0e5ep-4"), ("0x1.12358f08ae5bap+0", "-0x1.1973c5a611cccp-4"),
    ("0x1.0953f419900a7p+0", "-0x1.252f438e10c1ep-5"), ("0x1p+0", "0x0p+0"),
    ("0x1.e608cfd9a47acp-1", "0x1.aa5aa5df25984p-5"), ("0x1.ca4b31f026aap-1", "0x1.c5e53aa362eb4p-4"),
    ("0x1.b2036576afce6p-1", "0x1.526e57720db08p-3"), ("0x1.9c2d163a1aa2dp-1", "0x1.bc2860d22477p-3"),
    ("0x1.886e6037841edp-1", "0x1.1058bc8a07ee1p-2"), ("0x1.767dcf5534862p-1", "0x1.4043057b6ee09p-2")))
_LOGF_LN2 = float.fromhex("0x1.62e42fefa39efp-1")
_LOGF_A = tuple(float.fromhex(h) for h in ("-0x1.00ea348b88334p-2", "0x1.5575b0be00b6ap-2", "-0x1.ffffef20a4123p-2"))


def logf(x) -> np.ndarray:
    """glibc logf (sysdeps/ieee754/flt-32/e_logf.c): x = 2^k z, log1p(z/c - 1) + log(c) + k ln2 from
    a 16-entry table and a cubic, in float64, rounded once. (glibc's FMA build fuses z*invc - 1,
    which can move the float result only when the double lands on a rounding boundary.)"""
    x = np.asarray(x, dtype=f32)
    ix = x.view(u32).astype(np.int64)
    with np.errstate(all="ignore"):
        sub = (ix > 0) & (ix < 0x00800000)                        # subnormal: normalise
        ix = np.where(sub, (x * f32(2.0**23)).view(u32).astype(np.int64) - (23 << 23), ix)
        tmp = ix - 0x3F330000
        i = (tmp >> 19) % 16
        k = (tmp.astype(np.int32) >> 23).astype(f64)
        iz = (ix - (tmp & (0x1FF << 23))).astype(u32).view(f32).astype(f64)
        tab = np.array(_LOGF_TAB)
        invc, logc = tab[i, 0], tab[i, 1]
        r = iz * invc - 1
        y0 = logc + k * _LOGF_LN2
        r2 = r * r
        y = _LOGF_A[1] * r + _LOGF_A[2]
        y = _LOGF_A[0] * r2 + y
        y = (y * r2 + (y0 + r)).astype(f32)
        special = np.where(x == 0, f32(-np.inf), np.where((x < 0) | np.isnan(x), f32(np.nan), x))
        y = np.where((x == 0) | (x < 0) | ~np.isfinite(x), special, y)
        return np.where(x == f32(1), f32(0), y).astype(f32)


def powf(x, y) -> np.ndarray:
    """glibc powf, approximated by the rounded float64 power: equal for every (freq_base, n_dims)
    of rope we tried and ~99.94% of random inputs (glibc's error is 0.82 ulp). Used for scalars:
    rope's theta_scale and ALiBi slopes."""
    return (np.asarray(x, dtype=f32).astype(f64) ** np.asarray(y, dtype=f32).astype(f64)).astype(f32)
