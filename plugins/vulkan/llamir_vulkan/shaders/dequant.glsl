// The weight operand of the matrix kernels (src0 of mul_mat / mul_mat_id / get_rows), read and
// dequantized to f32, four consecutive elements of a row at a time (ggml-common.h's block layouts,
// ggml-quants.c's dequantize_row_* arithmetic).
//
// Defines, before including:
//   A_BINDING  the binding of the weight tensor.
//   A_<TYPE>   its type, one of A_F32 A_F16 A_BF16 A_Q4_0 A_Q4_1 A_Q5_0 A_Q5_1 A_Q8_0 A_Q2_K
//              A_Q3_K A_Q4_K A_Q5_K A_Q6_K (a compile-time choice: no branching on the type).
//   A_UNIT     bytes per element of the tensor's descriptor (lowering.unit_of), for bf16.
//   A_VEC4     (f32 / f16) rows are contiguous and every row starts on a 4-element boundary:
//              dequant4 is one vec4 load.
//   A_SPLIT_MIN (q4_1 / q5_1) dequant4 leaves out the block's min m (d * q only) and a_min
//              gives it: the matrix kernels add m * s_b per block, as ggml's vec_dot_q4_1_q8_1.
// Provides:
//   QK                          elements per block (1 for float types; A_FLOAT is then defined).
//   vec4 dequant4(row, k, nb0)  elements k..k+3 of the row whose first element (float types) or
//                               first block (quantized) is at descriptor index `row`; nb0 is the
//                               element stride of a float row (quantized rows are whole blocks
//                               back to back, QUANT_BYTES apart). k % 4 == 0 and k + 3 < the row.
//   float dequant1(row, k, nb0) element k (float types only: their rows need not be 4-aligned).
//   float a_min(row, k)         (A_SPLIT_MIN) the min m of the block holding element k.
// The binding is seen through aliased views: bytes and 16-bit words for the block types (blocks
// are 2-byte aligned), the element type and its vec4 for f32 / f16.

layout(std430, binding = A_BINDING) readonly buffer A8 { uint8_t a_u8[]; };
layout(std430, binding = A_BINDING) readonly buffer A16 { uint16_t a_u16[]; };

#if defined(A_F32) || defined(A_F16) || defined(A_BF16)
#define A_FLOAT 1
#define QK 1
#elif defined(A_Q4_0)
#define QK 32
#define QUANT_BYTES 18
#elif defined(A_Q4_1)
#define QK 32
#define QUANT_BYTES 20
#elif defined(A_Q5_0)
#define QK 32
#define QUANT_BYTES 22
#elif defined(A_Q5_1)
#define QK 32
#define QUANT_BYTES 24
#elif defined(A_Q8_0)
#define QK 32
#define QUANT_BYTES 34
#elif defined(A_Q2_K)
#define QK 256
#define QUANT_BYTES 84
#elif defined(A_Q3_K)
#define QK 256
#define QUANT_BYTES 110
#elif defined(A_Q4_K)
#define QK 256
#define QUANT_BYTES 144
#elif defined(A_Q5_K)
#define QK 256
#define QUANT_BYTES 176
#elif defined(A_Q6_K)
#define QK 256
#define QUANT_BYTES 210
#else
#error "dequant.glsl: define one A_<TYPE>"
#endif

#if defined(A_F32)
layout(std430, binding = A_BINDING) readonly buffer AF32 { float a_f32[]; };
layout(std430, binding = A_BINDING) readonly buffer AF32x4 { vec4 a_f32x4[]; };
#elif defined(A_F16)
layout(std430, binding = A_BINDING) readonly buffer AF16 { float16_t a_f16[]; };
layout(std430, binding = A_BINDING) readonly buffer AF16x4 { f16vec4 a_f16x4[]; };
#endif

// -- raw reads (byte addresses) -------------------------------------------------------------------
uint a_byte(uint i) {
    return uint(a_u8[i]);
}

// The little-endian 32 bits at the even byte address i.
uint a_word(uint i) {
    return uint(a_u16[i >> 1]) | (uint(a_u16[(i >> 1) + 1]) << 16);
}

