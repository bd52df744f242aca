"""ssm_conv and ssm_scan as ggml's CPU backend computes them (ir/interp_ssm.py is the reference).

Both take their batch sizes at run time: n_s, n_t, n_rs and the strides that follow them are
run-time arguments even when a graph has them concrete, so one function serves every ubatch.

- SsmConv: each thread takes a share of the d_inner channels (ggml's row split); a channel's
  d_conv taps are loaded once, and each output sums its window from 0 in order, rounded products
  for the whole fused_tail groups of taps, then fmas (as GCC compiles ggml's loop).
- SsmScan: each thread takes a share of the heads (ggml's head split) and walks every sequence's
  tokens in order; the state lives in the result (block 0), read back from there after the first
  token. Mamba-1 (A [H, ds]) calls libm's expf per state, Mamba-2 (A [H, 1]) once per head and dots
  with ggml's four accumulators of the profile's lanes; K > 1 copies the state into its snapshot
  block after the tokens that end 1..K-1 tokens early, and zeroes the blocks no token reaches.
"""

from __future__ import annotations

import llvmlite.ir as ir

from llamir.backends.llvm import vmath
from llamir.backends.llvm.codegen import report_error
from llamir.backends.llvm.emit import F32, I32, Emitter, vec
from llamir.backends.llvm.executable import ERR_INDEX
from llamir.backends.llvm.plan import Kernel, Ref
from llamir.ir.interp_ssm import conv_fused_from


class SsmConv(Kernel):
    """y [n_s, n_t, d_inner] = the d_conv-tap conv of sx [n_s, d_inner, d_conv - 1 + n_t] (any
    strides) with c [d_inner, d_conv] (packed rows); y contiguous."""

    # n_s, n_t, and sx's and y's strides that follow them
    runtime_ints = (0, 1, 3, 4, 7)

    def __init__(self, y: Ref, sx: Ref, c: Ref):
        self.d_conv = int(c.shape[1])
        self.n_ptrs = 3
        super().__init__([sx.shape[0], y.shape[1], sx.shape[1], *sx.strides, c.strides[0], *y.strides[:2]])

    def config(self) -> tuple:
        return (self.d_conv,)

    def emit(self, em: Emitter, a) -> None:
        n_s, n_t, d_inner = a.ints[0:3]
        sx_seq, sx_chan, sx_col = a.ints[3:6]
        c_chan = a.ints[6]
        y_seq, y_tok = a.ints[7:9]
        fused_from = conv_fused_from(self.d_conv, em.numerics)
        c0, c1 = em.split(d_inner, a.ith, a.nth)
        with em.loop(c0, c1, name="chan") as i:
            crow = em.gep(a.ptrs[2], em.mul(i, c_chan))
            taps = [em.load(F32, crow, 4 * k) for k in range(self.d_conv)]
            with em.loop(0, n_s, name="seq") as s:
                window = em.gep(a.ptrs[1], em.add(em.mul(s, sx_seq), em.mul(i, sx_chan)))
                yrow = em.gep(a.ptrs[0], em.add(em.mul(s, y_seq), em.mul(i, 4)))
                with em.loop(0, n_t, name="tok") as t:
                    acc = em.f32(0.0)
                    for k, tap in enumerate(taps):
                        v = em.load(F32, window, em.mul(em.add(t, k), sx_col))
                        acc = em.b.fadd(acc, em.b.fmul(v, tap)) if k < fused_from else em.fma(v, tap, acc)
                    em.store(acc, yrow, em.mul(t, y_tok))


