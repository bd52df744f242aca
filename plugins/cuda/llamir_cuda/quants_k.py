"""The K-quant encoders (256 values a block): ggml's quantize_row_{q2,q3,q4,q5,q6}_K_ref,
statement by statement (ggml-quants.c; llamir/ir/quants.py vectorises the same arithmetic).

Each block is fitted sub-block by sub-block (make_qkx2_quants: an affine fit searched over
nstep scales; make_q3_quants / make_qx_quants: symmetric fits), the sub-block scales are
quantized against the block's largest and written, and the levels are recomputed from the
scales as stored (read back from the block, as the C reads them back). Sums run in the C's
loop order, every operation rounded on its own (scalar.py). One thread encodes one block, its
values and levels in thread-private arrays.
"""

from __future__ import annotations

from collections.abc import Callable

from llamir_cuda import kir
from llamir_cuda.kir import F32, I32
from llamir_cuda.scalar import (
    Array,
    Bytes,
    Val,
    Var,
    clamp,
    f16_round,
    f32,
    fabs,
    i32,
    imin,
    loop,
    nearest_int,
    select,
    sqrt,
    to_float,
    when,
    when_else,
)

QK_K = 256
GROUP_MAX_EPS = 1e-15


# -- the layouts' scale fields (the decoders in quants.py read them too) ------------------------------
def scale_min_k4(q: Bytes, at: int, s: Val) -> tuple[Val, Val]:
    """ggml's get_scale_min_k4: the 6-bit scale and min of sub-block s (0..7) from the 12 bytes
    at `at` (q4_K, q5_K)."""
    b_s, b_s4, b_low = q.u8(at + s), q.u8(at + s + 4), q.u8(at + (s & 3))
    first = s < 4
    sc = select(first, b_s & 63, (b_s4 & 0xF) | ((b_low >> 6) << 4))
    m = select(first, b_s4 & 63, (b_s4 >> 4) | ((b_s >> 6) << 4))
    return sc, m


def q3_k_scale(q: Bytes, s: Val) -> Val:
    """Sub-block s's scale of a q3_K block (-32..31): its low nibble in scales[s % 8] (the high
    nibble for s >= 8), its top two bits at 2 (s / 4) of scales[8 + s % 4]."""
    low = (q.u8(96 + (s & 7)) >> (4 * (s >> 3))) & 0xF
    high = (q.u8(104 + (s & 3)) >> (2 * (s >> 2))) & 3
    return (low | (high << 4)) - 32


# -- the fits --------------------------------------------------------------------------------------------
def _error(diff: Val, use_mad: bool) -> Val:
    return fabs(diff) if use_mad else diff * diff


def _make_qkx2_quants(k: kir.KernelBuilder, x: Array, base: Val, n: int, w: Array, L: Array, laux: Array,
                      nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool) -> tuple[Val, Val]:
    """ggml's make_qkx2_quants over x[base .. base + n) weighted by w: levels 0..nmax into L,
    returns (scale, the_min) (the_min is minus the fitted offset)."""
    lo, hi = Var(k, x[base]), Var(k, x[base])
    sum_w, sum_x = Var(k, w[0]), Var(k, w[0] * x[base])
    with loop(k, 1, n) as i:
        v = x[base + i]
        lo.set(select(v < lo.get(), v, lo.get()))
        hi.set(select(v > hi.get(), v, hi.get()))
        sum_w.set(sum_w.get() + w[i])
        sum_x.set(sum_x.get() + w[i] * v)
    lo.set(select(lo.get() > 0.0, f32(k, 0.0), lo.get()))
    scale = Var(k, 0.0)
    with when_else(hi.get().eq(lo.get())) as (flat, fit):
        with flat:
            with loop(k, 0, n) as i:
                L[base + i] = 0
        with fit:
            iscale = float(nmax) / (hi.get() - lo.get())
            scale.set(1.0 / iscale)
            best = Var(k, 0.0)
            with loop(k, 0, n) as i:
                level = clamp(nearest_int(iscale * (x[base + i] - lo.get())), 0, nmax)
                L[base + i] = level
                best.set(best.get() + w[i] * _error(scale.get() * to_float(level) + lo.get() - x[base + i], use_mad))
            with loop(k, 0, nstep + 1) as step:
                iscale = (rmin + rdelta * to_float(step) + float(nmax)) / (hi.get() - lo.get())
                sum_l, sum_l2, sum_xl = Var(k, 0.0), Var(k, 0.0), Var(k, 0.0)
                with loop(k, 0, n) as i:
                    xi = x[base + i]
                    level = clamp(nearest_int(iscale * (xi - lo.get())), 0, nmax)
                    laux[i] = level
                    wl = w[i] * to_float(level)
                    sum_l.set(sum_l.get() + wl)
                    sum_l2.set(sum_l2.get() + wl * to_float(level))
                    sum_xl.set(sum_xl.get() + wl * xi)
                det = sum_w.get() * sum_l2.get() - sum_l.get() * sum_l.get()
                with when(det > 0.0):
                    this_scale = Var(k, (sum_w.get() * sum_xl.get() - sum_x.get() * sum_l.get()) / det)
                    this_min = Var(k, (sum_l2.get() * sum_x.get() - sum_l.get() * sum_xl.get()) / det)
                    with when(this_min.get() > 0.0):
                        this_min.set(0.0)
                        this_scale.set(sum_xl.get() / sum_l2.get())
                    cur = Var(k, 0.0)
                    with loop(k, 0, n) as i:
                        diff = this_scale.get() * to_float(laux[i]) + this_min.get() - x[base + i]
                        cur.set(cur.get() + w[i] * _error(diff, use_mad))
                    with when(cur.get() < best.get()):
                        with loop(k, 0, n) as i:
                            L[base + i] = laux[i]
                        best.set(cur.get())
                        scale.set(this_scale.get())
                        lo.set(this_min.get())
    return scale.get(), -lo.get()


