"""Views and layout copies of the reference interpreter, checked exactly against index
arithmetic on the raw buffer, numpy transposes and known f16/bf16 bit patterns."""

from __future__ import annotations

import numpy as np
import pytest

from llamir.ir import BF16, F16, F32, I32, Q8_0, GraphBuilder, IRError, dims, ops, run_graph
from llamir.ir.interp import InterpError

f32, f16 = np.float32, np.float16


def strided_ref(buf: np.ndarray, shape, byte_strides, byte_offset: int) -> np.ndarray:
    """y[idx] = flat(buf)[(offset + sum(idx * strides)) / itemsize], by explicit index arithmetic."""
    flat = np.ascontiguousarray(buf).reshape(-1)
    size = flat.itemsize
    out = np.empty(shape, dtype=buf.dtype)
    for idx in np.ndindex(*shape):
        byte = byte_offset + sum(i * s for i, s in zip(idx, byte_strides, strict=True))
        assert byte % size == 0
        out[idx] = flat[byte // size]
    return out


def _buf(shape, dtype=f32, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


# -- view ----------------------------------------------------------------------------------------
VIEWS = [  # (buffer shape, view shape, view byte strides for f32, byte offset)
    ((10, 8), (3, 5), (32, 4), (2 * 8 + 1) * 4),         # a window
    ((10, 8), (1, 8), (32, 4), 9 * 32),                  # the last row
    ((6, 4), (3, 2, 4), (32, 16, 4), 0),                 # rows split into pairs: a reshape by strides
    ((4, 6), (6, 2), (4, 4), 0),                         # overlapping rows one element apart
    ((2, 3, 4, 5), (2, 2, 3, 2), (240, 40, 20, 4), 20 + 8),
    ((12,), (3, 4), (12, 4), 0),                         # overlapping rows: [0:4], [3:7], [6:10]
    ((5, 7), (5, 1), (28, 4), 24),                       # a column
]


@pytest.mark.parametrize("buf_shape,shape,strides,offset", VIEWS)
@pytest.mark.parametrize("dtype", [F32, F16])
def test_view_byte_strides_and_offset(buf_shape, shape, strides, offset, dtype):
    scale = dtype.np_dtype.itemsize / 4                  # the table is in f32 bytes
    strides = tuple(int(s * scale) for s in strides[:-1]) + (dtype.np_dtype.itemsize,)
    offset = int(offset * scale)
    buf = _buf(buf_shape, dtype.np_dtype)
    g = GraphBuilder("t")
    v = g.view(g.input("buf", buf_shape, dtype), shape, strides, offset)
    g.output("v", v)
    g.output("c", g.cont(v))
    out = run_graph(g.graph, {"buf": buf})
    want = strided_ref(buf, shape, strides, offset)
    for name in ("v", "c"):
        assert out[name].dtype == buf.dtype and out[name].shape == shape
        np.testing.assert_array_equal(out[name], want)
    assert out["c"].flags.c_contiguous


@pytest.mark.parametrize("n_kv", [1, 3, 7])
def test_view_symbolic_kv_window(n_kv):
    """The KV-cache read: view [n_kv, H, d] of a [n_ctx, H, d] cache starting at cell 2."""
    n_ctx, n_head, d = 12, 2, 4
    cache = _buf((n_ctx, n_head, d), seed=n_kv)
    g = GraphBuilder("t", dims=["n_kv"])
    kv = g.dim("n_kv")
    v = g.view(g.state("cache", [n_ctx, n_head, d], F32), [kv, n_head, d], [n_head * d * 4, d * 4, 4],
               offset=2 * n_head * d * 4)
    g.output("y", g.scale(g.permute(v, 1, 0, 2), 2.0))      # [H, n_kv, d]
    got = run_graph(g.graph, {"cache": cache}, {"n_kv": n_kv})["y"]
    np.testing.assert_array_equal(got, 2 * np.transpose(cache[2:2 + n_kv], (1, 0, 2)))


def test_view_with_symbolic_strides_and_offset():
    buf = _buf((7, 6), seed=3)
    g = GraphBuilder("t", dims=["T"])
    T = g.dim("T")
    row = dims.mul(T, 4)                                  # a [2, T] buffer: row stride 4*T bytes
    flat = g.reshape(g.input("buf", [7, "T"], F32), dims.mul(T, 7))
    v = g.view(flat, [2, 3], [row, 4], offset=dims.mul(T, 8))   # rows 2..3, first 3 columns
    g.output("y", v)
    got = run_graph(g.graph, {"buf": buf}, {"T": 6})["y"]
    np.testing.assert_array_equal(got, buf[2:4, :3])


def test_view_of_permute_uses_absolute_strides_and_view_of_view_adds_offsets():
    buf = _buf((4, 5, 6), seed=4)
    g = GraphBuilder("t")
    x = g.input("buf", [4, 5, 6], F32)
    p = g.permute(x, 2, 0, 1)                             # same memory, [6, 4, 5]
    v = g.view(p, [2, 3], [120, 4], offset=24 + 8)        # byte offsets from the shared data pointer
    w = g.view(v, [2, 2], [120, 4], offset=4)             # a view of a view: offsets add up
    g.output("v", v)
    g.output("w", w)
    out = run_graph(g.graph, {"buf": buf})
    np.testing.assert_array_equal(out["v"], strided_ref(buf, (2, 3), (120, 4), 32))
    np.testing.assert_array_equal(out["w"], strided_ref(buf, (2, 2), (120, 4), 36))


def test_view_of_a_quantized_tensor_selects_whole_rows():
    raw = np.random.default_rng(5).integers(0, 255, (4, Q8_0.row_bytes(64)), dtype=np.uint8)
    g = GraphBuilder("t")
    x = g.weight("w", [4, 64], Q8_0)
    row = Q8_0.row_bytes(64)
    g.output("y", g.cont(g.view(x, [2, 64], [2 * row, Q8_0.type_size], offset=row)))   # rows 1 and 3
    got = run_graph(g.graph, {"w": raw})["y"]
    np.testing.assert_array_equal(got, raw[1::2])


def test_identity_view_of_quantized_tensor_with_its_contiguous_strides():
    raw = np.random.default_rng(5).integers(0, 255, (4, Q8_0.row_bytes(64)), dtype=np.uint8)
    g = GraphBuilder("t")
    x = g.weight("w", [4, 64], Q8_0)
    assert x.type.contiguous_strides() == (Q8_0.row_bytes(64), Q8_0.type_size)   # ggml's nb[1], nb[0]
    g.output("y", g.view(x, x.shape, x.type.contiguous_strides()))
    np.testing.assert_array_equal(run_graph(g.graph, {"w": raw})["y"], raw)


def test_view_outside_its_buffer_is_a_run_time_error():
    g = GraphBuilder("t", dims=["T"])
    x = g.input("x", ["T", 4], F32)
    g.output("y", g.view(x, [2, 4], [16, 4], offset=16))        # needs T >= 3
    ok = run_graph(g.graph, {"x": _buf((3, 4))}, {"T": 3})["y"]
    assert ok.shape == (2, 4)
    with pytest.raises(InterpError, match="outside"):
        run_graph(g.graph, {"x": _buf((2, 4))}, {"T": 2})
    g2 = GraphBuilder("t")
    g2.output("y", g2.view(g2.input("x", [3, 4], F32), [2, 4], [16, 4], offset=-4))
    with pytest.raises(InterpError, match="outside"):
        run_graph(g2.graph, {"x": _buf((3, 4))})


def test_view_of_a_larger_leaf_buffer_never_reads_past_the_leaf():
    big = _buf((8, 4), seed=6)
    g = GraphBuilder("t")
    g.output("y", g.view(g.input("x", [2, 4], F32), [3, 4], [16, 4]))    # 3 rows of a 2-row leaf
    with pytest.raises(InterpError, match="outside"):
        run_graph(g.graph, {"x": big[2:4]})   # the memory after the leaf exists but is not the leaf's


def test_a_non_contiguous_leaf_array_is_rejected():
    a = np.arange(12, dtype=f32).reshape(3, 4)
    g = GraphBuilder("t")
    x = g.input("x", [4, 3], F32)
    g.output("v", g.view(x, [4, 3], [12, 4]))             # the identity view of a contiguous [4, 3]
    with pytest.raises(InterpError, match="input 'x': the array is not C-contiguous"):
        run_graph(g.graph, {"x": a.T})                    # a leaf's bytes are its layout, as in ggml


# -- reshape, permute, transpose, cont -----------------------------------------------------------
@pytest.mark.parametrize("n_tokens", [1, 3, 7])
def test_reshape_symbolic(n_tokens):
    x = _buf((n_tokens, 12), seed=n_tokens)
    g = GraphBuilder("t", dims=["T"])
    T = g.dim("T")
    r = g.reshape(g.input("x", ["T", 12], F32), T, 3, 4)
    g.output("r", r)
    g.output("flat", g.reshape(r, dims.mul(T, 12)))
    out = run_graph(g.graph, {"x": x}, {"T": n_tokens})
    np.testing.assert_array_equal(out["r"], x.reshape(n_tokens, 3, 4))
    np.testing.assert_array_equal(out["flat"], x.reshape(-1))


def test_reshape_of_a_non_contiguous_value_is_an_error():
    g = GraphBuilder("t")
    g.output("y", g.reshape(g.transpose(g.input("x", [3, 4], F32)), 12))
    with pytest.raises(InterpError, match="not contiguous"):
        run_graph(g.graph, {"x": _buf((3, 4))})


@pytest.mark.parametrize("shape,axes", [((3, 4), (1, 0)), ((2, 3, 4), (2, 0, 1)), ((2, 3, 4), (0, 2, 1)),
                                        ((2, 3, 4, 5), (0, 2, 1, 3)), ((2, 3, 4, 5), (3, 1, 0, 2)),
                                        ((1, 1, 5), (2, 1, 0))])
def test_permute_and_cont(shape, axes):
    x = _buf(shape, seed=len(axes))
    g = GraphBuilder("t")
    p = g.permute(g.input("x", shape, F32), *axes)
    assert p.shape == tuple(shape[a] for a in axes)
    g.output("p", p)
    g.output("c", g.cont(p))
    new_shape = (int(np.prod(shape[:1])), int(np.prod(shape[1:])))
    g.output("c2", g.cont(p, *new_shape))                 # cont with a new shape: logical order kept
    out = run_graph(g.graph, {"x": x})
    want = np.transpose(x, axes)
    np.testing.assert_array_equal(out["p"], want)
    np.testing.assert_array_equal(out["c"], want)
    np.testing.assert_array_equal(out["c2"], want.reshape(new_shape))
    assert out["c"].flags.c_contiguous and out["c2"].flags.c_contiguous


@pytest.mark.parametrize("shape", [(3, 4), (1, 5), (2, 3, 4), (2, 1, 3, 4)])
def test_transpose_swaps_the_last_two_axes(shape):
    x = _buf(shape, seed=9)
    g = GraphBuilder("t")
    t = g.transpose(g.input("x", shape, F32))
    g.output("t", t)
    g.output("tt", g.transpose(t))
    out = run_graph(g.graph, {"x": x})
    np.testing.assert_array_equal(out["t"], np.swapaxes(x, -1, -2))
    np.testing.assert_array_equal(out["tt"], x)


# -- cpy: conversions ----------------------------------------------------------------------------
F16_BITS = [  # (f32 value, IEEE half bits, round to nearest even)
    (1.0, 0x3C00), (-2.0, 0xC000), (0.1, 0x2E66), (65504.0, 0x7BFF), (65519.0, 0x7BFF),
    (65520.0, 0x7C00),                      # halfway to 65536: ties to even overflow to inf
    (1 + 2**-11, 0x3C00),                   # halfway between 1 and 1+2^-10: even is 1
    (1 + 3 * 2**-11, 0x3C02),               # halfway between 0x3C01 and 0x3C02: even is 0x3C02
    (1 + 2**-11 + 2**-20, 0x3C01),          # just above halfway: up
    (2**-24, 0x0001), (2**-25, 0x0000),     # smallest subnormal; half of it ties to 0
    (3 * 2**-25, 0x0002),                   # 1.5 subnormal ulps: ties to even 2
    (-0.0, 0x8000), (float("inf"), 0x7C00), (float("-inf"), 0xFC00), (1e6, 0x7C00),
]
BF16_BITS = [
    (1.0, 0x3F80), (-2.0, 0xC000), (1 + 2**-8, 0x3F80), (1 + 3 * 2**-8, 0x3F82), (1 + 2**-8 + 2**-20, 0x3F81),
    (3.4028234663852886e38, 0x7F80),        # f32 max rounds up to inf
    (float("-inf"), 0xFF80), (-0.0, 0x8000),
    (2**-133, 0x0001), (2**-134, 0x0000), (3 * 2**-134, 0x0002),   # subnormals tie to even
]


def _cast(x: np.ndarray, src, dst) -> np.ndarray:
    g = GraphBuilder("t")
    g.output("y", g.cast(g.input("x", x.shape, src), dst))
    return run_graph(g.graph, {"x": x})["y"]


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # 65520 and 1e6 -> inf
def test_cpy_f32_to_f16_rounds_to_nearest_even():
    x = np.array([v for v, _ in F16_BITS], dtype=f32)
    got = _cast(x, F32, F16)
    assert got.dtype == f16
    assert [hex(b) for b in got.view(np.uint16).tolist()] == [hex(b) for _, b in F16_BITS]
    nan = _cast(np.array([np.nan], dtype=f32), F32, F16)
    assert np.isnan(nan[0])


def test_cpy_f32_to_bf16_rounds_to_nearest_even():
    x = np.array([v for v, _ in BF16_BITS], dtype=f32)
    got = _cast(x, F32, BF16)
    assert got.dtype == np.uint16                       # bf16 is stored as its bits
    assert [hex(b) for b in got.tolist()] == [hex(b) for _, b in BF16_BITS]
    nans = np.array([0x7F800001, 0xFFC00000], dtype=np.uint32).view(f32)
    bits = _cast(nans, F32, BF16)
    assert bits.tolist() == [0x7FC0, 0xFFC0]            # NaN stays NaN (quieted), never inf


@pytest.mark.parametrize("src,dst", [(F16, F32), (BF16, F32), (F16, BF16), (BF16, F16), (F32, F32)])
def test_cpy_widening_and_between_half_types(src, dst):
    vals = np.array([1.0, -0.5, 3.140625, 0.0, -256.0, 2.0**-14], dtype=f32)   # exact in f16 and bf16
    store = {F32: lambda v: v, F16: lambda v: v.astype(f16),
             BF16: lambda v: (v.view(np.uint32) >> 16).astype(np.uint16)}
    load = {F32: lambda s: s, F16: lambda s: s.astype(f32),
            BF16: lambda s: (s.astype(np.uint32) << 16).view(f32)}
    exact = load[src](store[src](vals))
    got = _cast(store[src](exact), src, dst)
    want = store[dst](exact)
    np.testing.assert_array_equal(got, want)


def test_cpy_of_a_permuted_input_is_exact():
    x = _buf((3, 4, 5), seed=10)
    g = GraphBuilder("t")
    g.output("y", g.cast(g.permute(g.input("x", [3, 4, 5], F32), 2, 0, 1), F16))
    got = run_graph(g.graph, {"x": x})["y"]
    np.testing.assert_array_equal(got, np.transpose(x, (2, 0, 1)).astype(f16))


FRESH_RESULTS = [  # ops whose result is a fresh tensor in ggml, so reshape may follow them
    pytest.param(lambda g, p: g.cast(p, F16), id="cpy_f16"),
    pytest.param(lambda g, p: g.cast(p, I32), id="cpy_i32"),
    pytest.param(lambda g, p: g.cast(p, BF16), id="cpy_bf16"),
    pytest.param(lambda g, p: g.cast(p, F32), id="cpy_f32"),
    pytest.param(lambda g, p: g.cont(p), id="cont"),
    pytest.param(lambda g, p: g.soft_max_ext(p, None, 0.5), id="soft_max_ext"),
    pytest.param(lambda g, p: g.concat(p, p, 0), id="concat"),
    pytest.param(lambda g, p: g.scale(p, 2.0), id="scale"),
    pytest.param(lambda g, p: g.rms_norm(p, 1e-6), id="rms_norm"),
    pytest.param(lambda g, p: g.add(p, p), id="add"),
    pytest.param(lambda g, p: g.repeat(p, 2, 3, 4, 6), id="repeat"),
    pytest.param(lambda g, p: g.glu("swiglu", p), id="glu"),
]


@pytest.mark.parametrize("make", FRESH_RESULTS)
def test_results_of_computing_ops_can_be_reshaped(make):
    x = _buf((4, 3, 6), seed=17)
    g = GraphBuilder("t")
    y = make(g, g.permute(g.input("x", [4, 3, 6], F32), 1, 0, 2))
    g.output("y", y)
    g.output("flat", g.reshape(y, dims.prod(y.shape)))
    g.output("v", g.view(y, y.shape, y.type.contiguous_strides()))   # byte strides over its memory
    out = run_graph(g.graph, {"x": x})
    np.testing.assert_array_equal(out["flat"], out["y"].reshape(-1))
    np.testing.assert_array_equal(out["v"], out["y"])


def test_cpy_f32_to_i32_truncates_toward_zero():
    x = np.array([1.9, -1.9, 0.5, -0.5, 7.0, 123456.0], dtype=f32)
    np.testing.assert_array_equal(_cast(x, F32, I32), [1, -1, 0, 0, 7, 123456])


def test_cpy_i32_to_f32():
    x = np.array([1, -7, 1 << 20], dtype=np.int32)
    np.testing.assert_array_equal(_cast(x, I32, F32), x.astype(f32))


def test_cpy_to_q8_0_with_exactly_representable_blocks():
    rng = np.random.default_rng(11)
    scales = np.array([0.5, 0.25], dtype=f32)            # f16-exact block scales
    q = rng.integers(-127, 128, (2, 32)).astype(np.int8)
    q[:, 0] = [127, -127]                                 # amax = 127 * d in every block
    x = (q.astype(f32) * scales[:, None]).reshape(1, 64)
    got = _cast(x, F32, Q8_0)
    assert got.dtype == np.uint8 and got.shape == (1, 68)
    blocks = got.reshape(2, 34)
    np.testing.assert_array_equal(blocks[:, :2].copy().view(f16).reshape(-1), scales.astype(f16))
    np.testing.assert_array_equal(blocks[:, 2:].view(np.int8), q)


def test_cpy_q8_0_to_f32_dequantizes():
    rng = np.random.default_rng(12)
    d = rng.uniform(0.01, 2, (3, 2)).astype(f16)
    q = rng.integers(-128, 128, (3, 2, 32)).astype(np.int8)
    raw = np.concatenate([d[..., None].view(np.uint8), q.view(np.uint8)], axis=-1).reshape(3, 68)
    g = GraphBuilder("t")
    g.output("y", g.cast(g.weight("w", [3, 64], Q8_0), F32))
    got = run_graph(g.graph, {"w": raw})["y"]
    np.testing.assert_array_equal(got, (d.astype(f32)[..., None] * q.astype(f32)).reshape(3, 64))


# -- concat, repeat ------------------------------------------------------------------------------
@pytest.mark.parametrize("a_shape,b_shape,axis", [
    ((2, 3), (4, 3), 0), ((2, 3), (2, 5), 1), ((2, 3), (2, 1), -1), ((1, 2, 3), (1, 2, 4), 2),
    ((2, 1, 3, 4), (2, 2, 3, 4), 1), ((1, 1), (1, 1), 0)])
def test_concat(a_shape, b_shape, axis):
    a, b = _buf(a_shape, seed=12), _buf(b_shape, seed=13)
    g = GraphBuilder("t")
    g.output("y", g.concat(g.input("a", a_shape, F32), g.input("b", b_shape, F32), axis))
    got = run_graph(g.graph, {"a": a, "b": b})["y"]
    np.testing.assert_array_equal(got, np.concatenate([a, b], axis=axis))


@pytest.mark.parametrize("n_tokens", [1, 3, 7])
def test_concat_symbolic_and_strided(n_tokens):
    a, b = _buf((4, n_tokens), seed=14), _buf((n_tokens, 2, 3), seed=15)
    g = GraphBuilder("t", dims=["T"])
    at = g.transpose(g.input("a", [4, "T"], F32))                      # [T, 4]
    bv = g.reshape(g.input("b", ["T", 2, 3], F32), g.dim("T"), 6)      # [T, 6]
    y = g.concat(at, bv, 1)                                            # [T, 10]
    g.output("y", y)
    g.output("yy", g.concat(y, y, 0))                                  # [2*T, 10]
    assert str(g.graph.outputs["yy"].type) == "f32[2*T,10]"
    out = run_graph(g.graph, {"a": a, "b": b}, {"T": n_tokens})
    want = np.concatenate([a.T, b.reshape(n_tokens, 6)], axis=1)
    np.testing.assert_array_equal(out["y"], want)
    np.testing.assert_array_equal(out["yy"], np.concatenate([want, want], axis=0))


@pytest.mark.parametrize("x_shape,shape", [((1, 3), (4, 6)), ((2, 3), (2, 4, 6)), ((3,), (2, 3)),
                                           ((3, 1, 2), (2, 3, 2, 4)), ((5, 1), (5, 1))])
def test_repeat_tiles(x_shape, shape):
    x = _buf(x_shape, seed=16)
    g = GraphBuilder("t")
    g.output("y", g.repeat(g.input("x", x_shape, F32), *shape))
    got = run_graph(g.graph, {"x": x})["y"]
    xx = x.reshape((1,) * (len(shape) - x.ndim) + x.shape)
    want = np.empty(shape, dtype=f32)
    for idx in np.ndindex(*shape):
        want[idx] = xx[tuple(i % n for i, n in zip(idx, xx.shape, strict=True))]
    np.testing.assert_array_equal(got, want)


# -- type errors ---------------------------------------------------------------------------------
def test_layout_type_errors():
    g = GraphBuilder("t", dims=["T"])
    x = g.input("x", [2, 3, 4], F32)
    with pytest.raises(IRError, match=r"permute.*axes \(0, 0, 1\) do not permute rank 3"):
        g.permute(x, 0, 0, 1)
    with pytest.raises(IRError, match=r"permute.*do not permute rank 3"):
        g.permute(x, 1, 0)
    with pytest.raises(IRError, match=r"reshape.*cannot reshape f32\[2,3,4\] to f32\[5,5\]"):
        g.reshape(x, 5, 5)
    with pytest.raises(IRError, match=r"reshape.*cannot reshape"):
        g.reshape(g.input("t", ["T", 4], F32), 4, 4)
    with pytest.raises(IRError, match=r"cont.*cannot cont"):
        g.cont(x, 7, 3)
    with pytest.raises(IRError, match=r"transpose.*rank >= 2"):
        g.transpose(g.input("v", [4], F32))
    with pytest.raises(IRError, match=r"view.*2 dims but 1 strides"):
        g.view(x, [2, 2], [4])
    with pytest.raises(IRError, match=r"view.*last stride must be the element \(or block\) size 4, got 8"):
        g.view(x, [2, 2], [16, 8])
    with pytest.raises(IRError, match=r"concat.*differ off axis 0"):
        g.concat(x, g.input("y", [2, 4, 4], F32), 0)
    with pytest.raises(IRError, match=r"concat.*cannot concat"):
        g.concat(x, g.input("h", [2, 3, 4], F16), 0)
    joined = g.concat(g.input("a", ["T", 4], F32), g.input("b", [1, 4], F32), 0)   # a symbolic + fixed length
    assert str(joined.type) == "f32[T+1,4]"
    with pytest.raises(IRError, match=r"repeat.*does not tile"):
        g.repeat(x, 2, 4, 4)
    with pytest.raises(IRError, match=r"cpy.*cpy needs a target dtype"):
        g.op(ops.Cpy(), x)
    with pytest.raises(IRError, match=r"cpy.*cannot convert i32 to q8_0"):
        g.cast(g.input("ints", [2, 64], I32), Q8_0)
    with pytest.raises(IRError, match=r"cpy.*cannot convert q8_0 to i32"):
        g.cast(g.weight("qw", [2, 64], Q8_0), I32)
    with pytest.raises(IRError, match=r"cpy.*not whole q8_0 blocks"):
        g.cast(g.input("odd", [2, 48], F32), Q8_0)