// The fp16 at the even byte address i.
float a_half(uint i) {
    return unpackHalf2x16(uint(a_u16[i >> 1])).x;
}

// The four bytes of w, low first, as floats.
vec4 bytes4(uint w) {
    return vec4(w & 0xFFu, (w >> 8) & 0xFFu, (w >> 16) & 0xFFu, w >> 24);
}

// The low bits of w's four bytes as 0/1, low byte first.
vec4 bits4(uint w) {
    return vec4(w & 1u, (w >> 1) & 1u, (w >> 2) & 1u, (w >> 3) & 1u);
}

#if defined(A_Q4_K) || defined(A_Q5_K)
// ggml's get_scale_min_k4: the 6-bit scale and min of sub-block j from the 12 bytes at s.
vec2 scale_min_k4(uint s, uint j) {
    uint lo = j < 4u ? a_byte(s + j) & 63u : (a_byte(s + j + 4u) & 0xFu) | ((a_byte(s + j - 4u) >> 6) << 4);
    uint hi = j < 4u ? a_byte(s + j + 4u) & 63u : (a_byte(s + j + 4u) >> 4) | ((a_byte(s + j) >> 6) << 4);
    return vec2(lo, hi);
}
#endif

// -- one type's four elements ---------------------------------------------------------------------
#if defined(A_FLOAT)
float dequant1(uint row, uint k, uint nb0) {
    uint i = row + k * nb0;
#if defined(A_F32)
    return a_f32[i];
#elif defined(A_F16)
    return float(a_f16[i]);
#else
    return uintBitsToFloat(uint(a_u16[i * A_UNIT / 2u]) << 16);
#endif
}

vec4 dequant4(uint row, uint k, uint nb0) {
#if defined(A_VEC4) && defined(A_F32)
    return a_f32x4[(row + k) / 4];
#elif defined(A_VEC4) && defined(A_F16)
    return vec4(a_f16x4[(row + k) / 4]);
#else
    return vec4(dequant1(row, k, nb0), dequant1(row, k + 1u, nb0), dequant1(row, k + 2u, nb0),
                dequant1(row, k + 3u, nb0));
#endif
}

