"""kir's SIMT primitives: each run on the emulator against numpy, and each one's PTX through
ptxas (a wrong intrinsic name only shows there, as an undefined .extern)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from cuda_common import assert_assembles
from llamir_cuda import kir
from llamir_cuda.driver import DriverError
from llamir_cuda.emulator import shared_emulator
from llamir_cuda.kir import F32, I32, scalar, tensor


@pytest.fixture(scope="module")
def ctx():
    return shared_emulator().context(0)


def _run(ctx, kernel, grid, arrays, scalars=()):
    """Launch over device copies of `arrays` (1-d, contiguous); their values afterwards."""
    ptrs, args = [], []
    for a in arrays:
        p = ctx.alloc(a.nbytes)
        ctx.memcpy_htod_async(p, a)
        ptrs.append(p)
        n = a.size
        args += [p, n, 1, 1, 1, a.itemsize, a.nbytes, a.nbytes, a.nbytes]
    ctx.launch(ctx.load(kernel), grid, kernel.block, args + list(scalars))
    out = []
    for a, p in zip(arrays, ptrs, strict=True):
        r = np.empty_like(a)
        ctx.memcpy_dtoh_async(r, p)
        ctx.free(p)
        out.append(r)
    return out


def _elementwise(name, fn, block=128):
    """out[i] = fn(k, x[i]) for one f32 input."""

    def body(k):
        x, y = k.args["x"], k.args["y"]
        i = k.global_id()
        with k.if_then(k.b.icmp_signed("<", i, x.ne[0])):
            k.store(fn(k, k.load(x.ptr, F32, k.offset(x, i))), y.ptr, k.offset(y, i))

    return kir.define(name, (), (tensor("x"), tensor("y")), block, body)


def test_reductions(ctx):
    """warp_sum (butterfly: every lane gets the total), warp_max, block_reduce over 256 threads."""

    def body(k):
        b, x, y = k.b, k.args["x"], k.args["y"]
        i = k.global_id()
        v = k.load(x.ptr, F32, k.offset(x, i))
        ws, wm = k.warp_sum(v), k.warp_max(v)
        bs = k.block_reduce(v, b.fadd, k.f32(0.0))
        base = b.mul(i, k.i32(3))
        for j, val in enumerate((ws, wm, bs)):
            k.store(val, y.ptr, k.offset(y, b.add(base, k.i32(j))))

    kern = kir.define("t_reduce", (), (tensor("x"), tensor("y")), 256, body)
    x = np.random.default_rng(0).standard_normal(512).astype(np.float32)
    _, y = _run(ctx, kern, (2, 1, 1), [x, np.zeros(512 * 3, np.float32)])
    y = y.reshape(512, 3)
    np.testing.assert_allclose(y[:, 0], x.reshape(-1, 32).sum(1).repeat(32), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(y[:, 1], x.reshape(-1, 32).max(1).repeat(32))
    np.testing.assert_allclose(y[:, 2], x.reshape(-1, 256).sum(1).repeat(256), rtol=1e-5, atol=1e-4)
    assert_assembles([kern])


def test_math_functions(ctx):
    """sincos (double reduction: accurate at rope's large angles), exp, tanh, erf."""
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.uniform(-10, 10, 200), rng.uniform(-1e5, 1e5, 56)]).astype(np.float32)
    xd = x.astype(np.float64)
    cases = {
        "sin": (lambda k, v: k.sincos(v)[0], np.sin(xd), 1e-7),
        "cos": (lambda k, v: k.sincos(v)[1], np.cos(xd), 1e-7),
        "exp": (lambda k, v: k.exp(k.b.fmul(k.fmin(v, k.f32(10.0)), k.f32(0.1))),
                np.exp(np.minimum(xd, 10.0) * np.float32(0.1)), 1e-6),
        "tanh": (lambda k, v: k.tanh(v), np.tanh(xd), 1e-6),
        "erf": (lambda k, v: k.erf(k.b.fmul(v, k.f32(0.3))), np.vectorize(math.erf)(xd * np.float32(0.3)), 6e-7),
    }
    for name, (fn, ref, tol) in cases.items():
        kern = _elementwise(f"t_{name}", fn)
        _, y = _run(ctx, kern, (2, 1, 1), [x, np.zeros_like(x)])
        err = np.abs(y - ref) / np.maximum(np.abs(ref), 1.0)
        assert err.max() <= tol, (name, float(err.max()))
        assert_assembles([kern])


