"""llamir.ir.quants against independent oracles: gguf's numpy port, hand-built blocks with
closed-form values, scalar line-by-line transcriptions of ggml's C, and libggml itself
(through ctypes, when llama-cpp-python is installed)."""

from __future__ import annotations

import ctypes
import importlib.util
import math
import pathlib

import numpy as np
import pytest
from gguf import quants as gguf_quants

from llamir.ir import quants
from llamir.ir.dtypes import (
    BF16,
    F16,
    F32,
    I32,
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    Q8_1,
    Q8_K,
    DType,
)

f32 = np.float32
# Byte offsets of the ggml_half fields of each block (ggml-common.h); random bytes there could be NaN.
FP16_FIELDS: dict[DType, tuple[int, ...]] = {
    Q4_0: (0,), Q4_1: (0, 2), Q5_0: (0,), Q5_1: (0, 2), Q8_0: (0,), Q2_K: (80, 82),
    Q3_K: (108,), Q4_K: (0, 2), Q5_K: (0, 2), Q6_K: (208,),
}
LEGACY = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=f32).view(np.uint32)


def random_blocks(rng: np.random.Generator, dtype: DType, rows: int, n_blocks: int) -> np.ndarray:
    """Random bytes [rows, n_blocks*type_size] whose fp16 scale fields are finite."""
    raw = rng.integers(0, 256, (rows, n_blocks * dtype.type_size), dtype=np.uint8)
    blocks = raw.reshape(-1, dtype.type_size)
    for off in FP16_FIELDS[dtype]:
        scale = (rng.normal(0, 1, (blocks.shape[0], 1)) * 2.0 ** rng.integers(-12, 6, (blocks.shape[0], 1)))
        blocks[:, off:off + 2] = scale.astype(np.float16).view(np.uint8)
    return raw


def test_data(rng: np.random.Generator, rows: int, n: int) -> np.ndarray:
    """Rows of varied scale plus corners: all zero, constant, and tiny (fp16 d underflows to 0).

    Not smaller: a denormal float32 d makes 1/d infinite and ggml's float->int8 cast undefined."""
    x = rng.normal(0, 1, (rows, n)) * 10.0 ** rng.uniform(-3, 3, (rows, 1))
    x[0] = 0
    x[1] = -3.25
    x[2] *= 1e-30
    return x.astype(f32)


test_data.__test__ = False  # type: ignore[attr-defined]


# ------------------------------------------------------------------- dequantize vs gguf


@pytest.mark.parametrize("dtype", list(FP16_FIELDS), ids=str)
def test_dequantize_random_bytes_matches_gguf(rng, dtype):
    raw = random_blocks(rng, dtype, rows=5, n_blocks=3)
    expected = gguf_quants.dequantize(raw, dtype.ggml_type)
    got = quants.dequantize(raw, dtype)
    assert got.shape == expected.shape == (5, 3 * dtype.block_size)
    np.testing.assert_array_equal(bits(got), bits(expected))


@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
def test_dequantize_float_bytes_matches_gguf(rng, dtype):
    raw = rng.integers(0, 256, (4, 64), dtype=np.uint8)
    np.testing.assert_array_equal(bits(quants.dequantize(raw, dtype)),
                                  bits(gguf_quants.dequantize(raw, dtype.ggml_type)))


def test_dequantize_accepts_element_arrays():
    x = np.array([[1.5, -2.0, 3.0, 65504.0]], dtype=np.float16)
    np.testing.assert_array_equal(quants.dequantize(x, F16), x.astype(f32))
    bf = np.array([[0x3F80, 0xC000]], dtype=np.uint16)  # bf16 bits of 1.0 and -2.0
    np.testing.assert_array_equal(quants.dequantize(bf, BF16), [[1.0, -2.0]])
    with pytest.raises(TypeError, match="q8_0"):
        quants.dequantize(np.zeros((1, 32), np.float32), Q8_0)
    with pytest.raises(ValueError, match="q4_0"):
        quants.dequantize(np.zeros((1, 19), np.uint8), Q4_0)


