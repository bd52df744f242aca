// f32 -> quantized block encoders, as the reference interpreter's from_f32 quantizes a block
// (llamir/ir/quants.py): ggml's quantize_row_*_ref for q4_0, q4_1, q5_0, q5_1 and the K-quants
// (quantize_k.glsl), ggml-cpu's x86 from_float for q8_0 (id = 127/amax, round half to even);
// and the activation types of the matrix kernels (quantize_b.comp, as llamir's cpu_from_float):
// q8_0 and q8_1 as ggml-cpu's x86 from_float, q8_K as quantize_row_q8_K_ref.
// Every sum and product that the reference rounds on its own is `precise`, so that none is
// fused and the result matches the reference bit for bit.
//
// Defines: one of QUANT_Q4_0, QUANT_Q4_1, QUANT_Q5_0, QUANT_Q5_1, QUANT_Q8_0, QUANT_Q8_1,
// QUANT_Q8_K, QUANT_Q2_K, QUANT_Q3_K, QUANT_Q4_K, QUANT_Q5_K, QUANT_Q6_K. The including shader
// declares the byte buffer `data_q` (uint8_t) blocks are written to, and includes cpy_types.glsl
// first. It sets the QK values of a block in qx, then quantize_block(at) encodes them into the
// block at byte `at`.

#if defined(QUANT_Q2_K) || defined(QUANT_Q3_K) || defined(QUANT_Q4_K) || defined(QUANT_Q5_K) || defined(QUANT_Q6_K)
#define QUANT_K 1
#endif
#if defined(QUANT_K) || defined(QUANT_Q8_K)
const uint QK = 256;
#else
const uint QK = 32;
#endif

float qx[QK];  // the block's values (private to the invocation)

void put_byte(uint at_, uint v) {
    data_q[at_] = uint8_t(v & 0xFFu);
}

void put_f16(uint at_, float v) {
    uint h = f16_bits(v);
    put_byte(at_, h);
    put_byte(at_ + 1u, h >> 8);
}

// v as the f16 a block stores, back in f32 (ggml's GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(v))).
float f16_rounded(float v) {
    return unpackHalf2x16(f16_bits(v)).x;
}

#ifndef QUANT_K
void put_u32(uint at_, uint v) {
    [[unroll]] for (uint k = 0; k < 4u; ++k) {
        put_byte(at_ + k, v >> (8u * k));
    }
}

// The levels q (0..15 in the low nibbles, bit 4 into qh) as ggml packs them: byte j holds
// element j in its low nibble and element j + 16 in its high one; bit j of qh is element j's bit 4.
void put_levels(uint at_, uint q[QK]) {
    [[unroll]] for (uint j = 0; j < QK / 2u; ++j) {
        put_byte(at_ + j, (q[j] & 0xFu) | ((q[j + QK / 2u] & 0xFu) << 4));
    }
}

uint high_bits(uint q[QK]) {
    uint qh = 0u;
    [[unroll]] for (uint j = 0; j < QK; ++j) {
        qh |= ((q[j] >> 4) & 1u) << j;
    }
    return qh;
}
#endif

#if defined(QUANT_Q4_0) || defined(QUANT_Q5_0)
// q4_0 / q5_0: d = max / -nmax (max: the first value of largest magnitude), q = (x / d + nmax + 0.5)
// truncated, at most 2 nmax - 1.
void quantize_block(uint at_) {
#ifdef QUANT_Q4_0
    const float nmax = 8.0;
#else
    const float nmax = 16.0;
#endif
    float amax = 0.0;
    float vmax = 0.0;
    [[unroll]] for (uint j = 0; j < QK; ++j) {
        if (amax < abs(qx[j])) {
            amax = abs(qx[j]);
            vmax = qx[j];
        }
    }
    precise float d = vmax / -nmax;
    precise float id = d != 0.0 ? 1.0 / d : 0.0;
    uint q[QK];
    [[unroll]] for (uint j = 0; j < QK; ++j) {
        precise float t = qx[j] * id + (nmax + 0.5);
        q[j] = min(uint(2.0 * nmax) - 1u, uint(int(t)));
    }
    put_f16(at_, d);
#ifdef QUANT_Q4_0
    put_levels(at_ + 2u, q);
#else
    put_u32(at_ + 2u, high_bits(q));
    put_levels(at_ + 6u, q);
#endif
}
#endif