def test_mma_f16_fragments(ctx):
    """mma_f16 is D = A B + C of a 16x16 A, 16x8 B, in the PTX ISA's fragment layout for
    m16n8k16 (groupID = lane / 4, threadID_in_group = lane % 4): packed here from the ISA's
    tables, independently of the emulator."""
    rng = np.random.default_rng(2)
    A = rng.standard_normal((16, 16)).astype(np.float16)
    B = rng.standard_normal((16, 8)).astype(np.float16)
    C = rng.standard_normal((16, 8)).astype(np.float32)
    a_words = np.zeros((32, 4), np.uint32)
    b_words = np.zeros((32, 2), np.uint32)
    c_vals = np.zeros((32, 4), np.float32)

    def pair(x0, x1):
        return int(np.array([x0, x1], np.float16).view(np.uint32)[0])

    for lane in range(32):
        g, t = lane // 4, lane % 4
        a_words[lane] = [pair(A[g, 2 * t], A[g, 2 * t + 1]), pair(A[g + 8, 2 * t], A[g + 8, 2 * t + 1]),
                         pair(A[g, 2 * t + 8], A[g, 2 * t + 9]), pair(A[g + 8, 2 * t + 8], A[g + 8, 2 * t + 9])]
        b_words[lane] = [pair(B[2 * t, g], B[2 * t + 1, g]), pair(B[2 * t + 8, g], B[2 * t + 9, g])]
        c_vals[lane] = [C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1]]

    def body(k):
        b = k.b
        fa, fb, fc, fd = (k.args[n] for n in ("a", "b", "c", "d"))
        lane = k.lane()
        a = [k.load(fa.ptr, I32, k.offset(fa, b.add(b.mul(lane, k.i32(4)), k.i32(j)))) for j in range(4)]
        bb = [k.load(fb.ptr, I32, k.offset(fb, b.add(b.mul(lane, k.i32(2)), k.i32(j)))) for j in range(2)]
        c = [k.load(fc.ptr, F32, k.offset(fc, b.add(b.mul(lane, k.i32(4)), k.i32(j)))) for j in range(4)]
        for j, v in enumerate(k.mma_f16(a, bb, c)):
            k.store(v, fd.ptr, k.offset(fd, b.add(b.mul(lane, k.i32(4)), k.i32(j))))

    kern = kir.define("t_mma", (), (tensor("a"), tensor("b"), tensor("c"), tensor("d")), 32, body)
    *_, d = _run(ctx, kern, (1, 1, 1), [a_words.ravel(), b_words.ravel(), c_vals.ravel(), np.zeros(128, np.float32)])
    D = A.astype(np.float64) @ B.astype(np.float64) + C
    got = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        got[g, 2 * t], got[g, 2 * t + 1], got[g + 8, 2 * t], got[g + 8, 2 * t + 1] = d.reshape(32, 4)[lane]
    np.testing.assert_allclose(got, D, rtol=1e-5, atol=1e-5)
    assert_assembles([kern])


def test_dp4a(ctx):
    def body(k):
        b, x, y = k.b, k.args["x"], k.args["y"]
        i = k.global_id()
        u = k.load(x.ptr, I32, k.offset(x, i))
        v = k.load(x.ptr, I32, k.offset(x, b.xor(i, k.i32(1))))
        k.store(k.dp4a(u, v, k.i32(7)), y.ptr, k.offset(y, i))

    kern = kir.define("t_dp4a", (), (tensor("x"), tensor("y")), 32, body)
    x = np.random.default_rng(3).integers(-128, 128, (32, 4)).astype(np.int8)
    _, y = _run(ctx, kern, (1, 1, 1), [x.view(np.int32).ravel(), np.zeros(32, np.int32)])
    ref = (x.astype(np.int32) * x[np.arange(32) ^ 1].astype(np.int32)).sum(1) + 7
    np.testing.assert_array_equal(y, ref)
    assert_assembles([kern])


def test_divergent_barrier_is_reported(ctx):
    """Half a block at a barrier the other half never reaches: the launch fails, naming it."""

    def body(k):
        b = k.b
        with k.if_then(b.icmp_unsigned("<", k.tid(0), k.i32(16))):
            k.barrier()
        with k.if_then(b.icmp_unsigned(">=", k.tid(0), k.i32(16))):
            k.shfl_xor(k.tid(0), 1)

    kern = kir.define("t_diverge", (), (scalar("n", "i"),), 64, body)
    with pytest.raises(DriverError, match="divergent barrier"):
        ctx.launch(ctx.load(kern), (1, 1, 1), (64, 1, 1), [0])


def test_launch_checks_its_arguments(ctx):
    kern = _elementwise("t_copy", lambda k, v: v)
    with pytest.raises(DriverError, match="takes 18 arguments, got 1"):
        ctx.launch(ctx.load(kern), (1, 1, 1), kern.block, [0])
    with pytest.raises(DriverError, match="built for blocks of"):
        ctx.launch(ctx.load(kern), (1, 1, 1), (64, 1, 1), [0] * 18)