def _signed_absmax16(k: kir.KernelBuilder, x: Array, base: Val) -> Val:
    """The first value of largest magnitude of x[base .. base + 16), sign kept (0 for none)."""
    amax, vmax = Var(k, 0.0), Var(k, 0.0)
    with loop(k, 0, 16) as i:
        v = x[base + i]
        larger = fabs(v) > amax.get()
        amax.set(select(larger, fabs(v), amax.get()))
        vmax.set(select(larger, v, vmax.get()))
    return vmax.get()


def _make_qx_quants(k: kir.KernelBuilder, x: Array, base: Val, nmax: int, L: Array) -> Val:
    """ggml's make_qx_quants with rmse_type 1 and no weights over x[base .. base + 16): levels
    0..2 nmax - 1 into L; returns the scale."""
    vmax = _signed_absmax16(k, x, base)
    scale = Var(k, 0.0)
    with when_else(fabs(vmax) < GROUP_MAX_EPS) as (zero, fit):
        with zero:
            with loop(k, 0, 16) as i:
                L[base + i] = 0
        with fit:
            def levels(iscale: Val, keep: bool) -> tuple[Val, Val]:
                sumlx, suml2 = Var(k, 0.0), Var(k, 0.0)
                with loop(k, 0, 16) as i:
                    xi = x[base + i]
                    level = clamp(nearest_int(iscale * xi), -nmax, nmax - 1)
                    if keep:
                        L[base + i] = level + nmax
                    w = xi * xi
                    sumlx.set(sumlx.get() + w * xi * to_float(level))
                    suml2.set(suml2.get() + w * to_float(level) * to_float(level))
                return sumlx.get(), suml2.get()

            sumlx, suml2 = levels(-float(nmax) / vmax, keep=True)
            scale.set(select(suml2.ne(0.0), sumlx / suml2, 0.0))
            best = Var(k, scale.get() * sumlx)
            with loop(k, -9, 10) as step:
                with when(step.ne(0)):
                    iscale = -(float(nmax) + 0.1 * to_float(step)) / vmax
                    sumlx, suml2 = levels(iscale, keep=False)
                    with when((suml2 > 0.0) & (sumlx * sumlx > best.get() * suml2)):
                        with loop(k, 0, 16) as i:
                            L[base + i] = nmax + clamp(nearest_int(iscale * x[base + i]), -nmax, nmax - 1)
                        scale.set(sumlx / suml2)
                        best.set(scale.get() * sumlx)
    return scale.get()


