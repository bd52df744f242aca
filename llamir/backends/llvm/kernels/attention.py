"""flash_attn_ext: online-softmax attention per query row, as ggml's CPU kernel computes it
(ggml_compute_forward_flash_attn_ext_f16_one_chunk).

Per row (stream s, head h, token t): q is rounded to K's type (f16) for the scores, each cell
whose mask is -inf is skipped, the running max M and sum S are updated with libm's expf, and
V accumulates in f16 when V is f16 (vec_scale_f16 / vec_mad_f16), in f32 otherwise. Sinks join
at the end; y[s, t, h, :] = VKQ / S (ggml's permuted output).
"""

from __future__ import annotations

import llvmlite.ir as ir

from llamir.backends.llvm import vmath
from llamir.backends.llvm.emit import F32, F64, Emitter, storage_type, vec
from llamir.backends.llvm.kernels.rows import _const_table
from llamir.backends.llvm.plan import Kernel, Ref

LANES = 16


def vec_dot(em: Emitter, a_ptr, a_dtype: str, b_ptr, b_dtype: str, K, a_step: int, b_step: int):
    """ggml_vec_dot_f16/f32 of two rows: four 16-lane fma accumulators over 64-wide steps, summed
    (0+2)+(1+3) and reduced, then the leftovers (a double for f16; for f32 rounded products, then
    fmas for the last K % 8)."""
    b = em.b
    zero = ir.Constant(vec(F32, LANES), [0.0] * LANES)
    accs = [em.var(vec(F32, LANES), zero) for _ in range(4)]
    main = em.mul(em.div(K, 64), 64)
    aty, bty = storage_type(a_dtype), storage_type(b_dtype)
    with em.loop(0, main, 64, name="k64") as k:
        for q in range(4):
            col = em.add(k, 16 * q)
            av = em.to_f32(em.load(vec(aty, LANES), a_ptr, em.mul(col, a_step)), a_dtype)
            bv = em.to_f32(em.load(vec(bty, LANES), b_ptr, em.mul(col, b_step)), b_dtype)
            em.set(accs[q], em.fma(av, bv, em.get(accs[q])))
    s = [em.get(x) for x in accs]
    total = em.reduce_add_tree(b.fadd(b.fadd(s[0], s[2]), b.fadd(s[1], s[3])))

    def elem(ptr, ty, dt, step, i):
        return em.to_f32(em.load(ty, ptr, em.mul(i, step)), dt)

    if a_dtype == "f32":
        acc = em.var(F32, total)
        fused_from = em.sub(K, em.rem(K, 8))
        with em.loop(main, K, name="left") as i:
            x, y = elem(a_ptr, aty, a_dtype, a_step, i), elem(b_ptr, bty, b_dtype, b_step, i)
            plain = b.fadd(em.get(acc), b.fmul(x, y))
            em.set(acc, b.select(em.icmp("<", i, fused_from), plain, em.fma(x, y, em.get(acc))))
        return em.get(acc)
    acc = em.var(F64, b.fpext(total, F64))
    with em.loop(main, K, name="left") as i:
        p = b.fmul(elem(a_ptr, aty, a_dtype, a_step, i), elem(b_ptr, bty, b_dtype, b_step, i))
        em.set(acc, b.fadd(em.get(acc), b.fpext(p, F64)))
    return b.fptrunc(em.get(acc), F32)


