// Storage types a shader converts to and from float: bf16 (held in uint16_t) and the bit
// patterns of f16 values. A kernel names a tensor's storage with defines, as the Python side's
// kernels_elementwise.storage() sets them: X_TYPE (the buffer's element type), LOAD_X (storage
// -> float: float, bf16_to_f32) and STORE_X (float -> storage: float, float16_t, int,
// f32_to_bf16), for each tensor X of the shader.

// bf16 storage <-> float. Macros, as a uint16_t cannot be a function's parameter or result
// without 16-bit arithmetic types: the conversion to and from uint happens at the buffer.
#define bf16_to_f32(v) uintBitsToFloat(uint(v) << 16)
#define f32_to_bf16(x) uint16_t(bf16_bits(x))

// ggml's GGML_FP32_TO_BF16: round to nearest even, a NaN stays a quiet NaN.
uint bf16_bits(float x) {
    uint u = floatBitsToUint(x);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
        return (u >> 16) | 64u;
    }
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

// The f16 bits of x as ggml's GGML_FP32_TO_FP16 (F16C) computes them: round to nearest even,
// subnormals kept, overflow to infinity, a NaN as sign | 0x7E00.
uint f16_bits(float x) {
    uint u = floatBitsToUint(x);
    uint sign = (u >> 16) & 0x8000u;
    uint a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) {
        return sign | 0x7E00u;
    }
    if (a >= 0x477FF000u) {  // 65520 and above round to infinity
        return sign | 0x7C00u;
    }
    if (a >= 0x38800000u) {  // a normal f16: rebias the exponent by 112, round off 13 bits
        return sign | ((a + 0xC8000FFFu + ((a >> 13) & 1u)) >> 13);
    }
    uint e = a >> 23;
    if (e < 102u) {  // below 2^-25: zero
        return sign;
    }
    // a subnormal f16: the 24-bit significand in units of 2^-24, rounded to nearest even
    uint m = (a & 0x7FFFFFu) | 0x800000u;
    uint shift = 126u - e;
    uint q = m >> shift;
    uint rest = m & ((1u << shift) - 1u);
    uint half_ = 1u << (shift - 1u);
    if (rest > half_ || (rest == half_ && (q & 1u) != 0u)) {
        q += 1u;
    }
    return sign | q;
}
