"""Float functions as ggml's x86 CPU backend evaluates them, for kernels to call.

Hot paths use ggml's vectorised exp (`ggml_v_expf`, vec.h) on vectors of the numerics profile's
width (em.numerics: 16 lanes and the AVX512F exp, or 8 and the AVX2 one); everything
ggml computes with libm in scalar code (row tails, sigmoid, rope angles, ...) calls the same
libm functions here (glibc's expf/sinf/cosf/...), one lane at a time. So results match the
reference interpreter (ir/ggml_math.py ports the same functions) bit for bit where it can.
"""

from __future__ import annotations

import llvmlite.ir as ir

from llamir.backends.llvm.emit import F32, I16, I32, Emitter, vec


def lanes(em: Emitter) -> int:
    """ggml's vector width in the profile being reproduced: v_expf / v_silu chunks, lane sums."""
    return em.numerics.lanes


def _hex(s: str) -> float:
    return float.fromhex(s)


def splat(em: Emitter, c: float, n: int) -> ir.Constant:
    return ir.Constant(vec(F32, n), [c] * n)


def v_expf(em: Emitter, x: ir.Value) -> ir.Value:
    """ggml_v_expf of the profile's build (any vector width): n = round(x*log2e), b = x - n*ln2,
    then 2^n * poly(b) by vscalefps (AVX512F), or k + k*j with k = 2^n made from z's bits (AVX2)."""
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
    poly = em.fma(em.fma(c("0x1.0e4020p-7"), bb, c("0x1.573e2ep-5")), u, em.fma(c("0x1.555e66p-3"), bb,
                                                                               c("0x1.fffdb6p-2")))
    abs_n = em.intrinsic(f"llvm.fabs.v{n_lanes}f32", n.type, [n])
    if em.numerics.lanes == 16:
        j = em.fma(poly, u, em.fma(c("0x1.ffffecp-1"), bb, c(1.0)))
        res = scalef(em, j, n)
        out_of_range = b.fcmp_ordered(">", abs_n, c(192.0))
        alt = b.select(b.fcmp_ordered("<=", n, c(0.0)), c(0.0), c(float("inf")))
        return b.select(out_of_range, alt, res)
    vi = vec(I32, n_lanes)

    def ic(v: int) -> ir.Constant:
        return ir.Constant(vi, [v] * n_lanes)

    j = em.fma(poly, u, b.fmul(c("0x1.ffffecp-1"), bb))
    e = b.shl(b.bitcast(z, vi), ic(23))
    k = b.bitcast(b.add(e, ic(0x3F800000)), x.type)
    plain = em.fma(k, j, k)
    far = b.fcmp_ordered(">", abs_n, c(126.0))
    # ggml returns here when no lane is far (a real branch: the far path's products of tiny
    # scales are subnormal, and every subnormal result costs a microcode assist)
    out = em.var(x.type, plain)
    with em.if_(b.icmp_unsigned("!=", b.bitcast(far, ir.IntType(n_lanes)), ir.Constant(ir.IntType(n_lanes), 0))):
        g = b.select(b.fcmp_ordered("<=", n, c(0.0)), ic(0x82000000 - (1 << 32)), ic(0))
        s1 = b.bitcast(b.add(g, ic(0x7F000000)), x.type)
        s2 = b.bitcast(b.sub(e, g), x.type)
        scaled = b.select(far, b.fmul(em.fma(s2, j, s2), s1), plain)
        em.set(out, b.select(b.fcmp_ordered(">", abs_n, c(192.0)), b.fmul(s1, s1), scaled))
    return em.get(out)


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


def reduce_accumulators(em: Emitter, accs: list[ir.Value]) -> ir.Value:
    """GGML_F32_VEC_REDUCE of four accumulators: (0+2)+(1+3), then the vector summed as
    _mm512_reduce_add_ps (AVX-512) or with two _mm_hadd_ps (AVX2: ((l0+l4)+(l1+l5))+((l2+l6)+(l3+l7)))."""
    b = em.b
    v = b.fadd(b.fadd(accs[0], accs[2]), b.fadd(accs[1], accs[3]))
    if v.type.count == 16:
        return em.reduce_add_tree(v)
    lo, hi = em.halves(v)
    h = b.fadd(lo, hi)
    e = [b.extract_element(h, ir.Constant(I32, i)) for i in range(4)]
    return b.fadd(b.fadd(e[0], e[1]), b.fadd(e[2], e[3]))


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
