#version 450
// dst[..., idx[..., i], :] = convert(src[..., i, :]), in place: ggml's set_rows (the KV-cache
// write). src [ne3, ne2, N, ne0] (ggml order reversed), idx [ne2', N] or [ne3', ne2', N] tiled
// over src's batch axes. One thread per element for a float dst, per block for a quantized one.
// Defines: S_TYPE/LOAD_S (src, see cpy_types.glsl), IDX64 (i64 indices, else i32), and
// D_TYPE/STORE_D (a float dst) or QUANT_<type> (a quantized dst, see quantize.glsl).
#include "common.glsl"
#include "cpy_types.glsl"

layout(std430, binding = 0) readonly buffer Params { Tensor s; Tensor i; Tensor d; } p;
layout(std430, binding = 1) readonly buffer S { S_TYPE data_s[]; };
#ifdef IDX64
layout(std430, binding = 2) readonly buffer I { uvec2 data_i[]; };  // .x: the low word (indices are small)
#else
layout(std430, binding = 2) readonly buffer I { int data_i[]; };
#endif
#ifdef D_TYPE
layout(std430, binding = 3) writeonly buffer D { D_TYPE data_d[]; };
#else
layout(std430, binding = 3) writeonly buffer Q { uint8_t data_q[]; };
#include "quantize.glsl"
#endif

// The dst row that src row (i1, i2, i3) goes to.
uint dst_row(uint i1, uint i2, uint i3) {
    uint k = at(p.i, i1, i2 % p.i.ne1, i3 % p.i.ne2, 0);
#ifdef IDX64
    return data_i[k].x;
#else
    return uint(data_i[k]);
#endif
}

void main() {
    uint t = thread_id();
#ifdef D_TYPE
    if (t >= nelements(p.s)) {
        return;
    }
    uvec4 c = unravel(p.s, t);
    float v = LOAD_S(data_s[at(p.s, c.x, c.y, c.z, c.w)]);
    data_d[at(p.d, c.x, dst_row(c.y, c.z, c.w), c.z, c.w)] = STORE_D(v);
#else
    uint nblocks = p.s.ne0 / QK;
    if (t >= nblocks * nrows(p.s)) {
        return;
    }
    uint blk = t % nblocks;
    uint r = t / nblocks;
    uint i1 = r % p.s.ne1;
    r /= p.s.ne1;
    uint i2 = r % p.s.ne2;
    uint i3 = r / p.s.ne2;
    for (uint j = 0; j < QK; ++j) {
        qx[j] = LOAD_S(data_s[at(p.s, blk * QK + j, i1, i2, i3)]);
    }
    quantize_block(at(p.d, blk, dst_row(i1, i2, i3), i2, i3));  // nb0: the block's size
#endif
}
