"""Float functions as ggml's x86 CPU backend evaluates them, for kernels to call.

Hot paths use ggml's vectorised exp (`ggml_v_expf`, vec.h) on 16-lane vectors; everything
ggml computes with libm in scalar code (row tails, sigmoid, rope angles, ...) calls the same
libm functions here (glibc's expf/sinf/cosf/...), one lane at a time. So results match the
reference interpreter (ir/ggml_math.py ports the same functions) bit for bit where it can.
"""

from __future__ import annotations

import llvmlite.ir as ir

from llamir.backends.llvm.emit import F32, F64, I16, I32, Emitter, vec

LANES = 16   # ggml's AVX-512 chunk: v_expf / v_silu work on 16 floats


def _hex(s: str) -> float:
    return float.fromhex(s)


def splat(em: Emitter, c: float, n: int) -> ir.Constant:
    return ir.Constant(vec(F32, n), [c] * n)


def v_expf(em: Emitter, x: ir.Value) -> ir.Value:
    """ggml_v_expf (the AVX512F branch): 2^n * poly(b), n = round(x*log2e), b = x - n*ln2."""
    n_lanes = x.type.count
    b = em.b

    def c(v: str | float) -> ir.Constant:
        return splat(em, _hex(v) if isinstance(v, str) else v, n_lanes)

    r = c("0x1.8p23")
    z = em.fma(x, c("0x1.715476p+0"), r)
    n = b.fsub(z, r)
    neg_n = b.fneg(n)
    bb = em.fma(neg_n, c("0x1.7f7d1cp-20"), em.fma(neg_n, c("0x1.62e4p-1"), x))
    u = b.fmul(bb, bb)
    j = em.fma(em.fma(em.fma(c("0x1.0e4020p-7"), bb, c("0x1.573e2ep-5")), u,
                      em.fma(c("0x1.555e66p-3"), bb, c("0x1.fffdb6p-2"))),
               u, em.fma(c("0x1.ffffecp-1"), bb, c(1.0)))
    res = scalef(em, j, n)
    abs_n = em.intrinsic(f"llvm.fabs.v{n_lanes}f32", n.type, [n])
    out_of_range = b.fcmp_ordered(">", abs_n, c(192.0))
    alt = b.select(b.fcmp_ordered("<=", n, c(0.0)), c(0.0), c(float("inf")))
    return b.select(out_of_range, alt, res)


def scalef(em: Emitter, j: ir.Value, n: ir.Value) -> ir.Value:
    """j * 2^n for integral n (vscalefps); a generic two-step product without AVX-512."""
    count = j.type.count
    if em.target.avx512 and count == 16:
        return em.intrinsic("llvm.x86.avx512.mask.scalef.ps.512", j.type,
                            [j, n, ir.Constant(j.type, None), ir.Constant(I16, -1), ir.Constant(I32, 4)])
    b = em.b
    vi = vec(I32, count)
    lo, hi = splat(em, -252.0, count), splat(em, 254.0, count)
    nc = b.fptosi(em.fmin(em.fmax(n, lo), hi), vi)
    half = b.ashr(nc, ir.Constant(vi, [1] * count))
    rest = b.sub(nc, half)

    def pow2(k):
        return b.bitcast(b.shl(b.add(k, ir.Constant(vi, [127] * count)), ir.Constant(vi, [23] * count)), j.type)

    return b.fmul(b.fmul(j, pow2(half)), pow2(rest))


def v_silu(em: Emitter, x: ir.Value) -> ir.Value:
    """ggml_v_silu: x / (1 + v_expf(0 - x))."""
    n = x.type.count
    zero, one = splat(em, 0.0, n), splat(em, 1.0, n)
    return em.b.fdiv(x, em.b.fadd(one, v_expf(em, em.b.fsub(zero, x))))


# -- libm ------------------------------------------------------------------------------------------
def libm(em: Emitter, name: str, x: ir.Value) -> ir.Value:
    """A libm function of a float (expf, sinf, tanhf, ...) or double (erf, ...), lane by lane for
    vectors."""
    if isinstance(x.type, ir.VectorType):
        out = ir.Constant(x.type, None)
        for lane in range(x.type.count):
            k = ir.Constant(I32, lane)
            out = em.b.insert_element(out, libm(em, name, em.b.extract_element(x, k)), k)
        return out
    fn = em.declare(name, x.type, [x.type])
    return em.b.call(fn, [x])


def expf(em: Emitter, x: ir.Value) -> ir.Value:
    return libm(em, "expf", x)


def silu_scalar(em: Emitter, x: ir.Value) -> ir.Value:
    """ggml_silu_f32: x / (1 + expf(-x)) with libm's expf."""
    one = ir.Constant(x.type, [1.0] * x.type.count) if isinstance(x.type, ir.VectorType) else ir.Constant(F32, 1.0)
    return em.b.fdiv(x, em.b.fadd(one, expf(em, em.b.fneg(x))))


def to_double_and_back(em: Emitter, name: str, x: ir.Value) -> ir.Value:
    """f32 -> double libm function -> f32 (e.g. erf, as math.erf in the reference)."""
    if isinstance(x.type, ir.VectorType):
        out = ir.Constant(x.type, None)
        for lane in range(x.type.count):
            k = ir.Constant(I32, lane)
            out = em.b.insert_element(out, to_double_and_back(em, name, em.b.extract_element(x, k)), k)
        return out
    fn = em.declare(name, F64, [F64])
    return em.b.fptrunc(em.b.call(fn, [em.b.fpext(x, F64)]), F32)
