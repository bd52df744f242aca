"""rope_ext: a cos/sin cache per (positions, rope parameters), shared by every rope of the split
(ggml recomputes it per op), then the rotation row by row.

The cache follows ggml_rope_cache_init: theta = pos, then theta *= theta_scale for each pair in
float32; YaRN's blend and magnitude are compile-time constants here; cos/sin are glibc's.
The rotation uses fma exactly where GCC contracts ggml's rotate_pairs.
"""

from __future__ import annotations

import math

import numpy as np

from llamir.backends.llvm import vmath
from llamir.backends.llvm.emit import F32, I32, Emitter
from llamir.backends.llvm.kernels.rows import _const_table
from llamir.backends.llvm.plan import Kernel, Ref
from llamir.ir import ggml_math, ops
from llamir.ir.interp_nn import rope_yarn_ramp_mix

f32 = np.float32


def rope_constants(op: ops.RopeExt) -> tuple[float, tuple[float, ...] | None, float]:
    """(theta_scale, per-pair YaRN ramp mix or None, mscale), as the reference computes them."""
    theta_scale = float(f32(ggml_math.powf(f32(op.freq_base), f32(-2.0) / f32(op.n_dims))))
    mscale = f32(op.attn_factor)
    ramp = None
    if op.ext_factor != 0.0:
        ramp = tuple(float(v) for v in rope_yarn_ramp_mix(op))
        mscale = mscale * ggml_math.fma(f32(0.1), ggml_math.logf(f32(1) / f32(op.freq_scale)), f32(1))[0]
    return theta_scale, ramp, float(f32(mscale))


class RopeCache(Kernel):
    """cache[t, i] = (cos, sin) of pair i at position pos[t] (float32, interleaved)."""

    def __init__(self, op: ops.RopeExt, n_tokens, has_factors: bool):
        self.half = op.n_dims // 2
        self.theta_scale, self.ramp, self.mscale = rope_constants(op)
        self.freq_scale = float(op.freq_scale)
        self.has_factors = has_factors
        self.n_ptrs = 3 if has_factors else 2
        super().__init__([n_tokens])

    def config(self) -> tuple:
        return (self.half, self.theta_scale, self.ramp, self.mscale, self.freq_scale, self.has_factors)

    def emit(self, em: Emitter, a) -> None:
        b = em.b
        t0, t1 = em.split(a.ints[0], a.ith, a.nth)
        ramp = _const_table(em, "ramp", self.ramp) if self.ramp is not None else None
        with em.loop(t0, t1, name="tok") as t:
            theta = em.var(F32, b.sitofp(em.load(I32, a.ptrs[1], em.mul(t, 4)), F32))
            with em.loop(0, self.half, name="pair") as i:
                th = em.get(theta)
                if self.has_factors:
                    th = b.fdiv(th, em.load(F32, a.ptrs[2], em.mul(i, 4)))
                interp = b.fmul(em.f32(self.freq_scale), th)
                if ramp is not None:
                    mix = em.load(F32, ramp, em.mul(i, 4))
                    interp = em.fma(interp, b.fsub(em.f32(1.0), mix), b.fmul(th, mix))
                c = b.fmul(vmath.libm(em, "cosf", interp), em.f32(self.mscale))
                s = b.fmul(vmath.libm(em, "sinf", interp), em.f32(self.mscale))
                slot = em.mul(em.add(em.mul(t, self.half), i), 8)
                em.store(c, a.ptrs[0], slot)
                em.store(s, a.ptrs[0], em.add(slot, 4))
                em.set(theta, b.fmul(em.get(theta), em.f32(self.theta_scale)))


class Rope(Kernel):
    """y = x with pairs rotated by the cache; x [B, T, H, d] (any strides), y contiguous."""

    def __init__(self, op: ops.RopeExt, out: Ref, x: Ref):
        out, x = out.padded(), x.padded()
        self.half, self.neox = op.n_dims // 2, op.mode == ops.ROPE_NEOX
        self.dtypes = (out.dtype.name, x.dtype.name)
        self.n_ptrs = 3
        super().__init__(list(x.shape) + list(x.strides) + list(out.strides))

    def config(self) -> tuple:
        return (self.half, self.neox, self.dtypes)

    def emit(self, em: Emitter, a) -> None:
        b = em.b
        shape, xs, ys = a.ints[0:4], a.ints[4:8], a.ints[8:12]
        units = em.mul(shape[0], shape[1])           # (batch, token) pairs; each owns H rows
        u0, u1 = em.split(units, a.ith, a.nth)
        out_dt, x_dt = self.dtypes
        from llamir.backends.llvm.emit import storage_type
        xty = storage_type(x_dt)
        with em.loop(u0, u1, name="tok") as u:
            t = em.rem(u, shape[1])
            bi = em.div(u, shape[1])
            cache_row = em.mul(em.mul(t, self.half), 8)
            with em.loop(0, shape[2], name="head") as h:
                xrow = em.gep(a.ptrs[1], em.offset((bi, t, h), xs[:3]))
                yrow = em.gep(a.ptrs[0], em.offset((bi, t, h), ys[:3]))

                def ld(col):
                    return em.to_f32(em.load(xty, xrow, em.mul(col, xs[3])), x_dt)

                def st(col, v):
                    em.store(em.from_f32(v, out_dt), yrow, em.mul(col, ys[3]))

                with em.loop(0, self.half, name="pair") as i:
                    c = em.load(F32, a.ptrs[2], em.add(cache_row, em.mul(i, 8)))
                    s = em.load(F32, a.ptrs[2], em.add(cache_row, em.add(em.mul(i, 8), 4)))
                    if self.neox:
                        j0, j1 = i, em.add(i, self.half)
                    else:
                        j0, j1 = em.mul(i, 2), em.add(em.mul(i, 2), 1)
                    x0, x1 = ld(j0), ld(j1)
                    st(j0, em.fma(x0, c, b.fneg(b.fmul(x1, s))))
                    st(j1, em.fma(x0, s, b.fmul(x1, c)))
                with em.loop(2 * self.half, shape[3], name="pass") as j:
                    st(j, ld(j))


__all__ = ["Rope", "RopeCache", "math"]
