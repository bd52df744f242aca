"""Exact int8 dot products of 4-value chunks on 256-bit vectors, for CPUs with or without VNNI.

Each int32 lane l of a result is sum_{t<4} a[4l+t] * b[4l+t] (a unsigned bytes, b signed), the
lanes of vpdpbusd. With AVX-VNNI (or AVX512-VNNI+VL) that is one vpdpbusd; on plain AVX2 it is
vpmaddubsw (pairs into saturating int16) + vpmaddwd with ones. The AVX2 form is exact only while
each pair |a0*b0 + a1*b1| <= 32767, which every caller here guarantees (a <= 31 for the 4- and
5-bit types). Signed bytes on both sides (Q8_0 without VNNI) take vpmaddwd on int16 (madd16).
"""

from __future__ import annotations

import llvmlite.ir as ir

from llamir.backends.llvm.emit import I8, I16, I32, Emitter, vec

V32I8, V16I16, V8I32 = vec(I8, 32), vec(I16, 16), vec(I32, 8)


def maddubs(em: Emitter, a_u8, b_s8):
    """vpmaddubsw: int16 lane i = a[2i]*b[2i] + a[2i+1]*b[2i+1] (saturating)."""
    return em.intrinsic("llvm.x86.avx2.pmadd.ub.sw", V16I16, [a_u8, b_s8])


def madd_pairs(em: Emitter, p16):
    """vpmaddwd with ones: int32 lane l = p[2l] + p[2l+1]."""
    return madd16(em, p16, ir.Constant(V16I16, [1] * 16))


def dot4(em: Emitter, acc, a_u8, b_s8):
    """acc + the 4-value lanes of a_u8 . b_s8 (pairs within int16 on AVX2, see the module)."""
    if em.target.vnni:
        return em.intrinsic("llvm.x86.avx512.vpdpbusd.256", V8I32, [acc, a_u8, b_s8])
    total = madd_pairs(em, maddubs(em, a_u8, b_s8))
    return total if _is_zero(acc) else em.b.add(acc, total)


def dot4_chunks(em: Emitter, accs: list, chunks: list, x_at) -> list:
    """For each token j: accs[j] + the 4-value lanes of sum over (c, w) in chunks of w . x_at(j, c),
    chunk by chunk (few weight registers live): vpdpbusd chains with VNNI, else int16 sums of
    vpmaddubsw (callers keep them in range: at most 8 chunks of 4-bit values against int8) and one
    vpmaddwd a token."""
    b = em.b
    if em.target.vnni:
        for c, w in chunks:
            accs = [em.intrinsic("llvm.x86.avx512.vpdpbusd.256", V8I32, [acc, w, x_at(j, c)])
                    for j, acc in enumerate(accs)]
        return accs
    sums: list = [None] * len(accs)
    for c, w in chunks:
        for j in range(len(accs)):
            p = maddubs(em, w, x_at(j, c))
            sums[j] = p if sums[j] is None else b.add(sums[j], p)
    return [madd_pairs(em, s) if _is_zero(acc) else b.add(acc, madd_pairs(em, s)) for acc, s in zip(accs, sums)]


def madd16(em: Emitter, a16, b16):
    """vpmaddwd: int32 lane l = a[2l]*b[2l] + a[2l+1]*b[2l+1] (exact for int16 values from bytes)."""
    return em.intrinsic("llvm.x86.avx2.pmadd.wd", V8I32, [a16, b16])


def bcast_pair(em: Emitter, ptr, off):
    """The two int16 at ptr + off repeated over 16 lanes (one vpbroadcastd from memory)."""
    return em.b.bitcast(em.splat(em.load(I32, ptr, off), 8, I32), V16I16)


def bcast4(em: Emitter, ptr, off):
    """The 4 bytes at ptr + off repeated over 32 bytes (one vpbroadcastd from memory)."""
    return em.b.bitcast(em.splat(em.load(I32, ptr, off), 8, I32), V32I8)


def _is_zero(v) -> bool:
    return isinstance(v, ir.Constant) and isinstance(v.constant, list) and not any(v.constant)
