// mul_mv.comp's word-wide reads (MV_WORDS): a thread takes CHUNK consecutive elements of a row of
// a and of each column of b per step, loading their bytes as 32-bit words instead of 16-bit or
// byte reads per four elements (lavapipe runs an invocation as one SIMD lane: every load is a
// gather, so fewer loads are what counts). The arithmetic is dequant.glsl's and mul_b.glsl's,
// element for element.
//
// Needs dequant.glsl and mul_b.glsl included first (a quantized A_<TYPE>, b a q8 type), and both
// bindings' ranges a whole number of words (kernels_matmul.py checks): blocks are only 2-byte
// aligned, so a run of bytes at an even address is read as the aligned words around it, shifted.
// Provides:
//   CHUNK                                  elements per step (it divides QK, or QK divides it).
//   void a_chunk(uint blk, uint j0, out vec4 va[CHUNK / 4])  elements j0.. of the block at byte blk.
//   void b_chunk(uint col, uint k0, out vec4 vb[CHUNK / 4])  elements k0.. of the column at byte col.

layout(std430, binding = A_BINDING) readonly buffer AW { uint a_w32[]; };
layout(std430, binding = B_BINDING) readonly buffer BW { uint b_w32[]; };

#if defined(A_Q4_K)
#define CHUNK 64  // two sub-blocks sharing their 32 bytes of qs
#else
#define CHUNK 32
#endif

// The 32 bits at byte sh / 8 of the 64 bits lo, hi (sh 0 or 16).
uint funnel(uint lo, uint hi, uint sh) {
    return (lo >> sh) | ((hi << 1) << (31u - sh));
}

// W[0..N-1] = the little-endian words at bytes byte, byte + 4, ... of VIEW (byte even).
#define LOAD_WORDS(VIEW, W, N, byte)                                                                \
    {                                                                                             \
        uint w_ = (byte) >> 2, sh_ = ((byte) & 2u) * 8u, last_ = uint(VIEW.length()) - 1u;       \
        uint raw_[N + 1];                                                                         \
        [[unroll]] for (uint t_ = 0; t_ <= N; t_++) {                                             \
            raw_[t_] = VIEW[min(w_ + t_, last_)];                                                 \
        }                                                                                         \
        [[unroll]] for (uint t_ = 0; t_ < N; t_++) {                                              \
            W[t_] = funnel(raw_[t_], raw_[t_ + 1], sh_);                                          \
        }                                                                                         \
    }

// The four int8 of w as floats.
vec4 sbytes4(uint w) {
    int s = int(w);
    return vec4(bitfieldExtract(s, 0, 8), bitfieldExtract(s, 8, 8), bitfieldExtract(s, 16, 8),
                bitfieldExtract(s, 24, 8));
}

void a_chunk(uint blk, uint j0, out vec4 va[CHUNK / 4]) {
#if defined(A_Q4_0)
    // d, qs[16]: the low nibbles are elements 0..15, the high ones 16..31; (q - 8) * d
    float d = a_half(blk);
    uint W[4];
    LOAD_WORDS(a_w32, W, 4, blk + 2u);
    [[unroll]] for (uint i = 0; i < 4; i++) {
        va[i] = (bytes4(W[i] & 0x0F0F0F0Fu) - 8.0) * d;
        va[i + 4] = (bytes4((W[i] >> 4) & 0x0F0F0F0Fu) - 8.0) * d;
    }
#elif defined(A_Q8_0)
    // d, qs[32] int8: q * d
    float d = a_half(blk);
    uint W[8];
    LOAD_WORDS(a_w32, W, 8, blk + 2u);
    [[unroll]] for (uint i = 0; i < 8; i++) {
        va[i] = sbytes4(W[i]) * d;
    }
#elif defined(A_Q4_K)
    // d, dmin, scales[12], qs[128]: sub-blocks 2c, 2c + 1 (j0 = 64c) are the low and high
    // nibbles of qs[32c..32c+31]; d * sc * q - dmin * m
    uint sb = j0 >> 5;
    vec2 lo = scale_min_k4(blk + 4u, sb), hi = scale_min_k4(blk + 4u, sb + 1u);
    float d = a_half(blk), dmin = a_half(blk + 2u);
    uint W[8];
    LOAD_WORDS(a_w32, W, 8, blk + 16u + 32u * (sb >> 1));
    [[unroll]] for (uint i = 0; i < 8; i++) {
        va[i] = d * lo.x * bytes4(W[i] & 0x0F0F0F0Fu) - dmin * lo.y;
        va[i + 8] = d * hi.x * bytes4((W[i] >> 4) & 0x0F0F0F0Fu) - dmin * hi.y;
    }
#elif defined(A_Q6_K)
    // ql[128], qh[64], scales[16] int8, d: element j0 + l (j0 = 128h + 32k) has its low nibble
    // in ql[64h + 32(k & 1) + l] (the high one for k >= 2), its high two bits at 2k in qh[32h + l]
    uint h = j0 >> 7, k = (j0 >> 5) & 3u;
    uint L[8], H[8];
    LOAD_WORDS(a_w32, L, 8, blk + 64u * h + 32u * (k & 1u));
    LOAD_WORDS(a_w32, H, 8, blk + 128u + 32u * h);
    uint sc2 = uint(a_u16[(blk + 192u + (j0 >> 4)) >> 1]);  // the scales of elements 0..15, 16..31
    float d = a_half(blk + 208u);
    float s0 = d * float(bitfieldExtract(int(sc2), 0, 8)), s1 = d * float(bitfieldExtract(int(sc2), 8, 8));
    [[unroll]] for (uint i = 0; i < 8; i++) {
        uint q = ((L[i] >> (4u * (k >> 1))) & 0x0F0F0F0Fu) | (((H[i] >> (2u * k)) & 0x03030303u) << 4);
        va[i] = (i < 4 ? s0 : s1) * (bytes4(q) - 32.0);
    }
#else
    [[unroll]] for (uint i = 0; i < CHUNK / 4; i++) {
        va[i] = dequant_block4(blk, j0 + 4u * i);
    }
#endif
}

void b_chunk(uint col, uint k0, out vec4 vb[CHUNK / 4]) {
#if defined(B_Q8_0)
    // 34-byte blocks d (f16), qs[32]; CHUNK is 32: one block
    uint blk = col + (k0 / 32u) * 34u;
    float d = unpackHalf2x16(uint(b_u16[blk >> 1])).x;
    uint W[8];
    LOAD_WORDS(b_w32, W, 8, blk + 2u);
    [[unroll]] for (uint i = 0; i < 8; i++) {
        vb[i] = d * int8x4(W[i]);
    }
#else
    // q8_1: 36-byte blocks d, s (f16), qs[32]; q8_K: 292-byte blocks d (f32), qs[256], bsums
#if defined(B_Q8_1)
    uint blk = col + (k0 / 32u) * 36u;
    float d = unpackHalf2x16(b_w32[blk >> 2]).x;
    uint q = (blk + 4u) >> 2;
#else
    uint blk = col + (k0 / 256u) * 292u;
    float d = uintBitsToFloat(b_w32[blk >> 2]);
    uint q = (blk + 4u + k0 % 256u) >> 2;
#endif
    [[unroll]] for (uint i = 0; i < CHUNK / 4; i++) {
        vb[i] = d * int8x4(b_w32[q + i]);
    }
#endif
}