class SsmScan(Kernel):
    """The 1-D result of ssm_scan (y, then K state blocks) from s [n_rs, H, hd, ds] (contiguous),
    x [n_s, n_t, H, hd] and dt [n_s, n_t, H] (any strides), A [H, ds or 1], B and C
    [n_s, n_t, G, ds] (packed rows), ids i32 [n_s] (checked against n_rs)."""

    # n_s, n_t, n_rs, and the sequence strides of x, dt, B and C (they follow n_t)
    runtime_ints = (0, 1, 6, 8, 12, 16, 19)

    def __init__(self, out: Ref, s: Ref, x: Ref, dt: Ref, A: Ref, B: Ref, C: Ref, ids: Ref, K: int, site):
        self.K = int(K)
        self.mamba2 = A.shape[1] == 1
        self.n_ptrs = 8
        n_s, n_t, n_head, head_dim = x.shape
        super().__init__([n_s, n_t, n_head, head_dim, s.shape[3], B.shape[2], s.shape[0], s.strides[0],
                          *x.strides, *dt.strides, A.strides[0], *B.strides[:3], *C.strides[:3], ids.strides[0],
                          site])

    def config(self) -> tuple:
        return (self.K, self.mamba2)

    def emit(self, em: Emitter, a) -> None:
        b = em.b
        n_s, n_t, n_head, head_dim, d_state, n_group, n_rs, slot_step = a.ints[0:8]
        ids_step, site = a.ints[22], a.ints[23]
        head_bytes = em.mul(em.mul(head_dim, d_state), 4)
        seq_bytes = em.mul(n_head, head_bytes)
        states_at = em.mul(em.mul(em.mul(n_s, n_t), em.mul(n_head, head_dim)), 4)    # y's bytes
        h0, h1 = em.split(n_head, a.ith, a.nth)
        mine = (em.mul(h0, head_bytes), em.mul(h1, head_bytes))                    # this thread's bytes of a block
        with em.loop(0, n_s, name="seq") as q:
            slot = em.i64(em.load(I32, a.ptrs[7], em.mul(q, ids_step)))
            ok = b.and_(em.icmp(">=", slot, 0), em.icmp("<", slot, n_rs))
            with em.if_(b.not_(ok)):
                report_error(em, a.frame, ERR_INDEX, slot, site)
            with em.if_(ok):
                first = em.gep(a.ptrs[1], em.mul(slot, slot_step))
                last = em.gep(a.ptrs[0], em.add(states_at, em.mul(q, seq_bytes)))
                with em.loop(0, n_t, name="tok") as t:
                    src = b.select(em.icmp("==", t, 0), first, last)
                    with em.loop(h0, h1, name="head") as h:
                        self._head(em, a, q, t, h, src, last)
                    if self.K > 1:
                        back = em.sub(em.sub(n_t, 1), t)
                        with em.if_(b.and_(em.icmp(">", back, 0), em.icmp("<", back, self.K))):
                            snap = em.add(states_at, em.mul(em.add(em.mul(back, n_s), q), seq_bytes))
                            _copy(em, em.gep(a.ptrs[0], snap), last, *mine)
                with em.if_(em.icmp("==", n_t, 0)):          # no token: the last state is the first
                    _copy(em, last, first, *mine)
                if self.K > 1:
                    with em.loop(em.max(n_t, 1), self.K, name="unset") as k:
                        block = em.add(states_at, em.mul(em.add(em.mul(k, n_s), q), seq_bytes))
                        _zero(em, em.gep(a.ptrs[0], block), *mine)

    def _head(self, em: Emitter, a, q, t, h, src, dst) -> None:
        """Head h of sequence q at token t: its states from src to dst, its outputs into y."""
        b = em.b
        n_t, n_head, head_dim, d_state, n_group = a.ints[1], a.ints[2], a.ints[3], a.ints[4], a.ints[5]
        xs, dts, a_row, bs, cs = a.ints[8:12], a.ints[12:15], a.ints[15], a.ints[16:19], a.ints[19:22]
        g = em.div(h, em.div(n_head, n_group))
        dt = em.load(F32, a.ptrs[3], em.offset((q, t, h), dts))
        soft = vmath.libm(em, "logf", b.fadd(em.f32(1.0), vmath.expf(em, dt)))
        d = b.select(b.fcmp_ordered(">", dt, em.f32(20.0)), dt, soft)    # ggml_compute_softplus_f32
        xrow = em.gep(a.ptrs[2], em.offset((q, t, h), xs[:3]))
        arow = em.gep(a.ptrs[4], em.mul(h, a_row))
        brow = em.gep(a.ptrs[5], em.offset((q, t, g), bs))
        crow = em.gep(a.ptrs[6], em.offset((q, t, g), cs))
        yrow = em.gep(a.ptrs[0], em.mul(em.add(em.mul(em.add(em.mul(q, n_t), t), n_head), h), em.mul(head_dim, 4)))
        head_bytes = em.mul(em.mul(head_dim, d_state), 4)
        decay = vmath.expf(em, b.fmul(d, em.load(F32, arow))) if self.mamba2 else None
        with em.loop(0, head_dim, name="dim") as i:
            x_dt = b.fmul(em.load(F32, xrow, em.mul(i, xs[3])), d)
            row = em.add(em.mul(h, head_bytes), em.mul(i, em.mul(d_state, 4)))
            rows = (em.gep(src, row), em.gep(dst, row), brow, crow)
            if self.mamba2:
                total = _row_mamba2(em, rows, d_state, decay, x_dt)
            else:
                total = _row_mamba1(em, rows, d_state, arow, d, x_dt)
            em.store(total, yrow, em.mul(i, 4))