class FlashAttn(Kernel):
    """y [S, T, H, dv] from q [S, H, T, dk], k [S, Hkv, n, dk], v [S, Hkv, n, dv], mask, sinks."""

    def __init__(self, y: Ref, q: Ref, k: Ref, v: Ref, mask: Ref | None, sinks: Ref | None, scale: float,
                 softcap: float, alibi: tuple[float, ...] | None):
        self.dtypes = (q.dtype.name, k.dtype.name, v.dtype.name, mask.dtype.name if mask is not None else "")
        self.scale = float(scale / softcap) if softcap else float(scale)
        self.softcap = float(softcap)
        self.alibi = alibi
        self.has_mask, self.has_sinks = mask is not None, sinks is not None
        ints = list(q.shape) + list(q.strides[:3]) + list(k.shape[1:3]) + list(k.strides[:3]) \
            + [v.shape[3]] + list(v.strides[:3]) + list(y.strides[:3])
        if mask is not None:
            m = mask.padded()
            ints += list(m.shape[:2]) + list(m.strides[:3])
        self.n_ptrs = 5 + int(self.has_mask) + int(self.has_sinks)
        super().__init__(ints)

    def config(self) -> tuple:
        return (self.dtypes, self.scale, self.softcap, self.alibi, self.has_mask, self.has_sinks)

    def emit(self, em: Emitter, a) -> None:
        b = em.b
        ints = a.ints
        S_, H, T, DK = ints[0:4]
        qs = ints[4:7]
        hkv, n_kv = ints[7:9]
        ks = ints[9:12]
        DV = ints[12]
        vs_ = ints[13:16]
        ys = ints[16:19]
        if self.has_mask:
            msh, mst = ints[19:21], ints[21:24]
        y_ptr, q_ptr, k_ptr, v_ptr, scratch = a.ptrs[:5]
        mask_ptr = a.ptrs[5] if self.has_mask else None
        sinks_ptr = a.ptrs[-1] if self.has_sinks else None
        q_dt, k_dt, v_dt, m_dt = self.dtypes
        rows = em.mul(em.mul(S_, H), T)
        r0, r1 = em.split(rows, a.ith, a.nth)
        f16_acc = v_dt == "f16"
        qv_dt = "f16" if k_dt == "f16" else "f32"
        acc_size = 2 if f16_acc else 4
        with em.loop(r0, r1, name="row") as r:
            t = em.rem(r, T)
            h = em.rem(em.div(r, T), H)
            s = em.div(em.div(r, T), H)
            kh = em.div(h, em.div(H, hkv))
            qrow = em.gep(q_ptr, em.add(em.add(em.mul(s, qs[0]), em.mul(h, qs[1])), em.mul(t, qs[2])))
            krows = em.gep(k_ptr, em.add(em.mul(s, ks[0]), em.mul(kh, ks[1])))
            vrows = em.gep(v_ptr, em.add(em.mul(s, vs_[0]), em.mul(kh, vs_[1])))
            # scratch: q as the vec_dot type (f16 or f32), then the VKQ accumulator
            q_conv = scratch
            acc_ptr = em.gep(scratch, em.mul(DK, 4))
            with em.loop(0, DK, name="qc") as i:
                x = em.to_f32(em.load(storage_type(q_dt), qrow, em.mul(i, 4)), q_dt)
                em.store(em.from_f32(x, qv_dt), q_conv, em.mul(i, 2 if qv_dt == "f16" else 4))
            with em.loop(0, DV, name="zero") as i:
                em.store(em.from_f32(em.f32(0.0), "f16" if f16_acc else "f32"), acc_ptr, em.mul(i, acc_size))
            slope = em.f32(1.0)
            if self.alibi is not None:
                slope = em.load(F32, _const_table(em, "alibi", self.alibi), em.mul(h, 4))
            mrow = None
            if mask_ptr is not None:
                moff = em.add(em.add(em.mul(em.rem(s, msh[0]), mst[0]), em.mul(em.rem(h, msh[1]), mst[1])),
                              em.mul(t, mst[2]))
                mrow = em.gep(mask_ptr, moff)
            M = em.var(F32, em.f32(float("-inf")))
            Ssum = em.var(F32, em.f32(0.0))
            with em.loop(0, n_kv, name="cell") as ic:
                mv = em.f32(0.0)
                if mrow is not None:
                    m_elem = em.load(storage_type(m_dt), mrow, em.mul(ic, _size(m_dt)))
                    mv = b.fmul(slope, em.to_f32(m_elem, m_dt))
                with em.if_(b.fcmp_ordered("!=", mv, em.f32(float("-inf")))):
                    krow = em.gep(krows, em.mul(ic, ks[2]))
                    sc = vec_dot(em, krow, k_dt, q_conv, qv_dt, DK, _size(k_dt), _size(qv_dt))
                    sc = b.fmul(sc, em.f32(self.scale))
                    if self.softcap:
                        sc = b.fmul(em.f32(self.softcap), vmath.libm(em, "tanhf", sc))
                    sc = b.fadd(sc, mv)
                    m_old = em.get(M)
                    bigger = b.fcmp_ordered(">", sc, m_old)
                    ms = em.var(F32, em.f32(1.0))
                    vsv = em.var(F32, em.f32(1.0))
                    with em.if_else(bigger) as (then, otherwise):
                        with then:
                            em.set(M, sc)
                            em.set(ms, vmath.expf(em, b.fsub(m_old, sc)))
                            self._scale_acc(em, acc_ptr, DV, em.get(ms), f16_acc)
                        with otherwise:
                            em.set(vsv, vmath.expf(em, b.fsub(sc, m_old)))
                    vrow = em.gep(vrows, em.mul(ic, vs_[2]))
                    self._mad_acc(em, acc_ptr, vrow, v_dt, DV, em.get(vsv), f16_acc)
                    em.set(Ssum, b.fadd(b.fmul(em.get(Ssum), em.get(ms)), em.get(vsv)))
            total = em.get(Ssum)
            if sinks_ptr is not None:
                sk = em.load(F32, sinks_ptr, em.mul(h, 4))
                m_cur = em.get(M)
                big = b.fcmp_ordered(">", sk, m_cur)
                ms = b.select(big, vmath.expf(em, b.fsub(m_cur, sk)), em.f32(1.0))
                vsk = b.select(big, em.f32(1.0), vmath.expf(em, b.fsub(sk, m_cur)))
                total = b.fadd(b.fmul(total, ms), vsk)
            else:
                ms = em.f32(1.0)
            inv = b.select(b.fcmp_ordered("==", total, em.f32(0.0)), em.f32(0.0), b.fdiv(em.f32(1.0), total))
            yrow = em.gep(y_ptr, em.add(em.add(em.mul(s, ys[0]), em.mul(t, ys[1])), em.mul(h, ys[2])))
            with em.loop(0, DV, name="out") as i:
                x = em.to_f32(em.load(storage_type("f16" if f16_acc else "f32"), acc_ptr, em.mul(i, acc_size)),
                              "f16" if f16_acc else "f32")
                if sinks_ptr is not None:
                    x = b.fmul(x, ms)
                em.store(b.fmul(x, inv), yrow, em.mul(i, 4))

    def _scale_acc(self, em: Emitter, acc, DV, ms, f16: bool) -> None:
        """ggml_vec_scale_f16/f32: y = y * ms (f16: widened, scaled, rounded)."""
        dt = "f16" if f16 else "f32"
        size = 2 if f16 else 4
        with em.loop(0, DV, name="sc") as i:
            y = em.to_f32(em.load(storage_type(dt), acc, em.mul(i, size)), dt)
            em.store(em.from_f32(em.b.fmul(y, ms), dt), acc, em.mul(i, size))

    def _mad_acc(self, em: Emitter, acc, vrow, v_dt: str, DV, vs, f16: bool) -> None:
        """ggml_vec_mad_f16/f32: y = fma(v, vs, y) (f16: rounded back to f16)."""
        dt = "f16" if f16 else "f32"
        size = 2 if f16 else 4
        with em.loop(0, DV, name="mad") as i:
            y = em.to_f32(em.load(storage_type(dt), acc, em.mul(i, size)), dt)
            x = em.to_f32(em.load(storage_type(v_dt), vrow, em.mul(i, _size(v_dt))), v_dt)
            em.store(em.from_f32(em.fma(x, vs, y), dt), acc, em.mul(i, size))


def _size(dt: str) -> int:
    return {"f32": 4, "f16": 2, "bf16": 2}[dt]