# --------------------------------------------------------------------- quantize vs gguf


@pytest.mark.parametrize("dtype", [*LEGACY, BF16], ids=str)
def test_quantize_matches_gguf_bit_for_bit(rng, dtype):
    x = test_data(rng, rows=12, n=256)
    expected = gguf_quants.quantize(x, dtype.ggml_type).view(np.uint8).reshape(12, -1)
    got = quants.quantize(x, dtype)
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(bits(quants.dequantize(got, dtype)),
                                  bits(gguf_quants.dequantize(expected, dtype.ggml_type)))


def test_f16_matches_numpy_rounding_for_finite_values(rng):
    x = test_data(rng, rows=4, n=64)
    x[3, :4] = [65519.0, 65520.0, 1e-8, -6e-8]  # just below / at overflow, fp16 subnormals
    with np.errstate(over="ignore"):
        expected = x.astype(np.float16).view(np.uint8)
    np.testing.assert_array_equal(quants.quantize(x, F16), expected)


def test_f16_round_half_even_and_canonical_nan():
    # 1 + 2^-11 is a tie between 1 and 1 + 2^-10 (even wins), 1 + 3*2^-11 rounds up to the even 1 + 2^-9.
    # numpy (and so gguf) keeps NaN payload bits; ggml always writes sign | 0x7E00.
    nan_payload = np.array([0x7F800001, 0xFFC00123], dtype=np.uint32).view(f32)
    x = np.array([1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, *nan_payload, np.inf], dtype=f32)
    got = quants.quantize(x.reshape(1, -1), F16).view(np.uint16).ravel()
    assert [hex(v) for v in got] == ["0x3c00", "0x3c02", "0x7e00", "0xfe00", "0x7c00"]


def test_bf16_round_half_even_and_quiet_nan():
    x = np.array([0x3F808000, 0x3F818000, 0x3F818001, 0x7F800001, 0xFF800000],
                 dtype=np.uint32).view(f32)
    got = quants.quantize(x.reshape(1, -1), BF16).view(np.uint16).ravel()
    assert [hex(v) for v in got] == ["0x3f80", "0x3f82", "0x3f82", "0x7fc0", "0xff80"]


def test_quantize_unsupported_names_dtype():
    with pytest.raises(ValueError, match="i32 is not a float or block type"):
        quants.quantize(np.zeros((1, 256), f32), I32)
    with pytest.raises(ValueError, match="i32 is not a float or block type"):
        quants.dequantize(np.zeros((1, 4), np.int32), I32)
    with pytest.raises(ValueError, match="i32"):
        quants.vec_dot_type(I32)


# ------------------------------------------------- scalar transcriptions of ggml's C code


def c_q8_ref(block: np.ndarray) -> tuple[float, list[int]]:
    """quantize_row_q8_0_ref for one block, one statement at a time: (d, q)."""
    amax = f32(0)
    for v in block:
        amax = max(amax, abs(v))
    d = f32(amax / f32(127))
    inv = f32(1) / d if d else f32(0)
    return d, [int(math.copysign(math.floor(abs(float(v * inv)) + 0.5), v)) for v in block]


def c_q8_avx(block: np.ndarray) -> tuple[float, list[int]]:
    """ggml-cpu x86 quantize_row_q8_0: id = 127/amax and _mm256_round_ps (half to even): (d, q)."""
    amax = f32(max(abs(v) for v in block))
    inv = f32(127) / amax if amax != 0 else f32(0)
    return f32(amax / f32(127)), [round(float(f32(v * inv))) for v in block]


def c_q8_k(block: np.ndarray) -> tuple[float, list[int]]:
    """quantize_row_q8_K_ref for one 256-block: (d, q)."""
    amax, mx = f32(0), f32(0)
    for v in block:
        if abs(v) > amax:
            amax, mx = abs(v), v
    if not amax:
        return 0.0, [0] * len(block)
    iscale = f32(-127) / mx
    return f32(1) / iscale, [min(127, round(float(f32(iscale * v)))) for v in block]