def _make_q3_quants(k: kir.KernelBuilder, x: Array, base: Val, nmax: int, L: Array) -> Val:
    """ggml's make_q3_quants with do_rmse over x[base .. base + 16): a symmetric fit, then up to
    five sweeps moving one level at a time where that raises sumlx^2 / suml2. Levels 0..2 nmax - 1
    into L; returns the scale (0 where suml2 is not positive, as the reference has it)."""
    vmax = _signed_absmax16(k, x, base)
    scale = Var(k, 0.0)
    with when_else(fabs(vmax) < GROUP_MAX_EPS) as (zero, fit):
        with zero:
            with loop(k, 0, 16) as i:
                L[base + i] = 0
        with fit:
            iscale = -float(nmax) / vmax
            sumlx, suml2 = Var(k, 0.0), Var(k, 0.0)
            with loop(k, 0, 16) as i:  # L holds the signed levels until the end
                xi = x[base + i]
                level = clamp(nearest_int(iscale * xi), -nmax, nmax - 1)
                L[base + i] = level
                w = xi * xi
                sumlx.set(sumlx.get() + w * xi * to_float(level))
                suml2.set(suml2.get() + w * to_float(level) * to_float(level))
            changed = Var(k, 1)
            with loop(k, 0, 5):
                with when(changed.get().ne(0)):  # a sweep that changed nothing ends the search
                    changed.set(0)
                    with loop(k, 0, 16) as i:
                        xi, old = x[base + i], L[base + i]
                        w = xi * xi
                        slx = sumlx.get() - w * xi * to_float(old)
                        with when(slx > 0.0):
                            sl2 = suml2.get() - w * to_float(old) * to_float(old)
                            new = clamp(nearest_int(xi * sl2 / slx), -nmax, nmax - 1)
                            with when(new.ne(old)):
                                slx_new = slx + w * xi * to_float(new)
                                sl2_new = sl2 + w * to_float(new) * to_float(new)
                                gain = slx_new * slx_new * suml2.get() > sumlx.get() * sumlx.get() * sl2_new
                                with when((sl2_new > 0.0) & gain):
                                    L[base + i] = new
                                    sumlx.set(slx_new)
                                    suml2.set(sl2_new)
                                    changed.set(changed.get() + 1)
            with loop(k, 0, 16) as i:
                L[base + i] = L[base + i] + nmax
            scale.set(select(suml2.get() > 0.0, sumlx.get() / suml2.get(), 0.0))
    return scale.get()


# -- packing ---------------------------------------------------------------------------------------------
def _put_crumbs(k: kir.KernelBuilder, q: Bytes, at: int, L: Array) -> None:
    """The low two bits of 256 levels as q2_K and q3_K pack them: per 128 levels, byte l holds
    levels l, l + 32, l + 64 and l + 96 from its low bits up."""
    for h in range(2):
        with loop(k, 0, 32) as lane:
            j = lane + 128 * h
            q.put_u8(at + 32 * h + lane, (L[j] & 3) | ((L[j + 32] & 3) << 2) | ((L[j + 64] & 3) << 4)
                     | ((L[j + 96] & 3) << 6))


def _max_positive(k: kir.KernelBuilder, values: Array, n: int) -> Val:
    """The largest of values[0..n) above 0, else 0 (`if (v > max) max = v` from 0)."""
    top = Var(k, 0.0)
    with loop(k, 0, n) as j:
        top.set(select(values[j] > top.get(), values[j], top.get()))
    return top.get()


def _signed_max_abs(k: kir.KernelBuilder, values: Array, n: int) -> tuple[Val, Val]:
    """(the first of values[0..n) of largest magnitude, sign kept; that magnitude), from 0."""
    amax, vmax = Var(k, 0.0), Var(k, 0.0)
    with loop(k, 0, n) as j:
        larger = fabs(values[j]) > amax.get()
        amax.set(select(larger, fabs(values[j]), amax.get()))
        vmax.set(select(larger, values[j], vmax.get()))
    return vmax.get(), amax.get()