def _row_mamba1(em: Emitter, rows, d_state, arow, d, x_dt) -> ir.Value:
    """h[k] = fma(h[k], expf(d*A[k]), B[k]*x_dt) and sum fma(h[k], C[k], sum), k in order."""
    b = em.b
    src, dst, brow, crow = rows
    acc = em.var(F32, em.f32(0.0))
    with em.loop(0, d_state, name="state") as k:
        off = em.mul(k, 4)
        decay = vmath.expf(em, b.fmul(d, em.load(F32, arow, off)))
        h = em.fma(em.load(F32, src, off), decay, b.fmul(em.load(F32, brow, off), x_dt))
        em.store(h, dst, off)
        em.set(acc, em.fma(h, em.load(F32, crow, off), em.get(acc)))
    return em.get(acc)


def _row_mamba2(em: Emitter, rows, d_state, decay, x_dt) -> ir.Value:
    """ggml's GGML_SIMD loop: four accumulators of `lanes` over whole steps of 4*lanes states,
    GGML_F32_VEC_REDUCE (zero when there is no whole step), then the rest one fma at a time."""
    b = em.b
    src, dst, brow, crow = rows
    lanes = vmath.lanes(em)
    step = 4 * lanes
    vt = vec(F32, lanes)
    whole = em.mul(em.div(d_state, step), step)
    decay_v, x_dt_v = em.splat(decay, lanes), em.splat(x_dt, lanes)
    accs = [em.var(vt, ir.Constant(vt, [0.0] * lanes)) for _ in range(4)]
    with em.loop(0, whole, step, name="vstate") as k:
        for j, acc in enumerate(accs):
            off = em.mul(em.add(k, j * lanes), 4)
            h = em.fma(em.load(vt, src, off), decay_v, b.fmul(em.load(vt, brow, off), x_dt_v))
            em.store(h, dst, off)
            em.set(acc, em.fma(h, em.load(vt, crow, off), em.get(acc)))
    total = em.var(F32, vmath.reduce_accumulators(em, [em.get(acc) for acc in accs]))
    with em.loop(whole, d_state, name="state") as k:
        off = em.mul(k, 4)
        h = em.fma(em.load(F32, src, off), decay, b.fmul(em.load(F32, brow, off), x_dt))
        em.store(h, dst, off)
        em.set(total, em.fma(h, em.load(F32, crow, off), em.get(total)))
    return em.get(total)


def _copy(em: Emitter, dst, src, start, stop) -> None:
    """dst[start:stop] = src[start:stop] (byte offsets, whole floats)."""
    with em.loop(start, stop, 4, name="copy") as off:
        em.store(em.load(F32, src, off), dst, off)


def _zero(em: Emitter, dst, start, stop) -> None:
    with em.loop(start, stop, 4, name="zero") as off:
        em.store(em.f32(0.0), dst, off)