#if defined(QUANT_Q4_1) || defined(QUANT_Q5_1)
// q4_1 / q5_1: d = (max - min) / levels, m = min, q = ((x - min) / d + 0.5) truncated (q4_1
// clamps it to 15).
void quantize_block(uint at_) {
#ifdef QUANT_Q4_1
    const float levels = 15.0;
#else
    const float levels = 31.0;
#endif
    float lo = qx[0];
    float hi = qx[0];
    [[unroll]] for (uint j = 1; j < QK; ++j) {
        lo = min(lo, qx[j]);
        hi = max(hi, qx[j]);
    }
    precise float d = (hi - lo) / levels;
    precise float id = d != 0.0 ? 1.0 / d : 0.0;
    uint q[QK];
    [[unroll]] for (uint j = 0; j < QK; ++j) {
        precise float t = (qx[j] - lo) * id + 0.5;
        q[j] = uint(int(t));
#ifdef QUANT_Q4_1
        q[j] = min(q[j], 15u);
#endif
    }
    put_f16(at_, d);
    put_f16(at_ + 2u, lo);
#ifdef QUANT_Q4_1
    put_levels(at_ + 4u, q);
#else
    put_u32(at_ + 4u, high_bits(q));
    put_levels(at_ + 8u, q);
#endif
}
#endif

#if defined(QUANT_Q8_0) || defined(QUANT_Q8_1)
// q8_0 / q8_1 as ggml-cpu's AVX quantize_row_q8_0 / _q8_1: d = amax / 127, q = x * (127 / amax)
// rounded half to even; q8_1 also stores s = d * sum(q) (d before its f16 rounding) after d.
void quantize_block(uint at_) {
    float amax = 0.0;
    [[unroll]] for (uint j = 0; j < QK; ++j) {
        amax = max(amax, abs(qx[j]));
    }
    precise float d = amax / 127.0;
    precise float id = amax != 0.0 ? 127.0 / amax : 0.0;
    put_f16(at_, d);
#ifdef QUANT_Q8_1
    const uint qs = at_ + 4u;
#else
    const uint qs = at_ + 2u;
#endif
    int sum = 0;
    [[unroll]] for (uint j = 0; j < QK; ++j) {
        precise float t = qx[j] * id;
        int q = int(roundEven(t));
        sum += q;
        put_byte(qs + j, uint(clamp(q, -128, 127)));
    }
#ifdef QUANT_Q8_1
    precise float s = float(sum) * d;
    put_f16(at_ + 2u, s);
#endif
}
#endif

#ifdef QUANT_Q8_K
// q8_K as ggml's quantize_row_q8_K_ref: iscale = -127 / max (max: the first value of largest
// magnitude), q = min(127, nearest_int(iscale * x)), d = 1 / iscale (f32), and bsums[16], the
// sums of q over each 16 values (int16). A block of zeros is d = 0, q = 0.
void quantize_block(uint at_) {
    float amax = 0.0;
    float vmax = 0.0;
    [[unroll]] for (uint j = 0; j < QK; ++j) {
        if (amax < abs(qx[j])) {
            amax = abs(qx[j]);
            vmax = qx[j];
        }
    }
    precise float iscale = amax != 0.0 ? -127.0 / vmax : 0.0;
    precise float d = amax != 0.0 ? 1.0 / iscale : 0.0;
    put_u32(at_, floatBitsToUint(d));
    for (uint g = 0; g < QK / 16u; ++g) {
        int sum = 0;
        [[unroll]] for (uint j = 16u * g; j < 16u * g + 16u; ++j) {
            precise float t = iscale * qx[j];
            int q = isnan(t) ? 0 : min(127, int(roundEven(t)));  // nearest_int(NaN) is 0
            sum += q;
            put_byte(at_ + 4u + j, uint(q));
        }
        put_byte(at_ + 260u + 2u * g, uint(sum));
        put_byte(at_ + 261u + 2u * g, uint(sum) >> 8);
    }
}
#endif

#ifdef QUANT_K
#include "quantize_k.glsl"
#endif
