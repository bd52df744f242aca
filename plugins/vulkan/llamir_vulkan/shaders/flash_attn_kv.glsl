// One element of a K or V tensor as float, whatever its storage. Included once per tensor, after
// defining KV_AT (the function's name), KV_DATA (the binding's array), KV_DESC (its Tensor) and
// KV_FORMAT, one of:
//   KV_FLOAT  float or float16_t storage
//   KV_BF16   uint16_t storage, the high half of an f32
//   KV_Q4_0, KV_Q4_1, KV_Q5_0, KV_Q5_1, KV_Q8_0   uint8_t storage: ggml's blocks of 32 values along
//             ne0 (the descriptor's nb0 is the block's size in bytes, nb1.. are byte strides)
// The include undefines the four macros, ready for the next tensor.
#ifndef FLASH_ATTN_KV_FORMATS
#define FLASH_ATTN_KV_FORMATS
#define KV_FLOAT 0
#define KV_BF16 1
#define KV_Q4_0 2
#define KV_Q4_1 3
#define KV_Q5_0 4
#define KV_Q5_1 5
#define KV_Q8_0 6
#endif

#define KV_BYTE(o) uint(KV_DATA[b + (o)])
#define KV_HALF(o) unpackHalf2x16(KV_BYTE(o) | (KV_BYTE((o) + 1) << 8)).x
#define KV_U32(o) (KV_BYTE(o) | (KV_BYTE((o) + 1) << 8) | (KV_BYTE((o) + 2) << 16) | (KV_BYTE((o) + 3) << 24))
// value j of a block's 16 nibble bytes starting at byte o: the low nibbles are values 0..15
#define KV_NIBBLE(o, j) ((KV_BYTE((o) + (j) % 16) >> (4 * ((j) / 16))) & 0xFu)

float KV_AT(uint i0, uint i1, uint i2, uint i3) {
#if KV_FORMAT == KV_FLOAT
    return float(KV_DATA[at(KV_DESC, i0, i1, i2, i3)]);
#elif KV_FORMAT == KV_BF16
    return uintBitsToFloat(uint(KV_DATA[at(KV_DESC, i0, i1, i2, i3)]) << 16);
#else
    uint b = at(KV_DESC, i0 / 32, i1, i2, i3);  // the block's first byte
    uint j = i0 % 32;
    float d = KV_HALF(0);
#if KV_FORMAT == KV_Q4_0      // d, qs[16]: d * (q - 8)
    return d * float(int(KV_NIBBLE(2, j)) - 8);
#elif KV_FORMAT == KV_Q4_1    // d, m, qs[16]: d * q + m
    return d * float(KV_NIBBLE(4, j)) + KV_HALF(2);
#elif KV_FORMAT == KV_Q5_0    // d, qh (bit j: value j's fifth bit), qs[16]: d * (q - 16)
    uint q = KV_NIBBLE(6, j) | (((KV_U32(2) >> j) & 1u) << 4);
    return d * float(int(q) - 16);
#elif KV_FORMAT == KV_Q5_1    // d, m, qh, qs[16]: d * q + m
    uint q = KV_NIBBLE(8, j) | (((KV_U32(4) >> j) & 1u) << 4);
    return d * float(q) + KV_HALF(2);
#elif KV_FORMAT == KV_Q8_0    // d, qs[32] (int8): d * q
    return d * float(bitfieldExtract(int(KV_BYTE(2 + j)), 0, 8));
#else
#error unknown KV_FORMAT
#endif
#endif
}

#undef KV_BYTE
#undef KV_HALF
#undef KV_U32
#undef KV_NIBBLE
#undef KV_AT
#undef KV_DATA
#undef KV_DESC
#undef KV_FORMAT