#else
// Elements j..j+3 of the block at byte b.
vec4 dequant_block4(uint b, uint j) {
#if defined(A_Q4_0)
    // d, qs[16]: element j < 16 is qs[j]'s low nibble, j >= 16 qs[j - 16]'s high one; q - 8
    uint q = (a_word(b + 2u + (j & 15u)) >> ((j >> 4) * 4u)) & 0x0F0F0F0Fu;
    return (bytes4(q) - 8.0) * a_half(b);
#elif defined(A_Q4_1)
    // d, m, qs[16]: q * d + m
    uint q = (a_word(b + 4u + (j & 15u)) >> ((j >> 4) * 4u)) & 0x0F0F0F0Fu;
#ifdef A_SPLIT_MIN
    return bytes4(q) * a_half(b);
#else
    return bytes4(q) * a_half(b) + a_half(b + 2u);
#endif
#elif defined(A_Q5_0)
    // d, qh (bit j: element j's fifth bit), qs[16]; q - 16
    uint q = (a_word(b + 6u + (j & 15u)) >> ((j >> 4) * 4u)) & 0x0F0F0F0Fu;
    vec4 h = bits4(a_word(b + 2u) >> j);
    return (bytes4(q) + 16.0 * h - 16.0) * a_half(b);
#elif defined(A_Q5_1)
    // d, m, qh, qs[16]
    uint q = (a_word(b + 8u + (j & 15u)) >> ((j >> 4) * 4u)) & 0x0F0F0F0Fu;
    vec4 h = bits4(a_word(b + 4u) >> j);
#ifdef A_SPLIT_MIN
    return (bytes4(q) + 16.0 * h) * a_half(b);
#else
    return (bytes4(q) + 16.0 * h) * a_half(b) + a_half(b + 2u);
#endif
#elif defined(A_Q8_0)
    // d, qs[32] int8
    int w = int(a_word(b + 2u + j));
    vec4 q = vec4(bitfieldExtract(w, 0, 8), bitfieldExtract(w, 8, 8), bitfieldExtract(w, 16, 8),
                  bitfieldExtract(w, 24, 8));
    return q * a_half(b);
#elif defined(A_Q2_K)
    // scales[16] (low nibble scale, high nibble min per 16 elements), qs[64], d, dmin; element
    // j = 128n + 32s + l is bits 2s..2s+1 of qs[32n + l]
    uint sc = a_byte(b + (j >> 4));
    uint q = (a_word(b + 16u + 32u * (j >> 7) + (j & 31u)) >> (2u * ((j >> 5) & 3u))) & 0x03030303u;
    return a_half(b + 80u) * float(sc & 0xFu) * bytes4(q) - a_half(b + 82u) * float(sc >> 4);
#elif defined(A_Q3_K)
    // hmask[32], qs[64], scales[12] (16 6-bit scales, biased by 32), d; element j's low two bits
    // as in q2_K, its high bit is bit j/32 of hmask[j % 32] (clear: subtract 4)
    uint s = j >> 4;
    uint lo = (a_byte(b + 96u + (s & 7u)) >> (4u * (s >> 3))) & 0xFu;
    uint hi = (a_byte(b + 104u + (s & 3u)) >> (2u * (s >> 2))) & 3u;
    float dl = a_half(b + 108u) * float(int(lo | (hi << 4)) - 32);
    uint q = (a_word(b + 32u + 32u * (j >> 7) + (j & 31u)) >> (2u * ((j >> 5) & 3u))) & 0x03030303u;
    vec4 h = bytes4((a_word(b + (j & 31u)) >> (j >> 5)) & 0x01010101u);
    return dl * (bytes4(q) - 4.0 + 4.0 * h);
#elif defined(A_Q4_K)
    // d, dmin, scales[12] (8 6-bit scale/min pairs), qs[128]: sub-block 2c + h is the low (h = 0)
    // or high nibbles of qs[32c..32c+31]; d * sc * q - dmin * m
    uint sb = j >> 5;
    vec2 sm = scale_min_k4(b + 4u, sb);
    uint q = (a_word(b + 16u + 32u * (sb >> 1) + (j & 31u)) >> (4u * (sb & 1u))) & 0x0F0F0F0Fu;
    return a_half(b) * sm.x * bytes4(q) - a_half(b + 2u) * sm.y;
#elif defined(A_Q5_K)
    // d, dmin, scales[12], qh[32] (bit sb of qh[l]: the fifth bit of sub-block sb's element l), qs[128]
    uint sb = j >> 5;
    vec2 sm = scale_min_k4(b + 4u, sb);
    uint q = (a_word(b + 48u + 32u * (sb >> 1) + (j & 31u)) >> (4u * (sb & 1u))) & 0x0F0F0F0Fu;
    vec4 h = bytes4((a_word(b + 16u + (j & 31u)) >> sb) & 0x01010101u);
    return a_half(b) * sm.x * (bytes4(q) + 16.0 * h) - a_half(b + 2u) * sm.y;
#elif defined(A_Q6_K)
    // ql[128], qh[64], scales[16] int8, d: element j = 128h + 32k + l has its low nibble in
    // ql[64h + 32(k & 1) + l] (the high nibble for k >= 2), its high two bits at 2k in qh[32h + l]
    uint h = j >> 7, k = (j >> 5) & 3u, l = j & 31u;
    uint lo = (a_word(b + 64u * h + 32u * (k & 1u) + l) >> (4u * (k >> 1))) & 0x0F0F0F0Fu;
    uint hi = (a_word(b + 128u + 32u * h + l) >> (2u * k)) & 0x03030303u;
    float sc = float(bitfieldExtract(int(a_byte(b + 192u + (j >> 4))), 0, 8));
    return a_half(b + 208u) * sc * (bytes4(lo | (hi << 4)) - 32.0);
#endif
}

vec4 dequant4(uint row, uint k, uint nb0) {
    return dequant_block4(row + (k / QK) * QUANT_BYTES, k % QK);
}

#ifdef A_SPLIT_MIN
float a_min(uint row, uint k) {
    return a_half(row + (k / QK) * QUANT_BYTES + 2u);
}
#endif
#endif
