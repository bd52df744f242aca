// The activation operand b of the matrix kernels (mul_mm.comp, mul_mv.comp), read as f32, four
// consecutive elements of a column at a time. ggml's CPU mul_mat sees b in the weight's
// vec_dot_type (llamir/ir/quants.py: vec_dot_type, activation_roundtrip): b itself when it is
// already of that type or the type is f32 (an f16 b widens exactly), else the copy
// quantize_b.comp made in scratch memory (contiguous rows; bf16 counted in 2-byte elements, the
// q8 types in bytes, as lowering.unit_of describes them).
//
// Defines, before including:
//   B_BINDING  the binding of b.
//   B_<TYPE>   its type: B_F32 or B_F16 (any strides), B_BF16 (contiguous rows), or the block
//              types B_Q8_0, B_Q8_1, B_Q8_K (ggml-common.h's block_q8_0 / block_q8_1 / block_q8_K).
//   B_VEC4     (f32 / f16) b's columns are contiguous and start on 4-element boundaries: b4 is
//              one vec4 load. Its value is the vector type: vec4 or f16vec4.
// Provides:
//   vec4 b4(col, k, nb0)   elements k..k+3 of the column whose first element (float types) or
//                          first block (q8 types) is at descriptor index `col`; nb0 is the element
//                          stride of a float column (the q8 types' columns are blocks back to
//                          back). k % 4 == 0 and k + 3 < the column's length.
//   float b1(col, k, nb0)  element k (float types only, B_FLOAT defined: their columns need not
//                          be whole vec4s).
//   float b_sum(col, k)    (q8_1) the block's s = d * sum(q) as stored (f16), for the element k.

#if defined(B_F32) || defined(B_F16) || defined(B_BF16)
#define B_FLOAT 1
#endif

#if defined(B_F32)
layout(std430, binding = B_BINDING) readonly buffer B { float data_b[]; };
#elif defined(B_F16)
layout(std430, binding = B_BINDING) readonly buffer B { float16_t data_b[]; };
#else
layout(std430, binding = B_BINDING) readonly buffer B16 { uint16_t b_u16[]; };
#endif
#ifdef B_VEC4
layout(std430, binding = B_BINDING) readonly buffer B4 { B_VEC4 data_b4[]; };
#endif
#if defined(B_Q8_1) || defined(B_Q8_K)
layout(std430, binding = B_BINDING) readonly buffer B32 { uint b_u32[]; };  // their blocks are 4-byte aligned
#endif

#if defined(B_FLOAT)
float b1(uint col, uint k, uint nb0) {
#if defined(B_BF16)
    return uintBitsToFloat(uint(b_u16[col + k * nb0]) << 16);
#else
    return float(data_b[col + k * nb0]);
#endif
}

vec4 b4(uint col, uint k, uint nb0) {
#if defined(B_VEC4)
    return vec4(data_b4[(col + k) / 4]);
#else
    return vec4(b1(col, k, nb0), b1(col, k + 1u, nb0), b1(col, k + 2u, nb0), b1(col, k + 3u, nb0));
#endif
}

#else
// The four int8 of the little-endian word w, as floats.
vec4 int8x4(uint w) {
    int s = int(w);
    return vec4(bitfieldExtract(s, 0, 8), bitfieldExtract(s, 8, 8), bitfieldExtract(s, 16, 8),
                bitfieldExtract(s, 24, 8));
}

#if defined(B_Q8_0)
// d (f16), qs[32] int8: d * q. Blocks are 34 bytes, so 16-bit aligned: words are read as halves.
vec4 b4(uint col, uint k, uint nb0) {
    uint b = col + (k / 32u) * 34u, i = (b + 2u + k % 32u) >> 1;
    float d = unpackHalf2x16(uint(b_u16[b >> 1])).x;
    return d * int8x4(uint(b_u16[i]) | (uint(b_u16[i + 1u]) << 16));
}
#elif defined(B_Q8_1)
// d (f16), s (f16), qs[32] int8: d * q.
vec4 b4(uint col, uint k, uint nb0) {
    uint b = col + (k / 32u) * 36u;
    return unpackHalf2x16(b_u32[b >> 2]).x * int8x4(b_u32[(b + 4u + k % 32u) >> 2]);
}

float b_sum(uint col, uint k) {
    return unpackHalf2x16(b_u32[(col + (k / 32u) * 36u) >> 2]).y;
}
#elif defined(B_Q8_K)
// d (f32), qs[256] int8, bsums[16] int16: d * q.
vec4 b4(uint col, uint k, uint nb0) {
    uint b = col + (k / 256u) * 292u;
    return uintBitsToFloat(b_u32[b >> 2]) * int8x4(b_u32[(b + 4u + k % 256u) >> 2]);
}
#else
#error "mul_b.glsl: define one B_<TYPE>"
#endif
#endif