# -- the block types ---------------------------------------------------------------------------------------
def _q2_k(k: kir.KernelBuilder, q: Bytes, x: Array) -> None:
    """q2_K: scales[16] (4-bit scale | 4-bit min << 4), qs[64], d, dmin; per 16 values an affine
    fit of 2-bit levels (absolute error)."""
    L, laux, w = Array(k, I32, QK_K), Array(k, I32, 32), Array(k, F32, 32)
    scales, mins = Array(k, F32, 16), Array(k, F32, 16)
    with loop(k, 0, 16) as j:
        with loop(k, 0, 16) as i:
            w[i] = fabs(x[16 * j + i])
        scales[j], mins[j] = _make_qkx2_quants(k, x, 16 * j, 16, w, L, laux, 3, -0.5, 0.1, 15, use_mad=True)
    max_scale, max_min = _max_positive(k, scales, 16), _max_positive(k, mins, 16)
    packed = Array(k, I32, 16)
    d, dmin = Var(k, 0.0), Var(k, 0.0)
    with loop(k, 0, 16) as j:
        packed[j] = 0
    with when(max_scale > 0.0):
        iscale = 15.0 / max_scale
        with loop(k, 0, 16) as j:
            packed[j] = nearest_int(iscale * scales[j])
        d.set(max_scale / 15.0)
    with when(max_min > 0.0):
        iscale = 15.0 / max_min
        with loop(k, 0, 16) as j:
            packed[j] = packed[j] | (nearest_int(iscale * mins[j]) << 4)
        dmin.set(max_min / 15.0)
    with loop(k, 0, 16) as j:
        q.put_u8(j, packed[j])
    q.put_f16(80, d.get())
    q.put_f16(82, dmin.get())
    dq, dmq = f16_round(d.get()), f16_round(dmin.get())
    with loop(k, 0, 16) as j:
        sc = q.u8(j)
        ds = dq * to_float(sc & 0xF)
        with when(ds.ne(0.0)):
            dm = dmq * to_float(sc >> 4)
            with loop(k, 0, 16) as i:
                L[16 * j + i] = clamp(nearest_int((x[16 * j + i] + dm) / ds), 0, 3)
    _put_crumbs(k, q, 16, L)