def oracle_roundtrip(b: np.ndarray, dtype: DType) -> tuple[np.ndarray, np.ndarray | None]:
    """b as vec_dot sees it (float64) and, for Q8_1, the fp16 s = d*sum(q) of each block."""
    vdt = {F32: F32, F16: F16, BF16: BF16, Q4_0: Q8_0, Q5_0: Q8_0, Q8_0: Q8_0, Q4_1: Q8_1,
           Q5_1: Q8_1}.get(dtype, Q8_K)
    if vdt == F32:
        return b.astype(np.float64), None
    if vdt == F16:
        return b.astype(np.float16).astype(np.float64), None
    if vdt == BF16:
        packed = gguf_quants.quantize(b, BF16.ggml_type)
        return gguf_quants.dequantize(packed, BF16.ggml_type).astype(np.float64), None
    size = vdt.block_size
    values, sums = np.zeros(b.shape), np.zeros((b.shape[0], b.shape[1] // size))
    for r, row in enumerate(b):
        for i in range(b.shape[1] // size):
            d, q = (c_q8_k if vdt == Q8_K else c_q8_avx)(row[i * size:(i + 1) * size])
            scale = f32(d) if vdt == Q8_K else f32(np.float16(d))  # dequantize: float32 d * q
            values[r, i * size:(i + 1) * size] = scale * np.array(q, dtype=f32)
            sums[r, i] = float(np.float16(f32(d) * f32(sum(q))))
    return values, (sums if vdt == Q8_1 else None)


def test_q8_0_ref_matches_scalar_c(rng):
    x = test_data(rng, rows=4, n=128)
    raw = quants.quantize(x, Q8_0).reshape(-1, 34)
    for blk, block in zip(raw, x.reshape(-1, 32), strict=True):
        d, q = c_q8_ref(block)
        assert blk[:2].view(np.float16)[0] == np.float16(d)
        assert blk[2:].view(np.int8).tolist() == q


@pytest.mark.parametrize("dtype", [Q4_0, Q4_1, Q4_K, Q6_K], ids=str)
def test_activation_roundtrip_matches_scalar_c(rng, dtype):
    b = test_data(rng, rows=3, n=512)
    expected, _ = oracle_roundtrip(b, dtype)
    np.testing.assert_array_equal(quants.activation_roundtrip(b, dtype), expected)


def test_round_half_differs_between_ref_and_cpu():
    # amax = 127 makes d = 1 and both inverse scales exactly 1, so x*id keeps its .5 ties:
    # quantize_row_q8_0_ref rounds them away from zero, the AVX path to even.
    x = np.zeros((1, 32), f32)
    x[0, :5] = [127.0, 2.5, -2.5, 0.5, 1.5]
    ref = quants.quantize(x, Q8_0)[0, 2:7].view(np.int8)
    cpu = quants.cpu_from_float(x, Q8_0)[0, 2:7].view(np.int8)
    assert ref.tolist() == [127, 3, -3, 1, 2]
    assert cpu.tolist() == [127, 2, -2, 0, 2]


def test_q8_1_block_closed_form():
    x = np.zeros((1, 32), f32)
    x[0, :4] = [127.0, -64.0, 3.0, 0.5]  # d = 1, q = 127, -64, 3, 0 (half to even)
    raw = quants.cpu_from_float(x, Q8_1)
    assert raw.shape == (1, 36)
    d, s = raw[0, :4].view(np.float16)
    assert (d, s) == (1.0, 66.0)
    assert raw[0, 4:8].view(np.int8).tolist() == [127, -64, 3, 0]
    np.testing.assert_array_equal(quants.dequantize(raw, Q8_1)[0, :4], [127, -64, 3, 0])


def test_q8_k_block_closed_form():
    x = np.zeros((1, 256), f32)
    # The signed max is negative: iscale = -127/-2.54 = 50.0 exactly in float32, so x*iscale is
    # -127, 63.5, 0.5 and nearest_int (half to even) gives -127, 64, 0; d = 1/50 in float32.
    x[0, :3] = [-2.54, 1.27, 0.01]
    raw = quants.quantize(x, Q8_K)
    assert raw.shape == (1, 292)
    d = raw[0, :4].view(np.float32)[0]
    q = raw[0, 4:260].view(np.int8)
    bsums = raw[0, 260:].view(np.int16)
    assert d == f32(1) / f32(50)
    assert q[:3].tolist() == [-127, 64, 0]
    assert bsums.tolist() == [int(q[:16].astype(int).sum())] + [0] * 15
    np.testing.assert_array_equal(quants.dequantize(raw, Q8_K), d * q.astype(f32)[None])


# -------------------------------------------------------------- closed-form block layouts


def test_q4_0_block_closed_form():
    qs = np.array([j | ((15 - j) << 4) for j in range(16)], dtype=np.uint8)
    raw = np.concatenate([np.array([0.5], np.float16).view(np.uint8), qs])[None]
    expected = [(j - 8) * 0.5 for j in range(16)] + [(15 - j - 8) * 0.5 for j in range(16)]
    np.testing.assert_array_equal(quants.dequantize(raw, Q4_0)[0], expected)


def test_q5_1_block_closed_form():
    q = np.arange(32) ^ 0b10101  # every 5-bit value once, mixed high bits
    qs = ((q[:16] & 15) | ((q[16:] & 15) << 4)).astype(np.uint8)
    qh = np.uint32(sum(int(v >> 4) << j for j, v in enumerate(q))).reshape(1).view(np.uint8)
    head = np.array([0.25, -1.0], np.float16).view(np.uint8)
    raw = np.concatenate([head, qh, qs])[None]
    np.testing.assert_array_equal(quants.dequantize(raw, Q5_1)[0], q * 0.25 - 1.0)


def pack_k4(sc: list[int], mins: list[int]) -> np.ndarray:
    """The 12 scale bytes of a Q4_K/Q5_K block, written as ggml's quantize_row_q4_K_ref does."""
    s = np.zeros(12, np.uint8)
    for j in range(4):
        s[j] = sc[j] | ((sc[j + 4] >> 4) << 6)
        s[j + 4] = mins[j] | ((mins[j + 4] >> 4) << 6)
        s[j + 8] = (sc[j + 4] & 15) | ((mins[j + 4] & 15) << 4)
    return s


def test_q4_k_block_closed_form(rng):
    sc, mins = [1, 63, 17, 40, 5, 33, 62, 48], [0, 7, 63, 21, 50, 16, 1, 32]
    q = rng.integers(0, 16, 256)  # q[32*sb + l] for sub-block sb
    qs = np.concatenate([q[64 * c:64 * c + 32] | (q[64 * c + 32:64 * c + 64] << 4) for c in range(4)])
    head = np.array([2.0, 0.5], np.float16).view(np.uint8)
    raw = np.concatenate([head, pack_k4(sc, mins), qs.astype(np.uint8)])[None]
    sub = np.arange(256) // 32
    expected = 2.0 * np.take(sc, sub) * q - 0.5 * np.take(mins, sub)
    np.testing.assert_array_equal(quants.dequantize(raw, Q4_K)[0], expected)
    got_sc, got_m = quants.k4_scales_mins(raw[:, 4:16])
    assert got_sc[0].tolist() == sc and got_m[0].tolist() == mins


def test_q6_k_block_closed_form_with_d_last(rng):
    q = rng.integers(0, 64, 256)
    scales = rng.integers(-128, 128, 16).astype(np.int8)
    ql, qh = np.zeros(128, np.uint8), np.zeros(64, np.uint8)
    for half in range(2):
        for l in range(32):
            y = [q[128 * half + l + 32 * k] for k in range(4)]  # y[l], y[l+32], y[l+64], y[l+96]
            ql[64 * half + l] = (y[0] & 15) | ((y[2] & 15) << 4)
            ql[64 * half + l + 32] = (y[1] & 15) | ((y[3] & 15) << 4)
            qh[32 * half + l] = sum((y[k] >> 4) << (2 * k) for k in range(4))
    raw = np.concatenate([ql, qh, scales.view(np.uint8), np.array([0.25], np.float16).view(np.uint8)])[None]
    assert raw.shape == (1, 210)
    expected = 0.25 * scales[np.arange(256) // 16].astype(int) * (q - 32)
    np.testing.assert_array_equal(quants.dequantize(raw, Q6_K)[0], expected)


def test_q6_k_quantize_exact_fit_closed_form(rng):
    # Integers in [-32, 31] with -32 in every 16-group: make_qx_quants finds scale exactly 1 per group,
    # the super-block gets iscale = -128, sc = -128, d = fp16(-1/128), and d*sc*q reproduces x exactly.
    x = rng.integers(-32, 32, (2, 512)).astype(f32)
    x.reshape(-1, 16)[:, 5] = -32
    raw = quants.quantize(x * f32(2.0 ** -5), Q6_K)
    assert np.all(raw.reshape(-1, 210)[:, 192:208].view(np.int8) == -128)
    np.testing.assert_array_equal(quants.dequantize(raw, Q6_K), x * f32(2.0 ** -5))


def test_q4_k_quantize_exact_fit_closed_form(rng):
    # x = s*l - m0 with l in 0..15 (both ends in every 32-group) fits with zero error, so
    # make_qkx2_quants returns (s, m0) unchanged; s = 63/64 and m0 = 63/16 make d = 2^-6 and
    # dmin = 2^-4 exact in fp16, with 6-bit scale and min 63 everywhere.
    levels = rng.integers(0, 16, (2, 512))
    levels.reshape(-1, 32)[:, :2] = [0, 15]
    x = (levels * (63 / 64) - 63 / 16).astype(f32)
    raw = quants.quantize(x, Q4_K).reshape(-1, 144)
    assert np.all(raw[:, :4].view(np.float16) == [2.0 ** -6, 2.0 ** -4])
    assert np.all(np.concatenate(quants.k4_scales_mins(raw[:, 4:16]), axis=1) == 63)
    np.testing.assert_array_equal(quants.dequantize(raw.reshape(2, -1), Q4_K), x)


def test_shapes_and_block_bytes():
    assert quants.block_bytes(Q8_1) == 36  # gguf's table still says 40 (float d, s)
    assert quants.quant_shape((3, 144 * 2), Q4_K) == (3, 512)
    assert quants.byte_shape((3, 512), Q8_1) == (3, 16 * 36)
    with pytest.raises(ValueError, match="q4_k"):
        quants.byte_shape((3, 100), Q4_K)


# ------------------------------------------------------------------------------- mul_mat


def test_vec_dot_type_table():
    table = {F32: F32, F16: F16, BF16: BF16, Q4_0: Q8_0, Q5_0: Q8_0, Q8_0: Q8_0, Q4_1: Q8_1,
             Q5_1: Q8_1, Q2_K: Q8_K, Q3_K: Q8_K, Q4_K: Q8_K, Q5_K: Q8_K, Q6_K: Q8_K}
    assert {t: quants.vec_dot_type(t) for t in table} == table


def weight(rng: np.random.Generator, dtype: DType, m: int, k: int) -> np.ndarray:
    """A weight [m, k] in storage form: random valid blocks, or gguf-converted floats."""
    if dtype in FP16_FIELDS:
        return random_blocks(rng, dtype, m, k // dtype.block_size)
    w = rng.normal(0, 1, (m, k)).astype(f32)
    return w if dtype == F32 else gguf_quants.quantize(w, dtype.ggml_type)


@pytest.mark.parametrize("dtype", [F32, F16, BF16, *LEGACY, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K], ids=str)
def test_mul_mat_matches_blockwise_definition(rng, dtype):
    m, k, n = 7, 512, 5
    a = weight(rng, dtype, m, k)
    b = test_data(rng, rows=n, n=k)
    b_seen, s_b = oracle_roundtrip(b, dtype)
    if s_b is None:
        a_deq = gguf_quants.dequantize(a, dtype.ggml_type).astype(np.float64)
        terms = [np.abs(b_seen) @ np.abs(a_deq).T]
        expected = b_seen @ a_deq.T
    else:  # sum over blocks of d_a*d_b*sum(q_a*q_b) + m_a*s_b, with s_b fp16 as Q8_1 stores it
        no_min = a.reshape(-1, a.shape[-1] // (k // 32)).copy()
        mins = no_min[:, 2:4].copy().view(np.float16).astype(np.float64).reshape(m, -1)
        no_min[:, 2:4] = 0  # d*q + 0 recovers the scaled part exactly
        a_dq = gguf_quants.dequantize(no_min.reshape(a.shape), dtype.ggml_type).astype(np.float64)
        terms = [np.abs(b_seen) @ np.abs(a_dq).T, np.abs(s_b) @ np.abs(mins).T]
        expected = b_seen @ a_dq.T + s_b @ mins.T
    got = quants.mul_mat_ggml(a, dtype, b)
    assert got.shape == (n, m) and got.dtype == f32
    assert np.all(np.abs(got - expected) <= 1e-5 * sum(terms) + 1e-30)


def test_q4_1_min_term_uses_fp16_sum(rng):
    # A large common offset makes m_a * (fp16(d_b*sum q_b) - d_b*sum q_b) visible: the plain
    # dequantize(a) @ roundtrip(b) misses it, mul_mat_ggml does not.
    w = (rng.normal(0, 1, (4, 256)) + 40).astype(f32)
    a = gguf_quants.quantize(w, Q4_1.ggml_type)
    b = rng.normal(0, 1, (3, 256)).astype(f32)
    got = quants.mul_mat_ggml(a, Q4_1, b)
    plain = quants.activation_roundtrip(b, Q4_1) @ quants.dequantize(a, Q4_1).T
    scaled, mins = quants.split_scale_min(a, Q4_1)
    assert mins.shape == (4, 8) and scaled.shape == (4, 256)
    _, s_b = oracle_roundtrip(b, Q4_1)
    b_seen, _ = oracle_roundtrip(b, Q4_1)
    expected = b_seen @ scaled.astype(np.float64).T + s_b @ mins.astype(np.float64).T
    assert np.abs(got - expected).max() < 1e-3 < np.abs(plain - expected).max()


@pytest.mark.parametrize("dtype", [Q8_0, Q4_0, Q4_K, F16], ids=str)
def test_mul_mat_within_derived_bound_of_f32(rng, dtype):
    """|b - roundtrip(b)| per element, derived from the conversion, bounds the matmul error.

    Q8_0 (x86): q = rint(x * fl(127/amax)), d16 = fp16(amax/127):
        |x - q*d16| <= d*(1/2 + 2^-22*127) + 127*d*2^-11 < 0.563 d,  d = amax/127.
    Q8_K: q = rint(x * iscale), d = 1/iscale in float32: |x - q*d| < 0.501 d.
    F16: relative error <= 2^-11 (normal range)."""
    m, k, n = 16, 512, 6
    a = weight(rng, dtype, m, k)
    b = rng.normal(0, 1, (n, k)).astype(f32) * rng.uniform(0.1, 10, (n, 1)).astype(f32)
    seen = quants.activation_roundtrip(b, dtype)
    vdt = quants.vec_dot_type(dtype)
    if vdt == F16:
        bound = np.abs(b) * 2.0 ** -11
    else:
        amax = np.abs(b.reshape(n, -1, vdt.block_size)).max(axis=-1, keepdims=True) / 127
        bound = np.broadcast_to(amax * (0.563 if vdt == Q8_0 else 0.501), (n, k // vdt.block_size,
                                vdt.block_size)).reshape(n, k)
    assert np.all(np.abs(seen - b) <= bound)
    a_deq = gguf_quants.dequantize(a, dtype.ggml_type).astype(np.float64)
    exact = b.astype(np.float64) @ a_deq.T
    slack = 1e-5 * (np.abs(b) @ np.abs(a_deq).T)
    assert np.all(np.abs(quants.mul_mat_ggml(a, dtype, b) - exact) <= bound @ np.abs(a_deq).T + slack)


@pytest.mark.parametrize("dtype", [Q8_0, Q5_1, BF16], ids=str)
def test_prepared_weight_gives_identical_result(rng, dtype):
    a = weight(rng, dtype, 9, 256)
    b = rng.normal(0, 1, (4, 256)).astype(f32)
    pieces = quants.prepare_weight(a, dtype)
    np.testing.assert_array_equal(quants.mul_mat_prepared(*pieces, dtype, b),
                                  quants.mul_mat_ggml(a, dtype, b))
    if dtype == BF16:  # raw uint16 bits and bytes are the same weight
        np.testing.assert_array_equal(quants.mul_mat_ggml(a.view(np.uint16), BF16, b),
                                      quants.mul_mat_ggml(a, BF16, b))


# ------------------------------------------- libggml itself, when llama-cpp-python is installed


class LibGgml:
    """ctypes access to the (de)quantizers and vec_dot of the libggml that llama-cpp-python ships."""

    Row = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
    Dot = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                           ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)

    class Traits(ctypes.Structure):  # struct ggml_type_traits (ggml.h)
        _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                    ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                    ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                    ("from_float_ref", ctypes.c_void_p)]

    class CpuTraits(ctypes.Structure):  # struct ggml_type_traits_cpu (ggml-cpu.h)
        _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p),
                    ("vec_dot_type", ctypes.c_int), ("nrows", ctypes.c_int64)]

    def __init__(self, lib_dir: pathlib.Path) -> None:
        self.base = ctypes.CDLL(str(lib_dir / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        self.cpu = ctypes.CDLL(str(lib_dir / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
        self.base.ggml_get_type_traits.restype = ctypes.POINTER(self.Traits)
        self.cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(self.CpuTraits)
        self.cpu.ggml_cpu_init()

    def traits(self, dtype: DType):
        return self.base.ggml_get_type_traits(int(dtype.ggml_type)).contents

    def cpu_traits(self, dtype: DType):
        return self.cpu.ggml_get_type_traits_cpu(int(dtype.ggml_type)).contents

    @staticmethod
    def _row(fn: int, src: np.ndarray, out: np.ndarray, n: int) -> np.ndarray:
        LibGgml.Row(fn)(src.ctypes.data, out.ctypes.data, n)
        return out

    def to_float(self, raw: np.ndarray, dtype: DType) -> np.ndarray:
        raw = np.ascontiguousarray(raw)
        out = np.empty(quants.quant_shape(raw.shape, dtype), f32)
        fn = self.traits(dtype).to_float  # NULL for Q8_K, whose function is exported instead
        return self._row(fn or ctypes.cast(self.base.dequantize_row_q8_K, ctypes.c_void_p).value,
                         raw, out, out.size)

    def from_float(self, x: np.ndarray, dtype: DType, cpu: bool) -> np.ndarray:
        x = np.ascontiguousarray(x, f32)
        out = np.zeros(quants.byte_shape(x.shape, dtype), np.uint8)
        if not cpu and dtype == Q8_K:  # no from_float_ref entry; the function is exported
            self.base.quantize_row_q8_K_ref(x.ctypes.data_as(ctypes.c_void_p),
                                            out.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(x.size))
            return out
        fn = self.cpu_traits(dtype).from_float if cpu else self.traits(dtype).from_float_ref
        return self._row(fn, x, out, x.size)

    def mul_mat(self, a: np.ndarray, dtype: DType, b: np.ndarray) -> np.ndarray:
        """b @ a.T through from_float and vec_dot, one output at a time, as ggml_compute_forward_mul_mat."""
        vdt = LibGgml.Dot(self.cpu_traits(dtype).vec_dot)
        b_packed = self.from_float(b, quants.vec_dot_type(dtype), cpu=True)
        out = np.zeros((b.shape[0], a.shape[0]), f32)
        s = np.zeros(1, f32)
        for n, m in np.ndindex(*out.shape):
            row = np.ascontiguousarray(a[m])
            vdt(b.shape[1], s.ctypes.data, 0, row.ctypes.data, 0, b_packed[n].ctypes.data, 0, 1)
            out[n, m] = s[0]
        return out


@pytest.fixture(scope="module")
def libggml() -> LibGgml:
    spec = importlib.util.find_spec("llama_cpp")
    assert spec is not None and spec.origin is not None, "llama-cpp-python, the oracle, is not installed"
    try:
        return LibGgml(pathlib.Path(spec.origin).parent / "lib")
    except (OSError, AttributeError) as err:
        pytest.fail(f"llama-cpp-python's libggml cannot be loaded: {err}")


ALL_WEIGHTS = [*FP16_FIELDS, Q8_K]


@pytest.mark.llama_cpp
@pytest.mark.parametrize("dtype", ALL_WEIGHTS, ids=str)
def test_dequantize_matches_libggml(rng, libggml, dtype):
    raw = (quants.quantize(test_data(rng, 4, 512), Q8_K) if dtype == Q8_K
           else random_blocks(rng, dtype, 4, 512 // dtype.block_size))
    np.testing.assert_array_equal(bits(quants.dequantize(raw, dtype)), bits(libggml.to_float(raw, dtype)))


@pytest.mark.llama_cpp
@pytest.mark.parametrize("dtype", [*LEGACY, Q8_1, Q8_K, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, F16, BF16], ids=str)
def test_quantize_and_cpu_from_float_match_libggml(rng, libggml, dtype):
    x = test_data(rng, 16, 512)
    x[3] = np.abs(x[3])  # all-positive rows take the `this_min > 0` branch of make_qkx2_quants
    x[4, :200] = 0
    x[5] = -np.abs(x[5])
    x[6] *= f32(1e-3)
    x[7, ::7] = f32(3.5)  # repeats and ties
    np.testing.assert_array_equal(quants.quantize(x, dtype), libggml.from_float(x, dtype, cpu=False))
    if dtype in (Q8_0, Q8_1, Q8_K, F16, BF16):  # the vec_dot types
        np.testing.assert_array_equal(quants.cpu_from_float(x, dtype), libggml.from_float(x, dtype, cpu=True))


@pytest.mark.llama_cpp
@pytest.mark.parametrize("dtype", [F32, F16, BF16, *LEGACY, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K], ids=str)
def test_mul_mat_matches_libggml_vec_dot(rng, libggml, dtype):
    assert libggml.cpu_traits(dtype).vec_dot_type == int(quants.vec_dot_type(dtype).ggml_type)
    a = weight(rng, dtype, 6, 512)
    a_bytes = a if a.dtype == np.uint8 else a.view(np.uint8)
    b = test_data(rng, 6, 512)
    expected = libggml.mul_mat(a_bytes, dtype, b)
    a_deq = quants.dequantize(a, dtype)
    b_seen = quants.activation_roundtrip(b, dtype)
    scale = np.abs(b_seen) @ np.abs(a_deq).T
    assert np.all(np.abs(quants.mul_mat_ggml(a, dtype, b) - expected) <= 2e-6 * scale + 1e-30)


@pytest.mark.llama_cpp
@pytest.mark.parametrize("dtype", [Q8_0, Q8_1, Q8_K], ids=str)
def test_activation_quantizers_treat_nan_and_inf_as_ggml(rng, libggml, dtype):
    """x86 from_float with NaN/inf in a block: quantize_row_q8_0/1 fold |x| with maxps (a NaN
    survives only as maxps's second operand), a NaN product packs to -128 and enters q8_1's int32
    sum as -2^31; quantize_row_q8_K_ref's scan skips NaNs and nearest_int(NaN) is 0."""
    x = test_data(rng, 48, 512)
    for r in range(48):
        x[r, rng.integers(0, 512, 1 + r % 4)] = (np.nan, np.inf, -np.inf, np.nan)[r % 4]
    x[0, :256] = np.nan                                    # a block (and a super-block) of NaNs only
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(quants.cpu_from_float(x, dtype), libggml.from_float(x, dtype, cpu=True))
