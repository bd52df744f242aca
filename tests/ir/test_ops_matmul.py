"""mul_mat, mul_mat_id, get_rows and set_rows of the reference interpreter against explicit
float64 loops, with ggml's batch broadcast (GQA), vec_dot_type rounding and in-place writes."""

from __future__ import annotations

import numpy as np
import pytest

from llamir.ir import BF16, F16, F32, I32, I64, Q8_0, GraphBuilder, IRError, run_graph
from llamir.ir.interp import InterpError

f32, f16, f64 = np.float32, np.float16, np.float64


def _rand(shape, seed, dtype=f32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def mul_mat_ref(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """y[..., n, m] = sum_k a[..., m, k] b[..., n, k], a's batch i // (B_b / B_a) serving b's i."""
    rank = max(a.ndim, b.ndim)
    a = a.reshape((1,) * (rank - a.ndim) + a.shape).astype(f64)
    b = b.reshape((1,) * (rank - b.ndim) + b.shape).astype(f64)
    out = np.zeros(b.shape[:-2] + (b.shape[-2], a.shape[-2]))
    for idx in np.ndindex(*b.shape[:-2]):
        a_idx = tuple(i // (nb // na) for i, na, nb in zip(idx, a.shape[:-2], b.shape[:-2], strict=True))
        for n in range(b.shape[-2]):
            for m in range(a.shape[-2]):
                out[idx + (n, m)] = sum(a[a_idx + (m, k)] * b[idx + (n, k)] for k in range(a.shape[-1]))
    return out


def _mul_mat(a: np.ndarray, b: np.ndarray, a_dtype=F32, a_shape=None):
    g = GraphBuilder("t")
    y = g.mul_mat(g.weight("a", a_shape or a.shape, a_dtype), g.input("b", b.shape, F32))
    g.output("y", y)
    return run_graph(g.graph, {"a": a, "b": b})["y"]


# -- mul_mat -------------------------------------------------------------------------------------
MATMUL_SHAPES = [
    ((5, 7), (1, 7)),                    # one activation row
    ((1, 3), (4, 3)),
    ((13, 9), (6, 9)),
    ((2, 5, 8), (6, 3, 8)),              # GQA: b batches 0-2 use a batch 0, 3-5 use a batch 1
    ((6, 4, 3), (6, 2, 3)),
    ((1, 2, 4, 6), (3, 4, 5, 6)),        # axis 0 broadcast from 1, axis 1 repeats 2 -> 4
    ((4, 6), (2, 3, 5, 6)),              # a 2-d weight against batched activations
]


@pytest.mark.parametrize("a_shape,b_shape", MATMUL_SHAPES)
def test_mul_mat_f32_with_batch_broadcast(a_shape, b_shape, nmse):
    a, b = _rand(a_shape, 1), _rand(b_shape, 2)
    got = _mul_mat(a, b)
    assert got.dtype == f32 and got.shape == b_shape[:-1] + (a_shape[-2],)
    assert nmse(got, mul_mat_ref(a, b)) < 1e-12


def test_mul_mat_gqa_is_not_modulo_broadcast(nmse):
    """a's batch i // 2 (consecutive heads share a KV head), not i % 2 like binary-op tiling."""
    a, b = _rand((2, 3, 4), 3), _rand((4, 1, 4), 4)
    got = _mul_mat(a, b)
    for h in range(4):
        np.testing.assert_allclose(got[h], b[h].astype(f64) @ a[h // 2].T, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n_tokens", [1, 3, 7])
def test_mul_mat_symbolic_and_strided(n_tokens, nmse):
    """kq = mul_mat(k, q) with k and q read through permutes, like llama.cpp's attention."""
    k, q = _rand((5, 2, 4), n_tokens), _rand((n_tokens, 4, 4), n_tokens + 1)
    g = GraphBuilder("t", dims=["T"])
    kp = g.permute(g.input("k", [5, 2, 4], F32), 1, 0, 2)               # [Hkv=2, n_kv=5, d]
    qp = g.permute(g.input("q", ["T", 4, 4], F32), 1, 0, 2)             # [H=4, T, d]
    g.output("kq", g.mul_mat(kp, qp))                                   # [4, T, 5]
    g.output("kt", g.mul_mat(g.transpose(g.input("w", [4, 3], F32)), g.reshape(g.input("q2", [
        "T", 4], F32), g.dim("T"), 4)))                                 # weight read transposed
    w, q2 = _rand((4, 3), 9), _rand((n_tokens, 4), 10)
    out = run_graph(g.graph, {"k": k, "q": q, "w": w, "q2": q2}, {"T": n_tokens})
    assert out["kq"].shape == (4, n_tokens, 5)
    assert nmse(out["kq"], mul_mat_ref(np.transpose(k, (1, 0, 2)), np.transpose(q, (1, 0, 2)))) < 1e-12
    assert nmse(out["kt"], q2.astype(f64) @ w) < 1e-12


def test_mul_mat_f16_weight_rounds_activations_to_f16(nmse):
    a = _rand((6, 64), 5, f16)
    b = _rand((3, 64), 6)
    got = _mul_mat(a, b, F16)
    rounded = mul_mat_ref(a.astype(f32), b.astype(f16).astype(f32))
    exact = mul_mat_ref(a.astype(f32), b)
    assert nmse(got, rounded) < 1e-13
    assert nmse(got, exact) > 100 * nmse(got, rounded)   # the rounding is really there


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    u = x.astype(f32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _bf16_values(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(f32)


def test_mul_mat_bf16_weight_rounds_activations_to_bf16(nmse):
    a = _bf16_bits(_rand((5, 32), 7))
    b = _rand((4, 32), 8)
    got = _mul_mat(a, b, BF16)
    rounded = mul_mat_ref(_bf16_values(a), _bf16_values(_bf16_bits(b)))
    assert nmse(got, rounded) < 1e-13
    assert nmse(got, mul_mat_ref(_bf16_values(a), b)) > 100 * nmse(got, rounded)


def _q8_0_bytes(d: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Rows of Q8_0 blocks: [..., nb] f16 scales and [..., nb, 32] int8 -> [..., nb * 34] bytes."""
    d_bytes = d.astype(f16)[..., None].view(np.uint8)
    blocks = np.concatenate([d_bytes, q.astype(np.int8).view(np.uint8)], axis=-1)
    return blocks.reshape(d.shape[:-1] + (-1,))


def test_mul_mat_q8_0_closed_form(nmse):
    """Activations that q8_0 represents exactly (power-of-two scales, amax = 127 d), so ggml's
    product is sum_blocks d_a d_b sum(q_a q_b), whatever its rounding mode."""
    rng = np.random.default_rng(9)
    d_a = rng.uniform(0.01, 0.1, (5, 2)).astype(f16)
    q_a = rng.integers(-127, 128, (5, 2, 32))
    d_b = np.array([[0.25, 0.5], [2.0, 0.125], [1.0, 1.0]], dtype=f32)
    q_b = rng.integers(-126, 127, (3, 2, 32))
    q_b[..., 7] = 127 * np.sign(rng.standard_normal((3, 2)) + 1e-9).astype(int)
    a = _q8_0_bytes(d_a, q_a)
    b = (q_b * d_b[..., None]).reshape(3, 64).astype(f32)
    got = _mul_mat(a, b, Q8_0, a_shape=(5, 64))
    want = np.einsum("mj,nj,mjk,njk->nm", d_a.astype(f64), d_b.astype(f64), q_a, q_b)
    assert nmse(got, want) < 1e-13


def test_mul_mat_q8_0_random_activations_within_quantization_noise(nmse):
    rng = np.random.default_rng(10)
    d_a = rng.uniform(0.01, 0.1, (7, 3)).astype(f16)
    q_a = rng.integers(-127, 128, (7, 3, 32))
    b = _rand((4, 96), 11)
    got = _mul_mat(_q8_0_bytes(d_a, q_a), b, Q8_0, a_shape=(7, 96))
    a_values = (d_a.astype(f64)[..., None] * q_a).reshape(7, 96)
    # 8-bit activations: per-element error <= d_b / 2 = amax / 254, so nmse ~ 1e-5
    assert nmse(got, b.astype(f64) @ a_values.T) < 1e-4


@pytest.mark.parametrize("dtype", [F16, Q8_0])
def test_mul_mat_with_weight_cache_matches_a_fresh_interpreter(dtype):
    from llamir.ir.interp import Interpreter

    rng = np.random.default_rng(30)
    a = _rand((2, 64), 31, f16) if dtype == F16 else _q8_0_bytes(rng.uniform(0.01, 0.1, (2, 2)).astype(f16),
                                                                 rng.integers(-127, 128, (2, 2, 32)))
    g = GraphBuilder("t", dims=["T"])
    g.output("y", g.mul_mat(g.weight("a", [2, 64], dtype), g.input("b", ["T", 64], F32)))
    cached = Interpreter(cache_weights=True)
    for n_tokens in (1, 3, 1):
        b = _rand((n_tokens, 64), n_tokens)
        fresh = run_graph(g.graph, {"a": a, "b": b}, {"T": n_tokens})["y"]
        np.testing.assert_array_equal(cached.run(g.graph, {"a": a, "b": b}, {"T": n_tokens})["y"], fresh)


def test_weight_cache_never_serves_a_freed_weights_memory():
    """The cache keys prepared weights by address; a weight freed and another allocated at the
    same address must not get the old one's result, so an entry keeps its memory alive."""
    import gc
    import weakref

    from llamir.ir.interp import Interpreter

    g = GraphBuilder("t")
    g.output("y", g.mul_mat(g.weight("a", [4, 64], F16), g.input("b", [2, 64], F32)))
    cached, b = Interpreter(cache_weights=True, exact=False), _rand((2, 64), 2)
    for seed in range(4):   # fresh arrays of one size: the allocator hands addresses out again
        a = _rand((4, 64), 40 + seed, f16)
        want = Interpreter(exact=False).run(g.graph, {"a": a, "b": b})["y"]
        np.testing.assert_array_equal(cached.run(g.graph, {"a": a, "b": b})["y"], want)
        alive = weakref.ref(a)
        del a
        gc.collect()
        assert alive() is not None   # held by the cache entry: its address is not reused


# -- mul_mat_id ----------------------------------------------------------------------------------
@pytest.mark.parametrize("n_b", [1, 2])
@pytest.mark.parametrize("n_tokens", [1, 3])
def test_mul_mat_id(n_b, n_tokens, nmse):
    n_expert, m, k, top = 4, 5, 8, 2
    w, b = _rand((n_expert, m, k), 12), _rand((n_tokens, n_b, k), 13)
    ids = np.array([[3, 0], [1, 1], [2, 3]][:n_tokens], dtype=np.int32)
    g = GraphBuilder("t", dims=["T"])
    y = g.mul_mat_id(g.weight("w", [n_expert, m, k], F32), g.input("b", ["T", n_b, k], F32),
                     g.input("ids", ["T", top], I32))
    g.output("y", y)
    got = run_graph(g.graph, {"w": w, "b": b, "ids": ids}, {"T": n_tokens})["y"]
    want = np.zeros((n_tokens, top, m))
    for t in range(n_tokens):
        for i in range(top):
            want[t, i] = w[ids[t, i]].astype(f64) @ b[t, i % n_b]
    assert got.shape == (n_tokens, top, m)
    assert nmse(got, want) < 1e-12


def test_mul_mat_id_expert_out_of_range():
    g = GraphBuilder("t")
    g.output("y", g.mul_mat_id(g.weight("w", [2, 3, 4], F32), g.input("b", [1, 1, 4], F32),
                               g.input("ids", [1, 1], I32)))
    with pytest.raises(InterpError, match="expert id 2 .* outside"):
        run_graph(g.graph, {"w": _rand((2, 3, 4), 1), "b": _rand((1, 1, 4), 2),
                            "ids": np.array([[2]], dtype=np.int32)})


# -- get_rows ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F32, F16, I32])
@pytest.mark.parametrize("n_rows", [1, 3, 7])
def test_get_rows_2d(dtype, n_rows):
    a = (_rand((9, 5), 14) * 100).astype(dtype.np_dtype)
    idx = np.array([8, 0, 3, 3, 1, 8, 2][:n_rows], dtype=np.int32)
    g = GraphBuilder("t", dims=["N"])
    y = g.get_rows(g.weight("a", [9, 5], dtype), g.input("idx", ["N"], I32))
    g.output("y", y)
    got = run_graph(g.graph, {"a": a, "idx": idx}, {"N": n_rows})["y"]
    want = np.array([[a[i, j] for j in range(5)] for i in idx])
    assert got.dtype == (np.int32 if dtype == I32 else f32)      # floats come back as f32
    np.testing.assert_array_equal(got, want.astype(got.dtype))


def test_get_rows_bf16_is_exact():
    bits = _bf16_bits(_rand((4, 6), 15))
    g = GraphBuilder("t")
    g.output("y", g.get_rows(g.weight("a", [4, 6], BF16), g.input("idx", [2], I32)))
    got = run_graph(g.graph, {"a": bits, "idx": np.array([3, 1], dtype=np.int32)})["y"]
    np.testing.assert_array_equal(got, _bf16_values(bits[[3, 1]]))


@pytest.mark.parametrize("a_shape,idx_shape", [((3, 5, 4), (3, 2)), ((2, 3, 6, 4), (2, 3, 4)),
                                               ((1, 1, 2, 3), (1, 1, 5))])
def test_get_rows_with_batch_axes(a_shape, idx_shape):
    a = _rand(a_shape, 16)
    idx = np.random.default_rng(17).integers(0, a_shape[-2], idx_shape).astype(np.int32)
    g = GraphBuilder("t")
    g.output("y", g.get_rows(g.input("a", a_shape, F32), g.input("idx", idx_shape, I32)))
    got = run_graph(g.graph, {"a": a, "idx": idx})["y"]
    want = np.empty(idx_shape + a_shape[-1:], dtype=f32)
    for pos in np.ndindex(*idx_shape):
        want[pos] = a[pos[:-1] + (idx[pos],)]         # each batch picks from its own rows
    np.testing.assert_array_equal(got, want)


def test_get_rows_from_a_view_of_a_larger_buffer():
    buf = _rand((10, 8), 18)
    g = GraphBuilder("t")
    rows = g.view(g.input("buf", [10, 8], F32), [4, 5], [64, 4], offset=32 + 12)   # buf[1::2, 3:8][:4]
    g.output("y", g.get_rows(rows, g.input("idx", [3], I32)))
    got = run_graph(g.graph, {"buf": buf, "idx": np.array([3, 0, 2], dtype=np.int32)})["y"]
    np.testing.assert_array_equal(got, buf[1::2, 3:8][[3, 0, 2]])


def test_get_rows_q8_0_dequantizes():
    rng = np.random.default_rng(19)
    d = rng.uniform(0.01, 2, (6, 2)).astype(f16)
    q = rng.integers(-128, 128, (6, 2, 32))
    g = GraphBuilder("t")
    g.output("y", g.get_rows(g.weight("a", [6, 64], Q8_0), g.input("idx", [2], I32)))
    got = run_graph(g.graph, {"a": _q8_0_bytes(d, q), "idx": np.array([5, 2], dtype=np.int32)})["y"]
    want = (d.astype(f32)[..., None] * q.astype(f32)).reshape(6, 64)[[5, 2]]   # one f32 product each
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("bad", [9, -1])
def test_get_rows_index_out_of_range(bad):
    g = GraphBuilder("t")
    g.output("y", g.get_rows(g.weight("a", [9, 5], F32), g.input("idx", [2], I32)))
    with pytest.raises(InterpError, match=rf"get_rows index {bad} at \[1\] is outside \[0, 9\)"):
        run_graph(g.graph, {"a": _rand((9, 5), 1), "idx": np.array([0, bad], dtype=np.int32)})


# -- set_rows ------------------------------------------------------------------------------------
@pytest.mark.parametrize("idx_dtype", [I32, I64])
@pytest.mark.parametrize("dst_dtype", [F32, F16])
def test_set_rows_writes_the_state_in_place(idx_dtype, dst_dtype):
    cache = _rand((8, 6), 20, dst_dtype.np_dtype)
    before = cache.copy()
    src = _rand((3, 6), 21)
    idx = np.array([5, 0, 6], dtype=idx_dtype.np_dtype)
    g = GraphBuilder("t", dims=["T"])
    out = g.set_rows(g.state("cache", [8, 6], dst_dtype), g.input("src", ["T", 6], F32),
                     g.input("idx", ["T"], idx_dtype))
    g.output("y", out)
    got = run_graph(g.graph, {"cache": cache, "src": src, "idx": idx}, {"T": 3})["y"]
    want = before.copy()
    for i, row in zip(idx, src, strict=True):
        want[i] = row.astype(dst_dtype.np_dtype)        # f32 -> f16 rounds to nearest even
    np.testing.assert_array_equal(cache, want)          # the caller's array was written
    np.testing.assert_array_equal(got, want)
    untouched = [r for r in range(8) if r not in idx]
    np.testing.assert_array_equal(cache[untouched], before[untouched])


@pytest.mark.parametrize("idx_rows", [1, 2, 4])
def test_set_rows_with_batch_axis_and_repeated_indices(idx_rows):
    """dst [B2, R, C], src [B2, N, C], idx [B2', N]: batch b2 uses index row b2 % B2'."""
    cache = _rand((4, 6, 3), 22)
    before = cache.copy()
    src = _rand((4, 2, 3), 23)
    rng = np.random.default_rng(idx_rows)
    idx = np.stack([rng.permutation(6)[:2] for _ in range(idx_rows)]).astype(np.int32)
    g = GraphBuilder("t")
    g.output("y", g.set_rows(g.state("cache", [4, 6, 3], F32), g.input("src", [4, 2, 3], F32),
                             g.input("idx", [idx_rows, 2], I32)))
    run_graph(g.graph, {"cache": cache, "src": src, "idx": idx})
    want = before.copy()
    for b2 in range(4):
        for n in range(2):
            want[b2, idx[b2 % idx_rows, n]] = src[b2, n]
    np.testing.assert_array_equal(cache, want)


def test_set_rows_rank_4_with_broadcast_index_batches():
    """dst [B3, B2, R, C], idx [B3', B2', N]: batch (b3, b2) uses index row (b3 % B3', b2 % B2')."""
    cache = _rand((2, 3, 5, 2), 27)
    before = cache.copy()
    src = _rand((2, 3, 2, 2), 28)
    idx = np.array([[[4, 0]], [[1, 3]]], dtype=np.int32)            # [2, 1, 2]
    g = GraphBuilder("t")
    g.output("y", g.set_rows(g.state("cache", [2, 3, 5, 2], F32), g.input("src", [2, 3, 2, 2], F32),
                             g.input("idx", [2, 1, 2], I32)))
    run_graph(g.graph, {"cache": cache, "src": src, "idx": idx})
    want = before.copy()
    for b3 in range(2):
        for b2 in range(3):
            for n in range(2):
                want[b3, b2, idx[b3 % 2, b2 % 1, n]] = src[b3, b2, n]
    np.testing.assert_array_equal(cache, want)


def test_set_rows_through_a_view_of_the_cache_then_read_back():
    """Layer 1 of a [2, n_ctx, C] cache is written through a view; a later get_rows sees it."""
    cache = _rand((2, 6, 4), 24)
    before = cache.copy()
    src = _rand((2, 4), 25)
    g = GraphBuilder("t")
    layer1 = g.view(g.state("cache", [2, 6, 4], F32), [6, 4], [16, 4], offset=6 * 16)
    written = g.set_rows(layer1, g.input("src", [2, 4], F32), g.input("idx", [2], I32))
    g.output("read", g.get_rows(written, g.input("read_idx", [3], I32)))
    out = run_graph(g.graph, {"cache": cache, "src": src, "idx": np.array([4, 1], dtype=np.int32),
                              "read_idx": np.array([1, 2, 4], dtype=np.int32)})
    want = before.copy()
    want[1, [4, 1]] = src
    np.testing.assert_array_equal(cache, want)                  # layer 0 untouched
    np.testing.assert_array_equal(out["read"], want[1, [1, 2, 4]])


def test_set_rows_out_of_range_leaves_the_state_untouched():
    cache = _rand((4, 3), 26)
    before = cache.copy()
    g = GraphBuilder("t")
    g.output("y", g.set_rows(g.state("cache", [4, 3], F32), g.input("src", [2, 3], F32),
                             g.input("idx", [2], I32)))
    with pytest.raises(InterpError, match=r"set_rows index 4 at \[1\] is outside \[0, 4\)"):
        run_graph(g.graph, {"cache": cache, "src": _rand((2, 3), 1), "idx": np.array([0, 4], dtype=np.int32)})
    np.testing.assert_array_equal(cache, before)


# -- type errors ---------------------------------------------------------------------------------
def test_matmul_and_rows_type_errors():
    g = GraphBuilder("t", dims=["T"])
    w = g.weight("w", [6, 8], F32)
    x = g.input("x", ["T", 8], F32)
    with pytest.raises(IRError, match=r"mul_mat: inner dims differ: f32\[6,8\] x f32\[T,6\]"):
        g.mul_mat(w, g.input("bad", ["T", 6], F32))
    with pytest.raises(IRError, match=r"mul_mat.*does not repeat"):
        g.mul_mat(g.weight("w3", [3, 6, 8], F32), g.input("x4", [4, 2, 8], F32))
    with pytest.raises(IRError, match=r"mul_mat.*b must be float, got q8_0"):
        g.mul_mat(g.weight("w64", [6, 64], F32), g.weight("q", [2, 64], Q8_0))
    with pytest.raises(IRError, match=r"mul_mat.*a must be float or quantized, got i32"):
        g.mul_mat(g.weight("wi", [6, 8], I32), x)
    with pytest.raises(IRError, match=r"get_rows.*indices must be i32, got f32"):
        g.get_rows(w, g.input("fi", [2], F32))
    with pytest.raises(IRError, match=r"get_rows.*must have rank 2"):
        g.get_rows(g.weight("w3b", [2, 6, 8], F32), g.input("i1", [3], I32))
    with pytest.raises(IRError, match=r"set_rows.*indices must be i32 or i64"):
        g.set_rows(g.state("c", [4, 8], F32), x, g.input("fi2", ["T"], F32))
    with pytest.raises(IRError, match=r"set_rows.*row lengths differ"):
        g.set_rows(g.state("c2", [4, 6], F32), x, g.input("ii", ["T"], I32))
    with pytest.raises(IRError, match=r"set_rows.*2 indices for T rows"):
        g.set_rows(g.state("c3", [4, 8], F32), x, g.input("i2", [2], I32))
    with pytest.raises(IRError, match=r"mul_mat_id.*ids must be i32"):
        g.mul_mat_id(g.weight("e", [2, 6, 8], F32), g.input("b3", ["T", 1, 8], F32),
                     g.input("ids", ["T", 2], I64))