def _q3_k(k: kir.KernelBuilder, q: Bytes, x: Array) -> None:
    """q3_K: hmask[32] (bit j / 32 of byte j % 32: level j's bit 2), qs[64] (its low two bits),
    scales[12] (16 6-bit scales biased by 32), d; per 16 values a symmetric fit of 3-bit levels."""
    L, scales = Array(k, I32, QK_K), Array(k, F32, 16)
    with loop(k, 0, 16) as j:
        scales[j] = _make_q3_quants(k, x, 16 * j, 4, L)
    max_scale, _ = _signed_max_abs(k, scales, 16)
    d = Var(k, 0.0)
    packed = [Var(k, 0) for _ in range(12)]
    with when(max_scale.ne(0.0)):
        iscale = -32.0 / max_scale
        for j in range(16):
            level = clamp(nearest_int(iscale * scales[j]), -32, 31) + 32
            if j < 8:
                packed[j].set(level & 0xF)
            else:
                packed[j - 8].set(packed[j - 8].get() | ((level & 0xF) << 4))
            packed[j % 4 + 8].set(packed[j % 4 + 8].get() | ((level >> 4) << (2 * (j // 4))))
        d.set(1.0 / iscale)
    for j in range(12):
        q.put_u8(96 + j, packed[j].get())
    q.put_f16(108, d.get())
    dq = f16_round(d.get())
    with loop(k, 0, 16) as j:
        ds = dq * to_float(q3_k_scale(q, j))
        with when(ds.ne(0.0)):
            with loop(k, 0, 16) as i:
                L[16 * j + i] = clamp(nearest_int(x[16 * j + i] / ds), -4, 3) + 4
    with loop(k, 0, 32) as m:  # level j's bit 2 into bit j / 32 of hmask[j % 32]
        mask = i32(k, 0)
        for bit in range(8):
            mask = mask | select(L[32 * bit + m] > 3, i32(k, 1 << bit), 0)
        q.put_u8(m, mask)
    _put_crumbs(k, q, 32, L)


def _q45_k(k: kir.KernelBuilder, q: Bytes, x: Array, nmax: int, rmin: float, nstep: int) -> None:
    """q4_K (nmax 15) / q5_K (31): d, dmin, scales[12] (8 6-bit scale and min pairs, as
    get_scale_min_k4 reads them), then (q5_K) qh[32], and qs[128]; per 32 values an affine fit
    weighted by rms(x) + |x|."""
    L, laux, w = Array(k, I32, QK_K), Array(k, I32, 32), Array(k, F32, 32)
    scales, mins = Array(k, F32, 8), Array(k, F32, 8)
    with loop(k, 0, 8) as j:
        sum_x2 = Var(k, 0.0)
        with loop(k, 0, 32) as i:
            sum_x2.set(sum_x2.get() + x[32 * j + i] * x[32 * j + i])
        av_x = sqrt(sum_x2.get() / 32.0)
        with loop(k, 0, 32) as i:
            w[i] = av_x + fabs(x[32 * j + i])
        scales[j], mins[j] = _make_qkx2_quants(k, x, 32 * j, 32, w, L, laux, nmax, rmin, 0.1, nstep, use_mad=False)
    max_scale, max_min = _max_positive(k, scales, 8), _max_positive(k, mins, 8)
    inv_scale = select(max_scale > 0.0, 63.0 / max_scale, 0.0)
    inv_min = select(max_min > 0.0, 63.0 / max_min, 0.0)
    packed: list[Val] = [None] * 12
    for j in range(8):  # uint8_t ls = nearest_int(...): a negative level wraps before MIN(63, ls)
        ls = imin(nearest_int(inv_scale * scales[j]) & 0xFF, 63)
        lm = imin(nearest_int(inv_min * mins[j]) & 0xFF, 63)
        if j < 4:
            packed[j], packed[j + 4] = ls, lm
        else:
            packed[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4)
            packed[j - 4] = packed[j - 4] | ((ls >> 4) << 6)
            packed[j] = packed[j] | ((lm >> 4) << 6)
    for j in range(12):
        q.put_u8(4 + j, packed[j])
    d, dmin = max_scale / 63.0, max_min / 63.0
    q.put_f16(0, d)
    q.put_f16(2, dmin)
    dq, dmq = f16_round(d), f16_round(dmin)
    with loop(k, 0, 8) as j:
        sc, m = scale_min_k4(q, 4, j)
        ds = dq * to_float(sc)
        with when(ds.ne(0.0)):
            dm = dmq * to_float(m)
            with loop(k, 0, 32) as i:
                L[32 * j + i] = clamp(nearest_int((x[32 * j + i] + dm) / ds), 0, nmax)
    qs = 16 if nmax == 15 else 48
    with loop(k, 0, 4) as c:  # sub-blocks 2c and 2c + 1 in the low and high nibbles of qs[32c ..]
        with loop(k, 0, 32) as lane:
            j = 64 * c + lane
            q.put_u8(qs + 32 * c + lane, (L[j] & 0xF) | ((L[j + 32] & 0xF) << 4))
    if nmax == 31:  # qh: bit s of qh[l] is bit 4 of sub-block s's level l
        with loop(k, 0, 32) as lane:
            qh = i32(k, 0)
            for s in range(8):
                qh = qh | (((L[32 * s + lane] >> 4) & 1) << s)
            q.put_u8(16 + lane, qh)


def _q6_k(k: kir.KernelBuilder, q: Bytes, x: Array) -> None:
    """q6_K: ql[128], qh[64], scales[16] (int8), d; per 16 values a symmetric fit of 6-bit levels."""
    L, scales = Array(k, I32, QK_K), Array(k, F32, 16)
    with loop(k, 0, 16) as j:
        scales[j] = _make_qx_quants(k, x, 16 * j, 32, L)
    max_scale, max_abs = _signed_max_abs(k, scales, 16)
    with when_else(max_abs < GROUP_MAX_EPS) as (zero, fit):
        with zero:  # an all-zero block
            with loop(k, 0, 210) as i:
                q.put_u8(i, i32(k, 0))
        with fit:
            iscale = -128.0 / max_scale
            d = 1.0 / iscale
            q.put_f16(208, d)
            dq = f16_round(d)
            with loop(k, 0, 16) as j:
                sc = imin(nearest_int(iscale * scales[j]), 127)
                q.put_u8(192 + j, sc)
                ds = dq * to_float(sc)
                with when(ds.ne(0.0)):
                    with loop(k, 0, 16) as i:
                        L[16 * j + i] = clamp(nearest_int(x[16 * j + i] / ds), -32, 31) + 32
            for h in range(2):  # ql[64h + l]: levels l, l + 64 (nibbles); ql[64h + 32 + l]: l + 32, l + 96
                with loop(k, 0, 32) as lane:
                    j = lane + 128 * h
                    q.put_u8(64 * h + lane, (L[j] & 0xF) | ((L[j + 64] & 0xF) << 4))
                    q.put_u8(64 * h + 32 + lane, (L[j + 32] & 0xF) | ((L[j + 96] & 0xF) << 4))
                    q.put_u8(128 + 32 * h + lane, (L[j] >> 4) | ((L[j + 32] >> 4) << 2) | ((L[j + 64] >> 4) << 4)
                             | ((L[j + 96] >> 4) << 6))


ENCODERS_K: dict[str, Callable[[kir.KernelBuilder, Bytes, Array], None]] = {
    "q2_k": _q2_k,
    "q3_k": _q3_k,
    "q4_k": lambda k, q, x: _q45_k(k, q, x, 15, -1.0, 20),
    "q5_k": lambda k, q, x: _q45_k(k, q, x, 31, -0.5, 15),
    "q6_k": _q6_k,
}
